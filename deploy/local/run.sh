#!/usr/bin/env bash
# The README's first command. Installs what is missing, builds, starts a
# coordinator and 4 CPU workers on loopback, trains a small Qwen3-MoE
# language model (tests/data/small_qwen3_moe.json: attention + MoE) with
# FSDP over the 4 workers for a few hundred steps on synthetic data of order
# 3 (worker/data/order_k_source.h), shows the loss falling toward the data's
# best reachable loss and below the floor of a model without attention,
# then stops every process it started.
#
# Knobs (environment): SHARDD_WORKERS (4), SHARDD_STEPS (300),
# SHARDD_TRAIN_ARGS (extra `shardctl train` flags, e.g. "--microbatches 2
# --defer-grad-sync" or "--fine-grained"), SHARDD_COORDINATOR_ARGS (extra
# shardd-coordinator flags, e.g. "--heartbeat-relay-group=2"), SHARDD_TLS (1: every endpoint
# serves mutual TLS with a throwaway CA from tools/make_test_certs.sh, and
# clients and workers present their bearer tokens; 0: plaintext, no tokens),
# SHARDD_MODEL (the model: a native spec or a Hugging Face config.json;
# default tests/data/small_qwen3_moe.json), SHARDD_ORDER (the synthetic
# data's order: 3 by default; 1 is a first-order Markov chain, all an
# attention-free model such as tests/data/small_moe.json can learn),
# SHARDD_BATCH and SHARDD_SEQ (global
# batch and sequence length, default 64 and 64), SHARDD_DEVICE (cpu, or cuda: worker i runs on cuda:i over NCCL; needs a
# --config=cuda build), SHARDD_BIN (a folder of prebuilt binaries laid out as
# bazel-bin, e.g. gpu_bundle/bin from tools/gpu_bundle.sh; then nothing is
# installed or built), SHARDD_PICTURES (where the pictures go: the loss curve, and the memory
# timeline of one step as rank 0 measured it and as the planner predicts
# it; default: a new /tmp/shardd-pictures.XXXXXX, kept after the run),
# SHARDD_CPU_THREADS (each CPU worker's compute threads; default the cores
# divided among the workers, at least 1).
#
# Every process serves Prometheus metrics on a free loopback port
# (--metrics-listen); the addresses are printed, and the end of the run
# shows a few of the scraped values.
set -euo pipefail
cd "$(dirname "$0")/../.."

workers=${SHARDD_WORKERS:-4}
steps=${SHARDD_STEPS:-300}
read -r -a extra_args <<<"${SHARDD_TRAIN_ARGS:-}"
read -r -a coordinator_args <<<"${SHARDD_COORDINATOR_ARGS:-}"
tls=${SHARDD_TLS:-1}

device=${SHARDD_DEVICE:-cpu}
model=${SHARDD_MODEL:-tests/data/small_qwen3_moe.json}
order=${SHARDD_ORDER:-3}
global_batch=${SHARDD_BATCH:-64}
seq=${SHARDD_SEQ:-64}
if [[ "$device" != cpu && "$device" != cuda ]]; then
  echo "run.sh: SHARDD_DEVICE: expected cpu or cuda, got '$device'" >&2
  exit 2
fi

if [[ -n "${SHARDD_BIN:-}" ]]; then
  bin=$SHARDD_BIN
else
  tools/setup.sh
  cuda_config=()
  [[ "$device" == cuda ]] && cuda_config=(--config=cuda)
  bazel build "${cuda_config[@]}" //server:shardd-coordinator \
    //worker:shardd-worker //client:shardctl
  bin=bazel-bin
fi
workdir=$(mktemp -d /tmp/shardd-local.XXXXXX)
pictures=${SHARDD_PICTURES:-$(mktemp -d /tmp/shardd-pictures.XXXXXX)}
mkdir -p "$pictures"
pids=()

# Stops every started process: SIGTERM, up to 10 s for all of them to exit,
# then SIGKILL for any left. Workers go first so that none outlives the
# coordinator it reports to.
stop_all() {
  local pid alive=()
  for pid in "$@"; do
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      alive+=("$pid")
    fi
  done
  ((${#alive[@]} == 0)) && return 0
  for _ in $(seq 100); do
    local left=()
    for pid in "${alive[@]}"; do
      kill -0 "$pid" 2>/dev/null && left+=("$pid")
    done
    ((${#left[@]} == 0)) && break
    alive=("${left[@]}")
    sleep 0.1
  done
  for pid in "${alive[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "run.sh: process $pid did not stop within 10 s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  # Reap them (they are our children).
  for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if ((${#pids[@]} > 0)); then
    # pids[0] is the coordinator; stop the workers first.
    stop_all "${pids[@]:1}"
    stop_all "${pids[0]}"
    echo "== stopped the coordinator and $((${#pids[@]} - 1)) workers"
  fi
  if ((status != 0)) && [[ -d "$workdir" ]]; then
    for log in "$workdir"/*.log; do
      [[ -s "$log" ]] || continue
      echo "---- last lines of $(basename "$log") ----" >&2
      tail -n 20 "$log" >&2
    done
  fi
  rm -rf "$workdir"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

coordinator_security=()
worker_security=()
client_security=()
if [[ "$tls" == 1 ]]; then
  certs="$workdir/certs"
  tools/make_test_certs.sh "$certs"
  # One certificate for every process (all on 127.0.0.1); the tokens tell
  # clients from workers.
  coordinator_security=(--tls-cert="$certs/server.pem"
    --tls-key="$certs/server.key" --tls-client-ca="$certs/ca.pem"
    --client-token-file="$certs/client.token"
    --worker-token-file="$certs/worker.token" --worker-tls-ca="$certs/ca.pem")
  worker_security=(--tls-cert="$certs/server.pem" --tls-key="$certs/server.key"
    --tls-client-ca="$certs/ca.pem" --tls-ca="$certs/ca.pem"
    --worker-token-file="$certs/worker.token")
  client_security=(--tls-ca "$certs/ca.pem" --tls-cert "$certs/client.pem"
    --tls-key "$certs/client.key" --token-file "$certs/client.token")
  echo "== mutual TLS and bearer tokens on (test CA in $certs; SHARDD_TLS=0: off)"
fi

# Checkpoints: the coordinator and the workers share one directory (one
# machine), so the workers resolve the coordinator's relative paths in it.
checkpoints="$workdir/data/checkpoints"
"$bin/server/shardd-coordinator" --listen=127.0.0.1:0 \
  --data-dir="$workdir/data" --workers="$workers" \
  --checkpoint-dir="$checkpoints" --metrics-listen=127.0.0.1:0 \
  "${coordinator_security[@]}" "${coordinator_args[@]}" \
  2>"$workdir/coordinator.log" &
pids+=($!)

# Wait (bounded) for the coordinator to publish its port.
port=""
for _ in $(seq 100); do
  if [[ -s "$workdir/data/coordinator.port" ]]; then
    port=$(cat "$workdir/data/coordinator.port")
    break
  fi
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 0.1
done
if [[ -z "$port" ]]; then
  echo "run.sh: the coordinator did not start" >&2
  exit 1
fi
addr="127.0.0.1:$port"
echo "== coordinator at $addr (--workers $workers)"

# Each CPU worker splits its kernels over this many threads
# (kernels/cpu/compute_pool.h): the machine's cores shared out among the
# workers, unless SHARDD_CPU_THREADS is set.
cores=$(nproc)
cpu_threads=${SHARDD_CPU_THREADS:-$((cores / workers > 0 ? cores / workers : 1))}
for i in $(seq 0 $((workers - 1))); do
  # Rank 0 draws the memory it measures in its first step.
  timeline_flag=()
  worker_device=cpu
  [[ "$device" == cuda ]] && worker_device="cuda:$i"
  ((i == 0)) && timeline_flag=(--memory-timeline-svg="$pictures/memory-measured.svg")
  SHARDD_CPU_THREADS=$cpu_threads \
    "$bin/worker/shardd-worker" --coordinator="$addr" --listen=127.0.0.1:0 \
    --device="$worker_device" --requested-rank="$i" "${worker_security[@]}" \
    "${timeline_flag[@]}" \
    --checkpoint-root="$checkpoints" --metrics-listen=127.0.0.1:0 \
    2>"$workdir/worker$i.log" &
  pids+=($!)
done

# The security flags go after the command name.
shardctl() {
  local command="$1"
  shift
  "$bin/client/shardctl" "$command" "${client_security[@]}" "$@"
}

# Wait (bounded) until every worker registered and heartbeats.
live=0
for _ in $(seq 150); do
  live=$(shardctl status --coordinator "$addr" 2>/dev/null | grep -c ' alive ' || true)
  ((live >= workers)) && break
  for pid in "${pids[@]:1}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "run.sh: a worker exited before registering" >&2
      exit 1
    fi
  done
  sleep 0.2
done
if ((live < workers)); then
  echo "run.sh: only $live of $workers workers registered within 30 s" >&2
  exit 1
fi
echo "== $workers workers registered"

# The metrics address each process logged once serving ("... metrics
# listening on HOST:PORT").
metrics_address() {
  sed -n 's/.*metrics listening on \([0-9.]*:[0-9]*\).*/\1/p' "$1" | head -n 1
}
# Prints the samples of the named metric families from a /metrics endpoint.
scrape() {
  local address="$1"
  shift
  python3 - "http://$address/metrics" "$@" <<'PY'
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
text = opener.open(sys.argv[1], timeout=5).read().decode()
for line in text.splitlines():
    if line.split("{")[0].split(" ")[0] in sys.argv[2:]:
        print("   " + line)
PY
}
echo "== Prometheus metrics (GET http://ADDRESS/metrics):"
echo "   coordinator $(metrics_address "$workdir/coordinator.log")"
for i in $(seq 0 $((workers - 1))); do
  echo "   worker $i    $(metrics_address "$workdir/worker$i.log")"
done
shardctl status --coordinator "$addr"
echo

# A token file (--data in SHARDD_TRAIN_ARGS) replaces the synthetic data.
order_args=(--synthetic-order "$order")
[[ " ${extra_args[*]} " == *" --data "* ]] && order_args=()
echo "== shardctl train --model $model --steps $steps ${order_args[*]} ${extra_args[*]}"
shardctl train --coordinator "$addr" --model "$model" \
  --steps "$steps" --global-batch "$global_batch" --seq "$seq" --lr 0.01 --seed 1 \
  "${order_args[@]}" \
  --loss-svg "$pictures/loss.svg" "${extra_args[@]}"
echo

# The planner's prediction of the same step, for comparison with the
# measured one (in-process: no coordinator needed).
"$bin/client/shardctl" plan --model "$model" --dp "$workers" \
  --timeline-svg "$pictures/memory-planned.svg" >/dev/null
echo "== pictures in $pictures:"
for picture in loss.svg memory-measured.svg memory-planned.svg; do
  if [[ -s "$pictures/$picture" ]]; then
    echo "   $pictures/$picture"
  else
    echo "   ($picture was not written; see the worker0 log)"
  fi
done
echo

echo "== shardctl status"
shardctl status --coordinator "$addr"
echo

echo "== scraped from the coordinator's /metrics"
scrape "$(metrics_address "$workdir/coordinator.log")" \
  shardd_coordinator_job_steps_done shardd_coordinator_job_loss \
  shardd_coordinator_job_tokens_per_second shardd_coordinator_workers
echo "== scraped from rank 0's /metrics"
scrape "$(metrics_address "$workdir/worker0.log")" \
  shardd_worker_steps_total shardd_worker_collective_bytes_total \
  shardd_worker_memory_peak_bytes
