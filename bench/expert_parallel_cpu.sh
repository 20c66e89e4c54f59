#!/usr/bin/env bash
# Expert parallelism against pure FSDP on 4 CPU workers over loopback
# (issue 31 item 5), in one run, same model, batch, sequence and seed: the
# median step time after a warm-up and the bytes each rank moves per step
# (all-gather, reduce-scatter, all-to-all), as the plan counts them and as
# the workers measured them.
#
#   bench/expert_parallel_cpu.sh [CONFIG.json] [BATCH] [SEQ] [STEPS] [EP]
#
# Defaults: tests/data/bench_qwen3_moe.json (8 experts per layer, 86% of
# the parameters), global batch 8 x seq 256, 8 timed steps after 2 warm-up
# steps, --ep 4 against no expert parallelism. Each worker gets one thread
# (4 workers on this 2-core machine share the cores).
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-tests/data/bench_qwen3_moe.json}
batch=${2:-8}
seq=${3:-256}
steps=${4:-8}
ep=${5:-4}
warmup=2
workers=4
shardctl=${SHARDD_BIN:-bazel-bin}/client/shardctl

# run EP: the median step time and the measured all-to-all bytes per step.
run() {
  local flags=$1 out
  out=$(SHARDD_CPU_THREADS=1 SHARDD_MODEL=$config SHARDD_WORKERS=$workers \
    SHARDD_STEPS=$((steps + warmup)) SHARDD_TLS=0 SHARDD_BATCH=$batch \
    SHARDD_SEQ=$seq \
    SHARDD_TRAIN_ARGS="--json --no-mixed-precision --grad-clip 0 $flags" \
    SHARDD_ORDER=1 deploy/local/run.sh 2>&1) || {
    echo "$out" | tail -n 30 >&2
    echo "expert_parallel_cpu: the run with '$flags' failed" >&2
    return 1
  }
  grep '^{"event":"step"' <<<"$out" | python3 -c '
import json, statistics, sys
warmup = int(sys.argv[1])
lines = [json.loads(l) for l in sys.stdin][warmup:]
print(statistics.median(l["step_seconds"] for l in lines),
      max(l.get("all_to_all_bytes", 0) for l in lines))' "$warmup"
}

# plan EP: the plan's per-rank bytes per step.
plan() {
  "$shardctl" plan --hf-config "$config" --dp "$workers" --no-mixed-precision \
    --micro-batch-size $((batch / workers)) --seq "$seq" $1 --json |
    python3 -c '
import json, sys
c = json.load(sys.stdin)["comm"]
print(c["all_gather_bytes"], c["reduce_scatter_bytes"], c["all_to_all_bytes"])'
}

echo "config $config, global batch $batch x seq $seq, $workers CPU workers" \
     "of 1 thread, fp32, median of $steps steps after $warmup"
printf '%-12s %10s %12s %12s %12s %12s %14s\n' mode "step s" "tokens/s" \
  "all-gather" "red-scatter" "all-to-all" "a2a measured"
for flags in "" "--ep $ep"; do
  read -r seconds measured < <(run "$flags")
  read -r ag rs a2a < <(plan "$flags")
  python3 -c '
import sys
name, s, tokens, ag, rs, a2a, m = sys.argv[1:]
mib = lambda b: "%.1f MiB" % (int(b) / 2**20)
print("%-12s %10.3f %12.0f %12s %12s %12s %14s" % (
    name, float(s), int(tokens) / float(s), mib(ag), mib(rs), mib(a2a),
    mib(m)))' "${flags:-fsdp}" "$seconds" "$((batch * seq))" "$ag" "$rs" \
    "$a2a" "$measured"
done
