#include "client/shardctl_usage.h"

#include <string>

namespace shardd {

// The connection flags' help, the same for every command that may talk to a
// coordinator.
constexpr char kSecurityHelp[] = R"(Security (with --coordinator):
  --tls-ca FILE                CA that verifies the coordinator (TLS)
  --tls-cert FILE, --tls-key FILE   client certificate (mutual TLS)
  --token-file FILE            client bearer token, first line (default:
                               $SHARDD_TOKEN_FILE)
)";

std::string ShardctlUsage(ShardctlCommand command) {
  switch (command) {
    case ShardctlCommand::kStrategies:
      return R"(Usage: shardctl strategies [--coordinator HOST:PORT] [--json]

Lists the sharding strategies, the architectures each serves, and the
architectures shardd can read from a Hugging Face config.json. Without
--coordinator the built-in registry is listed.

  --coordinator HOST:PORT  ask a running shardd-coordinator
  --timeout SECONDS        connect and call deadline (default 30)
  --json                   print the response as JSON
)" + std::string(kSecurityHelp);
    case ShardctlCommand::kPlan:
      return R"(Usage: shardctl plan (--hf-config FILE | --model FILE) --dp N [options]

Cuts a model into FSDP units over N ranks and prints the layout, the
per-rank memory (with the peak of unsharded memory and whether it fits
the device) and the bytes moved per training step. Without --coordinator
it plans in-process.

Model (exactly one):
  --hf-config FILE             a Hugging Face config.json
  --model FILE                 a native shardd spec or an HF config (detected)
Mesh:
  --dp N                       ranks each parameter is sharded over (required)
  --replicate R                HSDP replicas (default 1)
  --ep N                       expert parallelism: the --dp ranks form N
                               groups, each holding 1/N of every layer's
                               routed experts (sharded over its --dp/N
                               ranks) and receiving the tokens routed to
                               them (N divides --dp and the expert count;
                               default 1; docs/expert_parallel.md)
  --ep-capacity-factor C       with --ep: the routing skew the activations
                               assume, a rank's experts receiving at most
                               C x the balanced rows (1..N); given, training
                               fails a step whose routing exceeds it
                               (default: 2 assumed, not enforced)
Plan:
  --strategy NAME              a registry strategy instead of the
                               architecture's (see shardctl strategies)
  --reshard-after-forward V    true, false, or a smaller group size N
  --fwd-prefetch N             forward prefetch depth (default 1)
  --bwd-prefetch N             backward prefetch depth (default 2)
  --no-mixed-precision         gather and reduce in the parameter dtype
  --keep-compute-shard         keep a bf16 copy of every shard beside the
                               fp32 master (+2 bytes per sharded parameter)
                               so unshards skip the fp32->bf16 conversion
  --bucket-elements N          megatron_fsdp bucket size (default 40M)
  --lora-rank R, --lora-alpha A, --lora-targets M,...
                               plan LoRA fine-tuning: rank-R adapters on
                               those modules (PEFT's names, or experts),
                               every other weight frozen (docs/lora.md)
  --shard-placement P          auto (default): each parameter on dim 0,
                               unless that pads a rank past 1% of its even
                               share plus one row (stacked experts that do
                               not divide the ranks): then a flat range of
                               its elements; dim0: FSDP2's Shard(0) always
Activations:
  --micro-batch-size N, --seq N   count each rank's activations for N
                               sequences of --seq tokens per micro-batch
                               (both, or neither)
  --activation-checkpointing P none (default), all, experts or every:K:
                               the layers (all, or every K-th from 0) or
                               only the grouped experts that recompute
                               their forward in backward
  --worker-device D            cpu (default) or cuda: whose activations to
                               count; a GPU worker keeps them in bf16
                               under mixed precision, with its kernels'
                               saved state (a job's plan takes the
                               device from the registered workers)
Device:
  --device-memory SIZE         memory per GPU to check the peak against
                               (default 80GiB, an H100): 80GiB, 141GiB,
                               80GB (decimal), 1024MiB, or a plain number
                               of GiB. The check covers parameters,
                               gradients, optimizer state and, with
                               --micro-batch-size and --seq, activations;
                               compute workspace is not modelled, and the
                               headroom is what is left for it
Step:
  --microbatches M             micro-batches per step (default 1)
  --passes P                   forward passes per micro-batch (default 1;
                               3 for DiffusionGemma)
  --no-grad-passes K           leading passes without gradients
  --defer-grad-sync            keep grads unsharded until the last
                               micro-batch
Output:
  --json                       one JSON object instead of the table
  --timeline                   include the live-memory timeline (JSON)
  --timeline-svg FILE          draw the live-memory timeline of one step
                               (stacked per unit, peak marked) as SVG;
                               --timeline FILE.svg says the same
  --compare-strategy NAME      with --timeline-svg: plan NAME too and
                               overlay its total and peak
  --coordinator HOST:PORT      plan on a running shardd-coordinator
  --timeout SECONDS            connect and call deadline (default 30)
)" + std::string(kSecurityHelp);
    case ShardctlCommand::kStatus:
      return R"(Usage: shardctl status --coordinator HOST:PORT [--json]

Shows a coordinator's incarnation, uptime, stored models, workers and
training jobs.

  --coordinator HOST:PORT  the coordinator (required)
  --timeout SECONDS        connect and call deadline (default 30)
  --json                   print the response as JSON
)" + std::string(kSecurityHelp);
    case ShardctlCommand::kTrain:
      return R"(Usage: shardctl train --coordinator HOST:PORT (--model FILE | --model-id ID) [options]

Trains a model on the coordinator's workers: submits the model planned
over the live workers, queues the job, and follows it to the end with a
progress line (step, loss, tokens/s, ETA; plain lines when the output is
not a terminal), then prints a summary: the final loss (mean of the last
10% of steps) against the data's entropy rate (the best reachable loss of
the synthetic Markov data), tokens/s, the measured against the planned
peak of unsharded bytes per rank, and collectives per step. Exits 1 when
the job fails, naming the rank and its error.

Model (exactly one):
  --model PATH                 a native shardd spec, a Hugging Face
                               config.json, or a Hugging Face model
                               directory (its config.json)
  --model-id ID                a model the coordinator already has
Mesh and plan (with --model):
  --dp N                       ranks each parameter is sharded over
                               (default: the live workers / --replicate)
  --replicate R                HSDP replicas (default 1)
  --ep N                       expert parallelism, as for plan (GPU workers:
                               not for DiffusionGemma yet)
  --ep-capacity-factor C       with --ep: fail a step whose routing sends a
                               rank's experts more than C x the balanced
                               rows (default: no bound)
  --strategy NAME              a registry strategy (see shardctl strategies)
  --passes P                   forward passes per micro-batch (default 1)
  --no-grad-passes K           leading passes without gradients
  --no-mixed-precision         fp32 all the way (default: bf16 gather and
                               compute, fp32 master and reduce)
  --keep-compute-shard         keep a bf16 copy of every shard, refreshed
                               by the optimizer (unshards skip the cast)
  --shard-placement P          auto (default) or dim0, as for plan
  --activation-checkpointing P none, all, experts or every:K, as for plan
  --reshard-after-forward V    true, false, or a smaller group size N
  --fwd-prefetch N, --bwd-prefetch N   prefetch depths
Job:
  --steps N                    optimizer steps (default 100)
  --global-batch B             sequences per step (default 32); divisible
                               by world size x micro-batches
  --seq S                      tokens per sequence (default 64)
  --microbatches M             gradient accumulation steps (default 1)
  --defer-grad-sync            reduce-scatter only after the last
                               micro-batch
  --data PATH                  token file on the workers (.bin of uint16 /
                               uint32 ids, or text read as bytes); default:
                               synthetic Markov data from --seed
  --eval-data PATH             held-out token file: after every --eval-every
                               steps and after the last, the loss on its
                               first --eval-batches global batches (read in
                               order; forward only, nothing updated)
  --eval-every N               steps between evaluations (default: only
                               after the last step)
  --eval-batches K             global batches per evaluation (default 4)
  --no-packing                 an SFT dataset as --data: one example per row,
                               padded (default: several packed per row,
                               attention kept within each)
  --data-order O               random (default: each window of --data at a
                               drawn offset) or strided (the file in order,
                               epoch after epoch)
  --synthetic-order K          without --data: 1, a first-order Markov
                               chain (default); K >= 2, tokens that also
                               depend on the token K back, so a model
                               without attention stays above a known floor
                               (shown in the summary)
  --encoder-loss-weight W      DiffusionGemma: the weight of the encoder's
                               next-token loss (default 1)
  --diffusion-loss-weight W    DiffusionGemma: the weight of the canvas
                               (diffusion) loss (default 1)
  --diffusion-noise-eps E      DiffusionGemma: the least noise level, in
                               [0, 1) (default 0.001)
  --self-conditioning-p P      DiffusionGemma: the chance of a
                               self-conditioning decode (default 0.5)
  --response-length R          DiffusionGemma: the canvas is the last R
                               tokens of each sequence, in blocks of the
                               model's canvas_length (default: one block)
  --seed N                     data and initialization seed (default 0)
  --lr X                       AdamW learning rate (default 0.001); the
                               peak of a schedule
  --lr-schedule S              constant (default), cosine or linear: a
                               linear warmup, then a decay to --min-lr
  --warmup-steps N             steps of the warmup from lr / N to lr
                               (default 0)
  --decay-steps N              the step where the decay reaches --min-lr
                               (default: the job's last step); held after
  --min-lr X                   the decay's floor (default 0)
  --optimizer NAME             adamw (default) or muon: Muon (Newton-Schulz
                               orthogonalised momentum) for the hidden 2-D
                               weight matrices and each expert's, AdamW for
                               the rest; not with strategy megatron_fsdp
  --muon-lr X                  Muon's peak lr, > 0 (default 0.02); the lr
                               schedule scales it like --lr
  --muon-momentum X            Muon's Nesterov momentum, in (0, 1) (default
                               0.95)
  --muon-ns-steps N            Newton-Schulz iterations, in [1, 100]
                               (default 5)
  --weight-decay X             decoupled weight decay (default 0; Muon's too)
  --beta1 X, --beta2 X         AdamW's moment decays, in (0, 1) (default
                               0.9 and 0.95)
  --eps X                      AdamW's denominator term, > 0 (default 1e-8)
  --grad-clip X                global gradient-norm clip (default 1.0;
                               0: off)
  --fine-grained               one RPC per command instead of per step
Checkpoints (the coordinator's --checkpoint-dir, shared with the workers):
  --checkpoint-every N         save after every N-th step to
                               JOB/step-NNNNNNNN (atomic; checked for free
                               space first; a failed save fails the job
                               unless --on-checkpoint-failure skip)
  --keep-checkpoints K         keep the K newest of the job's checkpoints,
                               deleting older ones once a newer commits
                               (saves on demand and --resume-from are
                               never deleted)
  --keep-every M               with --keep-checkpoints: also keep every
                               M-th step's
  --on-checkpoint-failure P    fail (default) or skip: a save that cannot
                               finish (no room, a write error) is reported
                               and training goes on
  --resume-from NAME           start from a committed checkpoint (e.g.
                               j-1/step-00000020, see shardctl checkpoint
                               list) in any world size and strategy: runs
                               --steps more steps from its step on
  --lora-rank R                LoRA fine-tuning (docs/lora.md): rank-R
                               adapters on --lora-targets, every other
                               weight frozen (no gradient, no optimizer
                               state); `shardctl checkpoint export` writes
                               them in PEFT's format
  --lora-alpha A               the adapters' scale is A / R (default 8)
  --lora-targets M,...         PEFT's module names (q_proj, k_proj, v_proj,
                               o_proj, gate_proj, up_proj, down_proj, ...)
                               and experts (the stacked routed experts)
  --lora-from DIR              the adapters from PEFT's files in DIR
                               (adapter_model.safetensors) instead of
                               fresh ones; with --init-from BASE a job
                               resumes from base + adapters
  --init-from DIR              start from the Hugging Face safetensors in
                               DIR (model.safetensors, or the shards of
                               model.safetensors.index.json; F32, BF16 or
                               F16), read by every worker at the same path:
                               each rank reads only its own shards' bytes
Output:
  --json                       no progress bar: one JSON object per line,
                               {"event": "step", "step", "loss",
                               "grad_norm", "lr", "tokens", "step_seconds",
                               ...}
                               per step ("interruption" / "recovery" for
                               faults), and last {"event": "summary", ...}
  --log-every N                progress line every N steps when not on a
                               terminal (default: about 20 lines)
  --loss-svg FILE              draw the loss curve (with the data's entropy
                               rate) as SVG at the end
  --watch-timeout SECONDS      give up when no event arrives for this long
                               (default 600)
  --max-recoveries N           faults the job recovers from by itself (it
                               waits for its workers, then resumes from
                               their state, an HSDP replica, or its last
                               checkpoint); 0: never (default: the
                               coordinator's --max-recoveries)
  --reconnect-timeout SECONDS  keep reconnecting this long to a coordinator
                               that went away (it may be restarting; its
                               jobs go on) (default 120)
  --timeout SECONDS            connect and call deadline (default 30)
)" + std::string(kSecurityHelp);
    case ShardctlCommand::kCheckpointList:
      return R"(Usage: shardctl checkpoint list --coordinator HOST:PORT [--job ID] [--json]

Lists the committed checkpoints in the coordinator's checkpoint directory:
name (pass it to train --resume-from), step, and the world size and
strategy that saved it.

  --coordinator HOST:PORT  the coordinator (required)
  --job ID                 only this job's checkpoints
  --timeout SECONDS        connect and call deadline (default 30)
  --json                   print the response as JSON
)" + std::string(kSecurityHelp);
    case ShardctlCommand::kCheckpointSave:
      return R"(Usage: shardctl checkpoint save --coordinator HOST:PORT --job ID [--json]

Asks a running job to commit a checkpoint after the step in progress and
waits for it: prints its name (for train --resume-from or checkpoint load)
and step.

  --coordinator HOST:PORT  the coordinator (required)
  --job ID                 the running job (required)
  --timeout SECONDS        connect and call deadline (default 30)
  --json                   print the response as JSON
)" + std::string(kSecurityHelp);
    case ShardctlCommand::kCheckpointLoad:
      return R"(Usage: shardctl checkpoint load --coordinator HOST:PORT --job ID --checkpoint NAME [--json]

Rolls a running job back to committed checkpoint NAME (see checkpoint list;
any job's, saved at any world size or with any strategy) after the step in
progress, e.g. to before a loss spike; the job trains on from its step up
to its last step.

  --coordinator HOST:PORT  the coordinator (required)
  --job ID                 the running job (required)
  --checkpoint NAME        e.g. j-1/step-00000020 (required)
  --timeout SECONDS        connect and call deadline (default 30)
  --json                   print the response as JSON
)" + std::string(kSecurityHelp);
    case ShardctlCommand::kCheckpointConsolidate:
      return R"(Usage: shardctl checkpoint consolidate --checkpoint DIR --out DIR [--hf NAMING]

Reads a committed checkpoint (saved by any number of ranks, e.g.
CHECKPOINT_DIR/j-1/step-00000020), verifies every file, and writes it
again as if saved by one rank: OUT/step-NNNNNNNN, one file, parameters and
AdamW state whole, same step. With --hf it instead exports the parameters
as a Hugging Face safetensors checkpoint into OUT. Local: reads and writes
files on this machine, holding the whole model in memory; no coordinator.

  --checkpoint DIR             the checkpoint directory (required)
  --out DIR                    where the result goes (required)
  --hf NAMING                  export to HF with the expert naming
                               qwen3-moe (also DeepSeek-V3), mixtral,
                               gpt-oss, diffusion-gemma, or none (no MoE
                               layers)
)";
    case ShardctlCommand::kCheckpointExport:
      return R"(Usage: shardctl checkpoint export --checkpoint DIR --hf OUT [--max-shard-bytes N] [--base DIR]

Writes the parameters of a committed checkpoint (e.g.
CHECKPOINT_DIR/j-1/step-00000020, every file verified first) as a Hugging
Face model directory OUT: safetensors under the architecture's Hugging Face
names and layouts (per-expert Linear weights for Mixtral, Qwen3-MoE and
DeepSeek-V3; GPT-OSS's fused interleaved experts) holding the fp32 master
values, and the config.json the model was trained from.
`shardctl train --model OUT --init-from OUT` starts from exactly these
values. Needs a checkpoint saved by this build from a Hugging Face config;
local: no coordinator. A LoRA job's checkpoint is written as PEFT's
adapter_model.safetensors and adapter_config.json (docs/lora.md).

  --checkpoint DIR             the checkpoint directory (required)
  --hf OUT                     the directory to write (required)
  --max-shard-bytes N          split into model-0000K-of-0000N.safetensors
                               files of at most N bytes of tensor data with
                               model.safetensors.index.json (default: one
                               model.safetensors)
  --base DIR                   LoRA on DiffusionGemma's experts: the Hugging
                               Face base the job started from, whose
                               per_expert_scale the exported adapters of
                               the experts' down_proj are divided by
)";
    case ShardctlCommand::kHelp:
      break;
  }
  return R"(shardctl: the shardd command-line client

Usage: shardctl COMMAND [flags]

Commands:
  strategies   list sharding strategies and supported architectures
  plan         plan a model over N ranks: units, memory, communication
  train        train a model on a coordinator's workers
  status       show a coordinator's models, workers and jobs
  checkpoint list   list the committed checkpoints of the jobs
  checkpoint consolidate   rewrite a checkpoint as one rank's, or export HF
  checkpoint export        a checkpoint as a Hugging Face model directory
  help [CMD]   this text, or a command's flags (also: CMD --help)

Exit codes: 0 success, 1 planning, RPC or training error, 2 usage error.
)";
}

}  // namespace shardd
