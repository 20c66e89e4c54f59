#!/usr/bin/env bash
# One shardd GPU worker (cuda:0, NCCL at world size 1) against PyTorch FSDP2
# (fully_shard on every layer and the root, world size 1,
# bench/torch_qwen3_step.py --fsdp2) training the same Qwen3-MoE config on
# the same batch shape, in one run on one GPU; prints both tokens/s and the
# ratio. Both use bf16 compute with fp32 master weights, fp32 gradient
# reduction, AdamW and clipping at 1.0.
#
#   bench/gpu_vs_fsdp2.sh [CONFIG.json] [BATCH] [SEQ] [STEPS]
#
# Defaults: tests/data/bench_qwen3_moe.json, batch 16 x seq 1024, 12 steps.
# Each figure is the median step time after 2 warm-up steps. Needs a
# --config=cuda build: SHARDD_BIN (a folder laid out as bazel-bin, e.g. the
# unpacked tools/gpu_bundle.sh bundle) or bazel here.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-tests/data/bench_qwen3_moe.json}
batch=${2:-16}
seq=${3:-1024}
steps=${4:-12}

out=$(SHARDD_DEVICE=cuda SHARDD_MODEL=$config SHARDD_WORKERS=1 \
  SHARDD_STEPS=$steps SHARDD_TLS=0 SHARDD_BATCH=$batch SHARDD_SEQ=$seq \
  SHARDD_TRAIN_ARGS="--json" SHARDD_ORDER=1 \
  deploy/local/run.sh 2>&1) || {
  echo "$out" | tail -n 30 >&2
  echo "gpu_vs_fsdp2: the shardd run failed" >&2
  exit 1
}
# Median step time of the `shardctl train --json` step lines after 2.
shardd=$(grep '^{"event":"step"' <<<"$out" | python3 -c '
import json, statistics, sys
steps = [json.loads(line) for line in sys.stdin]
t = statistics.median(s["step_seconds"] for s in steps[2:])
last = steps[-1]
print("%.0f %.1f %.4f" % (last["tokens"] / t, t * 1e3, last["loss"]))')
read -r shardd_tps shardd_ms shardd_loss <<<"$shardd"
torch_line=$(python3 bench/torch_qwen3_step.py "$config" --batch "$batch" \
  --seq "$seq" --steps "$((steps - 2))" --warmup 2 --device cuda --fsdp2)
torch_tps=$(sed -n 's/.*, \([0-9]*\) tokens\/s.*/\1/p' <<<"$torch_line")
echo "config $config, batch $batch x seq $seq"
echo "shardd (1 GPU worker): step $shardd_ms ms, $shardd_tps tokens/s, last loss $shardd_loss"
echo "$torch_line"
python3 -c "print(f'shardd / torch FSDP2: {$shardd_tps / $torch_tps:.2f}x')"
