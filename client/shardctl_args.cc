#include "client/shardctl_args.h"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "planner/activation_model.h"

namespace shardd {
namespace {

absl::Status Usage(absl::string_view message) {
  return absl::InvalidArgumentError(message);
}

absl::StatusOr<int32_t> ParseInt(absl::string_view flag,
                                 absl::string_view value, int32_t min) {
  int64_t parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed) || parsed < min ||
      parsed > std::numeric_limits<int32_t>::max()) {
    return Usage(absl::StrCat(flag, ": expected an integer >= ", min, ", got '",
                              value, "'"));
  }
  return static_cast<int32_t>(parsed);
}

// A directory the workers read: made absolute here, where a relative path
// means something (the workers share this file system or mount the same
// path).
absl::StatusOr<std::string> WorkerPath(absl::string_view flag,
                                       absl::string_view value,
                                       absl::string_view expected) {
  if (value.empty()) {
    return Usage(absl::StrCat(flag, ": expected ", expected));
  }
  std::error_code ec;
  const std::filesystem::path absolute =
      std::filesystem::absolute(std::string(value), ec);
  if (ec) {
    return Usage(
        absl::StrCat(flag, ": cannot resolve '", value, "': ", ec.message()));
  }
  return absolute.lexically_normal().string();
}

// LoRA: a rank, and with it the targets; alpha defaults to PEFT's 8.
absl::Status CheckLoraFlags(const std::set<std::string>& seen,
                            ShardctlArgs* args) {
  const bool lora = seen.count("--lora-rank") > 0;
  for (const char* needs : {"--lora-alpha", "--lora-targets"}) {
    if (!lora && seen.count(needs) > 0) {
      return Usage(
          absl::StrCat(needs, " needs --lora-rank R (LoRA fine-tuning)"));
    }
  }
  if (lora && seen.count("--lora-targets") == 0) {
    return Usage(
        "--lora-rank needs --lora-targets (PEFT's module names, e.g. "
        "q_proj,k_proj,v_proj,o_proj,experts)");
  }
  if (lora && seen.count("--lora-alpha") == 0) {
    args->options.mutable_lora()->set_alpha(8);
  }
  if (seen.count("--lora-from") > 0 && !lora) {
    return Usage(
        "--lora-from needs --lora-rank, --lora-alpha and --lora-targets as "
        "the adapters were trained with");
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ParseInt64(absl::string_view flag,
                                   absl::string_view value, int64_t min) {
  int64_t parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed) || parsed < min) {
    return Usage(absl::StrCat(flag, ": expected an integer >= ", min, ", got '",
                              value, "'"));
  }
  return parsed;
}

// The largest --device-memory accepted; keeps the byte count far from
// int64 overflow.
constexpr int64_t kMaxDeviceMemoryBytes = int64_t{1} << 50;

// "80GiB", "80 GiB", "80GB" (decimal), "1024MiB", "1.5TiB", or a plain
// number of GiB. Unit names are case-insensitive.
absl::StatusOr<int64_t> ParseDeviceMemory(absl::string_view flag,
                                          absl::string_view value) {
  struct Unit {
    const char* name;
    double bytes;
  };
  static constexpr Unit kUnits[] = {
      {"", 1024.0 * 1024 * 1024},  // A plain number means GiB.
      {"B", 1},
      {"KiB", 1024.0},
      {"MiB", 1024.0 * 1024},
      {"GiB", 1024.0 * 1024 * 1024},
      {"TiB", 1024.0 * 1024 * 1024 * 1024},
      {"KB", 1e3},
      {"MB", 1e6},
      {"GB", 1e9},
      {"TB", 1e12},
  };
  const absl::Status syntax_error = Usage(absl::StrCat(
      flag, ": expected a size like 80GiB, 80GB or 80 (GiB), got '", value,
      "'"));
  const absl::string_view text = absl::StripAsciiWhitespace(value);
  // Digits with at most one '.'; SimpleAtod alone would also take "inf",
  // "1e3" and hex.
  size_t end = 0;
  bool dot = false;
  bool digit = false;
  for (; end < text.size(); ++end) {
    const char c = text[end];
    if (absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      digit = true;
    } else if (c == '.' && !dot) {
      dot = true;
    } else {
      break;
    }
  }
  if (!digit) return syntax_error;
  const absl::string_view unit_name =
      absl::StripLeadingAsciiWhitespace(text.substr(end));
  double multiplier = 0;
  for (const Unit& unit : kUnits) {
    if (absl::EqualsIgnoreCase(unit_name, unit.name)) multiplier = unit.bytes;
  }
  double number = 0;
  if (multiplier == 0 || !absl::SimpleAtod(text.substr(0, end), &number)) {
    return syntax_error;
  }
  const double bytes = number * multiplier;
  if (!(bytes >= 1) || bytes > static_cast<double>(kMaxDeviceMemoryBytes)) {
    return Usage(absl::StrCat(flag,
                              ": expected a size > 0 and at most 1024TiB, "
                              "got '",
                              value, "'"));
  }
  return static_cast<int64_t>(std::llround(bytes));
}

absl::StatusOr<ShardctlCommand> ParseCommand(absl::string_view name) {
  if (name == "strategies") return ShardctlCommand::kStrategies;
  if (name == "plan") return ShardctlCommand::kPlan;
  if (name == "status") return ShardctlCommand::kStatus;
  if (name == "train") return ShardctlCommand::kTrain;
  if (name == "checkpoint") return ShardctlCommand::kCheckpointList;
  if (name == "help") return ShardctlCommand::kHelp;
  return Usage(absl::StrCat("unknown command '", name,
                            "'; expected one of: strategies, plan, train, "
                            "status, checkpoint, help"));
}

absl::string_view CommandName(ShardctlCommand command) {
  switch (command) {
    case ShardctlCommand::kStrategies:
      return "strategies";
    case ShardctlCommand::kPlan:
      return "plan";
    case ShardctlCommand::kStatus:
      return "status";
    case ShardctlCommand::kTrain:
      return "train";
    case ShardctlCommand::kCheckpointList:
      return "checkpoint list";
    case ShardctlCommand::kCheckpointConsolidate:
      return "checkpoint consolidate";
    case ShardctlCommand::kCheckpointExport:
      return "checkpoint export";
    case ShardctlCommand::kCheckpointSave:
      return "checkpoint save";
    case ShardctlCommand::kCheckpointLoad:
      return "checkpoint load";
    case ShardctlCommand::kHelp:
      break;
  }
  return "help";
}

// Flags without a value.
const std::set<std::string>& BoolFlags() {
  static const auto* flags = new std::set<std::string>{"--json",
                                                       "--defer-grad-sync",
                                                       "--no-mixed-precision",
                                                       "--keep-compute-shard",
                                                       "--timeline",
                                                       "--fine-grained",
                                                       "--no-packing"};
  return *flags;
}

// `extra` and the flags that reach a coordinator (address, deadline, JSON
// output, TLS and token), for a command that may talk to one.
const std::set<std::string>* WithConnection(
    std::initializer_list<const char*> extra) {
  auto* flags = new std::set<std::string>{
      "--coordinator", "--timeout", "--json",      "--tls-ca",
      "--tls-cert",    "--tls-key", "--token-file"};
  flags->insert(extra.begin(), extra.end());
  return flags;
}

const std::set<std::string>& FlagsOf(ShardctlCommand command) {
  static const auto* strategies = WithConnection({});
  static const auto* status = WithConnection({});
  static const auto* plan = WithConnection({"--hf-config",
                                            "--model",
                                            "--dp",
                                            "--replicate",
                                            "--ep",
                                            "--ep-capacity-factor",
                                            "--strategy",
                                            "--microbatches",
                                            "--passes",
                                            "--no-grad-passes",
                                            "--defer-grad-sync",
                                            "--reshard-after-forward",
                                            "--fwd-prefetch",
                                            "--bwd-prefetch",
                                            "--no-mixed-precision",
                                            "--keep-compute-shard",
                                            "--bucket-elements",
                                            "--shard-placement",
                                            "--micro-batch-size",
                                            "--seq",
                                            "--activation-checkpointing",
                                            "--worker-device",
                                            "--timeline",
                                            "--timeline-svg",
                                            "--compare-strategy",
                                            "--device-memory",
                                            "--lora-rank",
                                            "--lora-alpha",
                                            "--lora-targets"});
  static const auto* train = WithConnection({"--model",
                                             "--model-id",
                                             "--steps",
                                             "--global-batch",
                                             "--seq",
                                             "--microbatches",
                                             "--data",
                                             "--lr",
                                             "--seed",
                                             "--dp",
                                             "--replicate",
                                             "--ep",
                                             "--ep-capacity-factor",
                                             "--strategy",
                                             "--defer-grad-sync",
                                             "--fine-grained",
                                             "--no-packing",
                                             "--lora-rank",
                                             "--lora-alpha",
                                             "--lora-targets",
                                             "--lora-from",
                                             "--passes",
                                             "--no-grad-passes",
                                             "--no-mixed-precision",
                                             "--keep-compute-shard",
                                             "--shard-placement",
                                             "--activation-checkpointing",
                                             "--grad-clip",
                                             "--weight-decay",
                                             "--beta1",
                                             "--data-order",
                                             "--beta2",
                                             "--eps",
                                             "--reshard-after-forward",
                                             "--fwd-prefetch",
                                             "--bwd-prefetch",
                                             "--log-every",
                                             "--watch-timeout",
                                             "--checkpoint-every",
                                             "--keep-checkpoints",
                                             "--keep-every",
                                             "--on-checkpoint-failure",
                                             "--resume-from",
                                             "--init-from",
                                             "--synthetic-order",
                                             "--encoder-loss-weight",
                                             "--diffusion-loss-weight",
                                             "--diffusion-noise-eps",
                                             "--self-conditioning-p",
                                             "--response-length",
                                             "--lr-schedule",
                                             "--warmup-steps",
                                             "--decay-steps",
                                             "--min-lr",
                                             "--eval-data",
                                             "--eval-every",
                                             "--eval-batches",
                                             "--optimizer",
                                             "--muon-lr",
                                             "--muon-momentum",
                                             "--muon-ns-steps",
                                             "--loss-svg",
                                             "--max-recoveries",
                                             "--reconnect-timeout"});
  static const auto* checkpoint_list = WithConnection({"--job"});
  static const auto* checkpoint_consolidate =
      new std::set<std::string>{"--checkpoint", "--out", "--hf"};
  static const auto* checkpoint_export = new std::set<std::string>{
      "--checkpoint", "--hf", "--max-shard-bytes", "--base"};
  static const auto* checkpoint_save = WithConnection({"--job"});
  static const auto* checkpoint_load =
      WithConnection({"--job", "--checkpoint"});
  static const auto* none = new std::set<std::string>{};
  switch (command) {
    case ShardctlCommand::kStrategies:
      return *strategies;
    case ShardctlCommand::kStatus:
      return *status;
    case ShardctlCommand::kPlan:
      return *plan;
    case ShardctlCommand::kTrain:
      return *train;
    case ShardctlCommand::kCheckpointList:
      return *checkpoint_list;
    case ShardctlCommand::kCheckpointConsolidate:
      return *checkpoint_consolidate;
    case ShardctlCommand::kCheckpointExport:
      return *checkpoint_export;
    case ShardctlCommand::kCheckpointSave:
      return *checkpoint_save;
    case ShardctlCommand::kCheckpointLoad:
      return *checkpoint_load;
    case ShardctlCommand::kHelp:
      break;
  }
  return *none;
}

// Applies one flag with its value (empty for bool flags).
absl::Status ApplyFlag(const std::string& flag, const std::string& value,
                       ShardctlArgs* args) {
  v1::PlanOptions& options = args->options;
  if (flag == "--coordinator") {
    if (value.empty()) return Usage("--coordinator: expected HOST:PORT");
    args->coordinator = value;
  } else if (flag == "--tls-ca" || flag == "--tls-cert" ||
             flag == "--tls-key" || flag == "--token-file") {
    if (value.empty())
      return Usage(absl::StrCat(flag, ": expected a file path"));
    std::string& field = flag == "--tls-ca"     ? args->tls_ca_file
                         : flag == "--tls-cert" ? args->tls_cert_file
                         : flag == "--tls-key"  ? args->tls_key_file
                                                : args->token_file;
    field = value;
  } else if (flag == "--timeout") {
    double seconds = 0;
    if (!absl::SimpleAtod(value, &seconds) || !(seconds > 0) ||
        seconds > 86400) {
      return Usage(absl::StrCat(
          "--timeout: expected seconds in (0, 86400], got '", value, "'"));
    }
    args->timeout = absl::Seconds(seconds);
  } else if (flag == "--json") {
    args->json = true;
  } else if (flag == "--hf-config") {
    if (value.empty()) return Usage("--hf-config: expected a file path");
    args->hf_config_path = value;
  } else if (flag == "--model") {
    if (value.empty()) return Usage("--model: expected a file path");
    args->model_path = value;
  } else if (flag == "--dp") {
    absl::StatusOr<int32_t> dp = ParseInt(flag, value, 1);
    if (!dp.ok()) return dp.status();
    options.mutable_mesh()->set_dp_shard(*dp);
  } else if (flag == "--replicate") {
    absl::StatusOr<int32_t> replicate = ParseInt(flag, value, 1);
    if (!replicate.ok()) return replicate.status();
    options.mutable_mesh()->set_dp_replicate(*replicate);
  } else if (flag == "--ep") {
    absl::StatusOr<int32_t> ep = ParseInt(flag, value, 1);
    if (!ep.ok()) return ep.status();
    options.mutable_mesh()->set_ep(*ep);
  } else if (flag == "--ep-capacity-factor") {
    double factor = 0;
    if (!absl::SimpleAtod(value, &factor) || !(factor >= 1.0) ||
        factor > 65536) {
      return Usage(absl::StrCat(
          "--ep-capacity-factor: expected a number >= 1 (a multiple of the "
          "balanced rows a rank's experts receive), got '",
          value, "'"));
    }
    options.set_ep_capacity_factor(factor);
  } else if (flag == "--strategy") {
    if (value.empty()) return Usage("--strategy: expected a strategy name");
    options.set_strategy(value);
  } else if (flag == "--microbatches") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    options.set_microbatches(*n);
  } else if (flag == "--passes") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    options.set_passes(*n);
  } else if (flag == "--no-grad-passes") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 0);
    if (!n.ok()) return n.status();
    options.set_no_grad_passes(*n);
  } else if (flag == "--defer-grad-sync") {
    options.set_defer_grad_sync(true);
  } else if (flag == "--micro-batch-size") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    options.set_micro_batch_size(*n);
  } else if (flag == "--worker-device") {
    if (value == "cpu") {
      options.set_worker_device(v1::WORKER_DEVICE_CPU);
    } else if (value == "cuda") {
      options.set_worker_device(v1::WORKER_DEVICE_CUDA);
    } else {
      return Usage(absl::StrCat("--worker-device: expected cpu or cuda, got '",
                                value, "'"));
    }
  } else if (flag == "--activation-checkpointing") {
    absl::StatusOr<CheckpointPolicy> policy = ParseCheckpointPolicy(value);
    if (!policy.ok()) {
      return Usage(absl::StrCat("--activation-checkpointing: ",
                                policy.status().message()));
    }
    options.set_activation_checkpointing(policy->Text());
  } else if (flag == "--reshard-after-forward") {
    if (value == "true") {
      options.mutable_reshard_after_forward()->set_reshard(true);
    } else if (value == "false") {
      options.mutable_reshard_after_forward()->set_reshard(false);
    } else {
      int32_t group = 0;
      if (!absl::SimpleAtoi(value, &group) || group < 1) {
        return Usage(absl::StrCat(
            "--reshard-after-forward: expected true, false or a group size "
            ">= 1, got '",
            value, "'"));
      }
      options.mutable_reshard_after_forward()->set_group_size(group);
    }
  } else if (flag == "--fwd-prefetch") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 0);
    if (!n.ok()) return n.status();
    options.set_forward_prefetch_depth(*n);
  } else if (flag == "--bwd-prefetch") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 0);
    if (!n.ok()) return n.status();
    options.set_backward_prefetch_depth(*n);
  } else if (flag == "--no-mixed-precision") {
    options.set_mixed_precision(false);
  } else if (flag == "--keep-compute-shard") {
    options.set_keep_compute_shard(true);
  } else if (flag == "--shard-placement") {
    if (value != "auto" && value != "dim0") {
      return Usage(absl::StrCat(
          "--shard-placement: expected auto (dim 0 unless it pads, else a "
          "flat element range) or dim0 (FSDP2's Shard(0)), got '",
          value, "'"));
    }
    options.set_shard_placement(value);
  } else if (flag == "--bucket-elements") {
    absl::StatusOr<int64_t> n = ParseInt64(flag, value, 1);
    if (!n.ok()) return n.status();
    options.set_bucket_elements(*n);
  } else if (flag == "--timeline") {
    options.set_include_timeline(true);
  } else if (flag == "--model-id") {
    if (value.empty()) return Usage("--model-id: expected a model id (m-...)");
    args->model_id = value;
  } else if (flag == "--checkpoint-every") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    args->train.set_checkpoint_every(*n);
  } else if (flag == "--keep-checkpoints") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    args->train.set_keep_checkpoints(*n);
  } else if (flag == "--keep-every") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    args->train.set_keep_every(*n);
  } else if (flag == "--on-checkpoint-failure") {
    if (value != "fail" && value != "skip") {
      return Usage(absl::StrCat("--on-checkpoint-failure: \"", value,
                                "\"; allowed: fail (the default), skip"));
    }
    args->train.set_on_checkpoint_failure(value);
  } else if (flag == "--resume-from") {
    if (value.empty()) {
      return Usage(
          "--resume-from: expected a checkpoint name (JOB/step-NNNNNNNN, see "
          "shardctl checkpoint list)");
    }
    args->train.set_resume_from(value);
  } else if (flag == "--synthetic-order") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    if (*n > 64) {
      return Usage(
          absl::StrCat("--synthetic-order: must be in [1, 64], got ", *n));
    }
    args->train.set_synthetic_order(*n);
  } else if (flag == "--lora-rank") {
    absl::StatusOr<int32_t> r = ParseInt(flag, value, 1);
    if (!r.ok()) return r.status();
    options.mutable_lora()->set_rank(*r);
  } else if (flag == "--lora-alpha") {
    double alpha = 0;
    if (!absl::SimpleAtod(value, &alpha) || !std::isfinite(alpha) ||
        !(alpha > 0)) {
      return Usage(absl::StrCat("--lora-alpha: expected a number > 0, got '",
                                value, "'"));
    }
    options.mutable_lora()->set_alpha(alpha);
  } else if (flag == "--lora-targets") {
    options.mutable_lora()->clear_targets();
    for (absl::string_view t : absl::StrSplit(value, ',')) {
      if (t.empty()) {
        return Usage(absl::StrCat(
            "--lora-targets: expected module names separated by commas "
            "(q_proj,v_proj,...,experts), got '",
            value, "'"));
      }
      options.mutable_lora()->add_targets(std::string(t));
    }
  } else if (flag == "--lora-from") {
    absl::StatusOr<std::string> dir =
        WorkerPath(flag, value,
                   "a PEFT adapter directory (adapter_model.safetensors, "
                   "adapter_config.json)");
    if (!dir.ok()) return dir.status();
    args->train.set_lora_from(*dir);
  } else if (flag == "--init-from") {
    absl::StatusOr<std::string> dir =
        WorkerPath(flag, value,
                   "a Hugging Face checkpoint directory (model.safetensors or "
                   "model.safetensors.index.json)");
    if (!dir.ok()) return dir.status();
    args->train.set_init_from(*dir);
  } else if (flag == "--checkpoint") {
    if (value.empty()) {
      return Usage("--checkpoint: expected a checkpoint directory");
    }
    args->checkpoint_path = value;
  } else if (flag == "--out") {
    if (value.empty()) return Usage("--out: expected a directory");
    args->out_path = value;
  } else if (flag == "--hf" &&
             args->command == ShardctlCommand::kCheckpointExport) {
    if (value.empty()) {
      return Usage("--hf: expected the Hugging Face directory to write");
    }
    args->out_path = value;
  } else if (flag == "--base") {
    if (value.empty()) {
      return Usage(
          "--base: expected the Hugging Face directory the job started from");
    }
    args->base_path = value;
  } else if (flag == "--max-shard-bytes") {
    absl::StatusOr<int64_t> n = ParseInt64(flag, value, 1);
    if (!n.ok()) return n.status();
    args->max_shard_bytes = *n;
  } else if (flag == "--hf") {
    if (value != "qwen3-moe" && value != "mixtral" && value != "gpt-oss" &&
        value != "diffusion-gemma" && value != "none") {
      return Usage(absl::StrCat(
          "--hf: expected the HF naming qwen3-moe, mixtral, gpt-oss, "
          "diffusion-gemma or none, got '",
          value, "'"));
    }
    args->hf_naming = value;
  } else if (flag == "--job") {
    if (value.empty()) return Usage("--job: expected a job id (j-...)");
    args->checkpoint_job = value;
  } else if (flag == "--steps") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    args->train.set_steps(*n);
  } else if (flag == "--global-batch") {
    absl::StatusOr<int64_t> n = ParseInt64(flag, value, 1);
    if (!n.ok()) return n.status();
    args->train.set_global_batch(*n);
  } else if (flag == "--seq") {
    absl::StatusOr<int64_t> n = ParseInt64(flag, value, 1);
    if (!n.ok()) return n.status();
    args->train.set_seq_len(*n);
  } else if (flag == "--data") {
    if (value.empty()) return Usage("--data: expected a file path");
    args->train.set_data_path(value);
  } else if (flag == "--eval-data") {
    if (value.empty()) return Usage("--eval-data: expected a file path");
    args->train.set_eval_data_path(value);
  } else if (flag == "--eval-every" || flag == "--eval-batches") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    if (flag == "--eval-every") {
      args->train.set_eval_every(*n);
    } else {
      args->train.set_eval_batches(*n);
    }
  } else if (flag == "--lr" || flag == "--grad-clip" ||
             flag == "--weight-decay") {
    double x = 0;
    const bool positive = flag == "--lr";
    if (!absl::SimpleAtod(value, &x) || !std::isfinite(x) || x < 0 ||
        (positive && x == 0)) {
      return Usage(absl::StrCat(flag, ": expected a number ",
                                positive ? "> 0" : ">= 0", ", got '", value,
                                "'"));
    }
    if (flag == "--lr") {
      args->train.set_lr(x);
    } else if (flag == "--grad-clip") {
      // On the wire 0 means the default and a negative value "off".
      args->train.set_grad_clip(x == 0 ? -1.0 : x);
    } else {
      args->train.set_weight_decay(x);
    }
  } else if (flag == "--seed") {
    uint64_t seed = 0;
    if (!absl::SimpleAtoi(value, &seed)) {
      return Usage(absl::StrCat(
          "--seed: expected an integer in [0, 2^64), got '", value, "'"));
    }
    args->train.set_seed(seed);
  } else if (flag == "--data-order") {
    if (value != "random" && value != "strided") {
      return Usage(absl::StrCat(
          "--data-order: expected random or strided, got '", value, "'"));
    }
    args->train.set_data_order(value);
  } else if (flag == "--beta1" || flag == "--beta2" || flag == "--eps") {
    // torch.optim.AdamW's meanings. On the wire 0 means the default, so
    // the betas must be in (0, 1) and eps > 0.
    double x = 0;
    const bool beta = flag != "--eps";
    if (!absl::SimpleAtod(value, &x) || !std::isfinite(x) || !(x > 0) ||
        (beta && !(x < 1))) {
      return Usage(absl::StrCat(flag, ": expected a number ",
                                beta ? "in (0, 1)" : "> 0", ", got '", value,
                                "'"));
    }
    if (flag == "--beta1") {
      args->train.set_beta1(x);
    } else if (flag == "--beta2") {
      args->train.set_beta2(x);
    } else {
      args->train.set_eps(x);
    }
  } else if (flag == "--lr-schedule") {
    if (value != "constant" && value != "cosine" && value != "linear") {
      return Usage(absl::StrCat(
          "--lr-schedule: expected constant, cosine or linear, got '", value,
          "'"));
    }
    args->train.set_lr_schedule(value);
  } else if (flag == "--warmup-steps") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 0);
    if (!n.ok()) return n.status();
    args->train.set_warmup_steps(*n);
  } else if (flag == "--decay-steps") {
    absl::StatusOr<int64_t> n = ParseInt64(flag, value, 1);
    if (!n.ok()) return n.status();
    args->train.set_decay_steps(*n);
  } else if (flag == "--min-lr") {
    double x = 0;
    if (!absl::SimpleAtod(value, &x) || !std::isfinite(x) || x < 0) {
      return Usage(
          absl::StrCat("--min-lr: expected a number >= 0, got '", value, "'"));
    }
    args->train.set_min_lr(x);
  } else if (flag == "--optimizer") {
    if (value != "adamw" && value != "muon") {
      return Usage(absl::StrCat("--optimizer: expected adamw or muon, got '",
                                value, "'"));
    }
    args->train.set_optimizer(value);
  } else if (flag == "--muon-lr" || flag == "--muon-momentum") {
    const bool lr = flag == "--muon-lr";
    double x = 0;
    if (!absl::SimpleAtod(value, &x) || !std::isfinite(x) ||
        (lr ? x <= 0 : (x <= 0 || x >= 1))) {
      return Usage(absl::StrCat(flag, ": expected a number ",
                                lr ? "> 0" : "in (0, 1)", ", got '", value,
                                "'"));
    }
    if (lr) {
      args->train.set_muon_lr(x);
    } else {
      args->train.set_muon_momentum(x);
    }
  } else if (flag == "--muon-ns-steps") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    if (*n > 100) {
      return Usage(
          absl::StrCat("--muon-ns-steps: expected an integer in [1, "
                       "100], got '",
                       value, "'"));
    }
    args->train.set_muon_ns_steps(*n);
  } else if (flag == "--response-length") {
    absl::StatusOr<int64_t> n = ParseInt64(flag, value, 1);
    if (!n.ok()) return n.status();
    args->train.mutable_diffusion()->set_response_length(*n);
  } else if (flag == "--encoder-loss-weight" ||
             flag == "--diffusion-loss-weight" ||
             flag == "--diffusion-noise-eps" ||
             flag == "--self-conditioning-p") {
    // DiffusionGemma's block-diffusion knobs (TrainConfig.diffusion).
    double x = 0;
    const bool weight =
        flag == "--encoder-loss-weight" || flag == "--diffusion-loss-weight";
    const bool ok =
        absl::SimpleAtod(value, &x) && std::isfinite(x) && x >= 0 &&
        (weight || (flag == "--diffusion-noise-eps" ? x < 1 : x <= 1));
    if (!ok) {
      return Usage(absl::StrCat(flag, ": expected a number ",
                                weight                            ? ">= 0"
                                : flag == "--diffusion-noise-eps" ? "in [0, 1)"
                                                                  : "in [0, 1]",
                                ", got '", value, "'"));
    }
    v1::DiffusionTraining* d = args->train.mutable_diffusion();
    if (flag == "--encoder-loss-weight") {
      d->set_encoder_loss_weight(x);
    } else if (flag == "--diffusion-loss-weight") {
      d->set_diffusion_loss_weight(x);
    } else if (flag == "--diffusion-noise-eps") {
      d->set_noise_eps(x);
    } else {
      d->set_self_conditioning_p(x);
    }
  } else if (flag == "--fine-grained") {
    args->train.set_fine_grained(true);
  } else if (flag == "--no-packing") {
    args->train.set_no_packing(true);
  } else if (flag == "--log-every") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, 1);
    if (!n.ok()) return n.status();
    args->log_every = *n;
  } else if (flag == "--max-recoveries") {
    absl::StatusOr<int32_t> n = ParseInt(flag, value, -1);
    if (!n.ok()) return n.status();
    // 0 in the config means the coordinator's default; ask for "never" as -1.
    args->train.set_max_recoveries(*n == 0 ? -1 : *n);
  } else if (flag == "--reconnect-timeout") {
    double seconds = 0;
    if (!absl::SimpleAtod(value, &seconds) || !(seconds >= 0) ||
        seconds > 7 * 86400) {
      return Usage(absl::StrCat(
          "--reconnect-timeout: expected seconds in [0, 604800], got '", value,
          "'"));
    }
    args->reconnect_timeout = absl::Seconds(seconds);
  } else if (flag == "--watch-timeout") {
    double seconds = 0;
    if (!absl::SimpleAtod(value, &seconds) || !(seconds > 0) ||
        seconds > 7 * 86400) {
      return Usage(absl::StrCat(
          "--watch-timeout: expected seconds in (0, 604800], got '", value,
          "'"));
    }
    args->watch_timeout = absl::Seconds(seconds);
  } else if (flag == "--timeline-svg" || flag == "--loss-svg") {
    if (value.empty())
      return Usage(absl::StrCat(flag, ": expected a file path"));
    (flag == "--timeline-svg" ? args->timeline_svg_path : args->loss_svg_path) =
        value;
  } else if (flag == "--compare-strategy") {
    if (value.empty()) {
      return Usage("--compare-strategy: expected a strategy name");
    }
    args->compare_strategy = value;
  } else if (flag == "--device-memory") {
    absl::StatusOr<int64_t> bytes = ParseDeviceMemory(flag, value);
    if (!bytes.ok()) return bytes.status();
    args->device_memory_bytes = *bytes;
  } else {
    return Usage(absl::StrCat("unknown flag '", flag, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

const std::set<std::string>& ShardctlFlags(ShardctlCommand command) {
  return FlagsOf(command);
}

absl::StatusOr<ShardctlArgs> ParseShardctlArgs(
    const std::vector<std::string>& argv) {
  ShardctlArgs args;
  args.train.set_steps(100);
  args.train.set_global_batch(32);
  args.train.set_seq_len(64);
  args.train.set_microbatches(1);
  args.train.set_lr(1e-3);
  args.train.set_grad_clip(1.0);
  if (argv.empty()) {
    return Usage(
        "a command is required: strategies, plan, train, status or help");
  }
  const std::string& first = argv[0];
  if (first == "--help" || first == "-h" || first == "help") {
    args.command = ShardctlCommand::kHelp;
    if (argv.size() >= 2) {
      absl::StatusOr<ShardctlCommand> topic = ParseCommand(argv[1]);
      if (!topic.ok()) return topic.status();
      args.help_for = *topic;
    }
    if (argv.size() > 2) {
      return Usage(absl::StrCat("help: unexpected argument '", argv[2], "'"));
    }
    return args;
  }
  if (absl::StartsWith(first, "-")) {
    return Usage(
        absl::StrCat("expected a command (strategies, plan, train, status) "
                     "before '",
                     first, "'"));
  }
  absl::StatusOr<ShardctlCommand> command = ParseCommand(first);
  if (!command.ok()) return command.status();
  args.command = *command;
  size_t first_flag = 1;
  if (args.command == ShardctlCommand::kCheckpointList) {
    // "checkpoint" takes a subcommand.
    if (argv.size() >= 2 && argv[1] == "consolidate") {
      args.command = ShardctlCommand::kCheckpointConsolidate;
    } else if (argv.size() >= 2 && argv[1] == "export") {
      args.command = ShardctlCommand::kCheckpointExport;
    } else if (argv.size() >= 2 && argv[1] == "save") {
      args.command = ShardctlCommand::kCheckpointSave;
    } else if (argv.size() >= 2 && argv[1] == "load") {
      args.command = ShardctlCommand::kCheckpointLoad;
    } else if (argv.size() < 2 || argv[1] != "list") {
      if (argv.size() >= 2 && (argv[1] == "--help" || argv[1] == "-h")) {
        ShardctlArgs help;
        help.command = ShardctlCommand::kHelp;
        help.help_for = ShardctlCommand::kCheckpointList;
        return help;
      }
      return Usage(
          absl::StrCat("checkpoint: expected the subcommand 'list', "
                       "'save', 'load', 'consolidate' or 'export', got '",
                       argv.size() >= 2 ? argv[1] : std::string(), "'"));
    }
    first_flag = 2;
  }

  const std::set<std::string>& allowed = FlagsOf(args.command);
  std::set<std::string> seen;
  for (size_t i = first_flag; i < argv.size(); ++i) {
    const std::string& arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      ShardctlArgs help;
      help.command = ShardctlCommand::kHelp;
      help.help_for = args.command;
      return help;
    }
    if (!absl::StartsWith(arg, "--")) {
      return Usage(absl::StrCat(CommandName(args.command),
                                ": unexpected argument '", arg, "'"));
    }
    std::string flag = arg;
    std::string value;
    bool has_inline_value = false;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_inline_value = true;
    }
    if (allowed.count(flag) == 0) {
      return Usage(absl::StrCat(CommandName(args.command), ": unknown flag '",
                                flag, "' (see shardctl ",
                                CommandName(args.command), " --help)"));
    }
    if (!seen.insert(flag).second) {
      return Usage(absl::StrCat(flag, ": given more than once"));
    }
    // plan --timeline FILE.svg (or --timeline=FILE.svg) is the short form of
    // --timeline-svg FILE; a bare --timeline keeps meaning the JSON timeline.
    // plan takes no positional arguments, so a following word that is not a
    // flag can only be the file.
    if (flag == "--timeline" && args.command == ShardctlCommand::kPlan &&
        (has_inline_value ||
         (i + 1 < argv.size() && !absl::StartsWith(argv[i + 1], "-")))) {
      if (!has_inline_value) value = argv[++i];
      if (!absl::EndsWithIgnoreCase(value, ".svg")) {
        return Usage(absl::StrCat(
            "--timeline: takes no value (the JSON timeline) or an SVG file "
            "name ending in .svg (the picture), got '",
            value, "'"));
      }
      if (!seen.insert("--timeline-svg").second) {
        return Usage("--timeline FILE.svg and --timeline-svg: give one");
      }
      flag = "--timeline-svg";
      has_inline_value = true;
    }
    if (BoolFlags().count(flag) > 0) {
      if (has_inline_value) {
        return Usage(absl::StrCat(flag, ": takes no value"));
      }
    } else if (!has_inline_value) {
      if (i + 1 >= argv.size()) {
        return Usage(absl::StrCat(flag, ": missing value"));
      }
      value = argv[++i];
    }
    absl::Status applied = ApplyFlag(flag, value, &args);
    if (!applied.ok()) return applied;
  }

  if (absl::Status lora = CheckLoraFlags(seen, &args); !lora.ok()) {
    return lora;
  }
  switch (args.command) {
    case ShardctlCommand::kPlan: {
      const bool has_hf = seen.count("--hf-config") > 0;
      const bool has_model = seen.count("--model") > 0;
      if (has_hf == has_model) {
        return Usage(
            "plan: exactly one of --hf-config FILE or --model FILE is "
            "required");
      }
      if (seen.count("--dp") == 0) {
        return Usage("plan: --dp N (ranks to shard over) is required");
      }
      if (seen.count("--compare-strategy") > 0 &&
          seen.count("--timeline-svg") == 0) {
        return Usage(
            "plan: --compare-strategy draws into the --timeline-svg FILE "
            "picture; give both");
      }
      if (seen.count("--replicate") == 0) {
        args.options.mutable_mesh()->set_dp_replicate(1);
      }
      // Activations: per rank, micro-batch-size sequences of seq tokens.
      if ((seen.count("--micro-batch-size") > 0) != (seen.count("--seq") > 0)) {
        return Usage(
            "plan: --micro-batch-size N and --seq N count the activations "
            "together; give both");
      }
      if (seen.count("--activation-checkpointing") > 0 &&
          seen.count("--seq") == 0) {
        return Usage(
            "plan: --activation-checkpointing needs --micro-batch-size N and "
            "--seq N (the activations it trades for compute)");
      }
      if (seen.count("--seq") > 0) {
        args.options.set_seq_len(args.train.seq_len());
      }
      break;
    }
    case ShardctlCommand::kStatus:
      if (args.coordinator.empty()) {
        return Usage("status: --coordinator HOST:PORT is required");
      }
      break;
    case ShardctlCommand::kCheckpointList:
      if (args.coordinator.empty()) {
        return Usage("checkpoint list: --coordinator HOST:PORT is required");
      }
      break;
    case ShardctlCommand::kCheckpointSave:
      if (args.coordinator.empty() || args.checkpoint_job.empty()) {
        return Usage(
            "checkpoint save: --coordinator HOST:PORT and --job ID are "
            "required");
      }
      break;
    case ShardctlCommand::kCheckpointLoad:
      if (args.coordinator.empty() || args.checkpoint_job.empty() ||
          args.checkpoint_path.empty()) {
        return Usage(
            "checkpoint load: --coordinator HOST:PORT, --job ID and "
            "--checkpoint NAME are required");
      }
      break;
    case ShardctlCommand::kCheckpointExport:
      if (args.checkpoint_path.empty() || args.out_path.empty()) {
        return Usage(
            "checkpoint export: --checkpoint DIR and --hf OUT are required");
      }
      break;
    case ShardctlCommand::kCheckpointConsolidate:
      if (args.checkpoint_path.empty() || args.out_path.empty()) {
        return Usage(
            "checkpoint consolidate: --checkpoint DIR and --out DIR are "
            "required");
      }
      break;
    case ShardctlCommand::kTrain: {
      if (args.coordinator.empty()) {
        return Usage("train: --coordinator HOST:PORT is required");
      }
      const bool has_model = seen.count("--model") > 0;
      const bool has_id = seen.count("--model-id") > 0;
      if (has_model == has_id) {
        return Usage(
            "train: exactly one of --model FILE or --model-id ID is "
            "required");
      }
      if (seen.count("--eval-data") == 0 &&
          (seen.count("--eval-every") > 0 ||
           seen.count("--eval-batches") > 0)) {
        return Usage(
            "train: --eval-every and --eval-batches need --eval-data FILE (the "
            "held-out token file)");
      }
      if (has_id) {
        // The stored model's plan options are fixed.
        for (const char* fixed :
             {"--dp", "--replicate", "--ep", "--ep-capacity-factor",
              "--lora-rank", "--lora-alpha", "--lora-targets", "--strategy",
              "--passes", "--no-grad-passes", "--no-mixed-precision",
              "--keep-compute-shard", "--reshard-after-forward",
              "--fwd-prefetch", "--bwd-prefetch", "--shard-placement",
              "--activation-checkpointing"}) {
          if (seen.count(fixed) > 0) {
            return Usage(absl::StrCat(
                "train: ", fixed,
                " cannot be combined with --model-id (the stored model's "
                "plan options apply; submit with --model to change them)"));
          }
        }
      }
      // The step shape belongs to the job, not to the model.
      if (args.options.microbatches() > 0) {
        args.train.set_microbatches(args.options.microbatches());
      }
      args.train.set_defer_grad_sync(args.options.defer_grad_sync());
      args.options.clear_microbatches();
      args.options.clear_defer_grad_sync();
      if (seen.count("--replicate") == 0) {
        args.options.mutable_mesh()->set_dp_replicate(1);
      }
      break;
    }
    default:
      break;
  }
  return args;
}

}  // namespace shardd
