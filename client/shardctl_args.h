#ifndef SHARDD_CLIENT_SHARDCTL_ARGS_H_
#define SHARDD_CLIENT_SHARDCTL_ARGS_H_

// Command-line parsing of shardctl, kept apart from main so it can be
// tested. Flags take their value as the next argument or after '='
// ("--dp 8", "--dp=8").

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/plan_printer.h"
#include "proto/coordinator.pb.h"
#include "proto/plan.pb.h"

namespace shardd {

enum class ShardctlCommand {
  kHelp,
  kStrategies,
  kPlan,
  kStatus,
  kTrain,
  kCheckpointList,         // "checkpoint list"
  kCheckpointConsolidate,  // "checkpoint consolidate"
  kCheckpointExport,       // "checkpoint export"
  kCheckpointSave,         // "checkpoint save"
  kCheckpointLoad,         // "checkpoint load"
};

struct ShardctlArgs {
  ShardctlCommand command = ShardctlCommand::kHelp;
  // kHelp: the command whose help to print (kHelp: the overview).
  ShardctlCommand help_for = ShardctlCommand::kHelp;

  // "host:port"; empty: work in-process (strategies, plan).
  std::string coordinator;
  // Connect and per-call deadline.
  absl::Duration timeout = absl::Seconds(30);
  // Security of the connection to the coordinator: --tls-ca (set: TLS),
  // --tls-cert/--tls-key (client certificate for mutual TLS) and
  // --token-file (the client bearer token; default: $SHARDD_TOKEN_FILE).
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string token_file;
  bool json = false;

  // plan: exactly one of the two is set; train: model_path or model_id.
  std::string hf_config_path;  // --hf-config: an HF config.json.
  std::string model_path;      // --model: native spec or HF config.
  std::string model_id;        // --model-id: a model the coordinator has.
  // Plan options. For train the step shape (microbatches, defer_grad_sync)
  // moves to `train`, and a mesh without --dp gets dp_shard 0: the client
  // fills in the live workers (divided by --replicate).
  v1::PlanOptions options;
  // --device-memory: the per-rank peak is checked against it. Applied by
  // the client only, so remote and in-process plans print the same.
  int64_t device_memory_bytes = kDefaultDeviceMemoryBytes;

  // train: the job (defaults: 100 steps, 32 sequences of 64 tokens, one
  // micro-batch, lr 1e-3, grad clip 1.0, synthetic data).
  v1::TrainConfig train;
  // Plain progress lines every N steps when the output is not a terminal;
  // 0: about 20 lines per job.
  int32_t log_every = 0;
  // checkpoint list: only this job's checkpoints (--job); empty: all.
  std::string checkpoint_job;
  // checkpoint consolidate: the checkpoint directory (--checkpoint), where
  // the result goes (--out) and, with --hf, the HF naming of the export
  // ("qwen3-moe", "mixtral", "gpt-oss", "diffusion-gemma" or "none"; empty:
  // a shardd checkpoint).
  // checkpoint export: the checkpoint (--checkpoint), the Hugging Face
  // directory written (--hf, in out_path) and its shard size
  // (--max-shard-bytes, 0: one file); for a LoRA checkpoint, the Hugging
  // Face base the job started from (--base: DiffusionGemma's experts
  // adapters are exported against its per_expert_scale).
  std::string checkpoint_path;
  std::string out_path;
  std::string base_path;
  std::string hf_naming;
  int64_t max_shard_bytes = 0;
  // Give up watching when the coordinator sends no event for this long.
  absl::Duration watch_timeout = absl::Minutes(10);
  // plan --timeline-svg: where the live-memory timeline SVG goes (empty:
  // none); --compare-strategy: a second strategy whose total it overlays.
  std::string timeline_svg_path;
  std::string compare_strategy;
  // train --loss-svg: where the loss curve SVG goes (empty: none).
  std::string loss_svg_path;
  // train: how long to keep reconnecting to a coordinator that went away
  // (it may be restarting) before giving up.
  absl::Duration reconnect_timeout = absl::Seconds(120);
};

// Parses argv without the program name.
// Errors: INVALID_ARGUMENT for usage errors, naming the flag and what it
// accepts ("--dp: expected an integer >= 1, got 'x'"): unknown command or
// flag, missing or malformed value, a flag the command does not take, a
// missing required flag, train's --dp or --model-id combined with options
// the stored model already fixes. Sizes (--device-memory) are "80GiB", "80GB"
// (decimal), "1024MiB" or a plain number of GiB, in (0, 1 PiB].
absl::StatusOr<ShardctlArgs> ParseShardctlArgs(
    const std::vector<std::string>& args);

// The flags `command` accepts (with or without a value).
const std::set<std::string>& ShardctlFlags(ShardctlCommand command);

}  // namespace shardd

#endif  // SHARDD_CLIENT_SHARDCTL_ARGS_H_
