#!/usr/bin/env bash
# shardd's CPU workers (1 and 2) against Hugging Face transformers' own model
# under PyTorch 2 (bench/torch2_step.py: eager, SDPA, torch.compile, and
# FSDP2 over Gloo with 2 processes), in one run, on the same config, batch,
# sequence, fp32 and thread count. Every figure is the median step time
# after the same warm-up; prints tokens/s for each and shardd's best over
# the fastest PyTorch peer.
#
#   bench/cpu_vs_torch.sh [CONFIG.json] [BATCH] [SEQ] [THREADS] [STEPS]
#
# Defaults: tests/data/bench_qwen3_moe.json, batch 8 x seq 256, 2 threads,
# 8 timed steps after 2 warm-up steps. With 2 workers or 2 FSDP2 processes,
# each gets half the threads.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/python_env.sh >&2
python=${SHARDD_VENV:-/opt/shardd/venv}/bin/python
config=${1:-tests/data/bench_qwen3_moe.json}
batch=${2:-8}
seq=${3:-256}
threads=${4:-2}
steps=${5:-8}
warmup=2

# shardd_tokens_per_second WORKERS: the median step after the warm-up.
shardd_tokens_per_second() {
  local workers=$1 out
  out=$(SHARDD_CPU_THREADS=$((threads / workers > 0 ? threads / workers : 1)) \
    SHARDD_MODEL=$config SHARDD_WORKERS=$workers \
    SHARDD_STEPS=$((steps + warmup)) SHARDD_TLS=0 SHARDD_BATCH=$batch \
    SHARDD_SEQ=$seq SHARDD_TRAIN_ARGS="--json --no-mixed-precision --grad-clip 0" \
    SHARDD_ORDER=1 deploy/local/run.sh 2>&1) || {
    echo "$out" | tail -n 30 >&2
    echo "cpu_vs_torch: shardd at $workers worker(s) failed" >&2
    return 1
  }
  grep '^{"event":"step"' <<<"$out" | "$python" -c '
import json, statistics, sys
warmup, tokens = int(sys.argv[1]), int(sys.argv[2])
times = [json.loads(l)["step_seconds"] for l in sys.stdin][warmup:]
print(tokens / statistics.median(times))' "$warmup" "$((batch * seq))"
}

echo "config $config, batch $batch x seq $seq, $threads threads, fp32," \
     "median of $steps steps after $warmup"
shardd=()
for workers in 1 2; do
  tps=$(shardd_tokens_per_second "$workers")
  printf 'shardd, %d CPU worker(s): %.0f tokens/s\n' "$workers" "$tps"
  shardd+=("$tps")
done
# torch2_step.py's JSON lines: each mode's figure, then the ratio of the
# best shardd figure to the fastest of them.
"$python" bench/torch2_step.py "$config" --batch "$batch" --seq "$seq" \
    --threads "$threads" --steps "$steps" --warmup "$warmup" 2>/dev/null |
  grep '^{' | "$python" -c '
import json, sys
best_shardd = max(float(x) for x in sys.argv[1:])
best_torch = 0.0
for line in sys.stdin:
    run = json.loads(line)
    mode, tps = run["mode"], run["tokens_per_second"]
    print(f"transformers under torch 2, {mode}: {tps:.0f} tokens/s")
    best_torch = max(best_torch, tps)
if best_torch == 0:
    sys.exit("cpu_vs_torch: torch2_step.py reported nothing")
print(f"shardd (best) / fastest PyTorch: {best_shardd / best_torch:.2f}x")
' "${shardd[@]}"
