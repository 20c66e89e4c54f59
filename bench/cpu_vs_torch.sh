#!/usr/bin/env bash
# One shardd CPU worker against plain PyTorch 2 (bench/torch_qwen3_step.py)
# training the same Qwen3-MoE config on the same batch shape with the same
# thread count, in one run; prints both tokens/s and the ratio.
#
#   bench/cpu_vs_torch.sh [CONFIG.json] [BATCH] [SEQ] [THREADS] [STEPS]
#
# Defaults: tests/data/bench_qwen3_moe.json (hidden 512, 4 layers, 8
# experts top-2), batch 8 x seq 256, 2 threads, 10 steps. shardd's figure is
# its own mean step time over the steps (the first one included, as
# `shardctl train` reports it); PyTorch's is the median after 2 warm-ups.
set -euo pipefail
cd "$(dirname "$0")/.."
# PyTorch 2 from the tests' virtual environment (made here when missing).
tools/python_env.sh >&2
python=${SHARDD_VENV:-/opt/shardd/venv}/bin/python
config=${1:-tests/data/bench_qwen3_moe.json}
batch=${2:-8}
seq=${3:-256}
threads=${4:-2}
steps=${5:-10}

out=$(OPENBLAS_NUM_THREADS=$threads SHARDD_MODEL=$config SHARDD_WORKERS=1 \
  SHARDD_STEPS=$steps SHARDD_TLS=0 SHARDD_BATCH=$batch SHARDD_SEQ=$seq \
  SHARDD_TRAIN_ARGS="--json" SHARDD_ORDER=1 \
  deploy/local/run.sh 2>&1)
# The summary line of `shardctl train --json` (the last JSON line).
shardd=$(grep '^{"event":"summary"' <<<"$out" | /usr/bin/python3 -c \
  'import json, sys; print(json.loads(sys.stdin.readline())["tokens_per_second"])' \
  2>/dev/null || true)
if [[ -z "$shardd" ]]; then
  echo "$out" | tail -n 30 >&2
  echo "cpu_vs_torch: shardd did not report tokens/s" >&2
  exit 1
fi
torch_line=$("$python" bench/torch_qwen3_step.py "$config" \
  --batch "$batch" --seq "$seq" --threads "$threads" --steps "$steps")
torch=$(sed -n 's/.*, \([0-9]*\) tokens\/s.*/\1/p' <<<"$torch_line")
echo "config $config, batch $batch x seq $seq, $threads threads"
echo "shardd (1 CPU worker): $shardd tokens/s"
echo "$torch_line"
/usr/bin/python3 -c "print(f'shardd / torch: {$shardd / $torch:.2f}x')"
