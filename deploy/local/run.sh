#!/usr/bin/env bash
# The README's first command: installs what is missing, builds, starts a
# coordinator on loopback, drives it with shardctl, and stops every process
# it started.
#
# Today the job plans models against the running coordinator (strategies,
# the tiny MoE and DiffusionGemma-26B cut over 8 ranks with both strategies).
# Worker processes and training join with the workers issue.
set -euo pipefail
cd "$(dirname "$0")/../.."

tools/setup.sh
bazel build //server:shardd-coordinator //client:shardctl

workdir=$(mktemp -d /tmp/shardd-local.XXXXXX)
coordinator_pid=""
cleanup() {
  if [[ -n "$coordinator_pid" ]] && kill -0 "$coordinator_pid" 2>/dev/null; then
    kill -TERM "$coordinator_pid" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$coordinator_pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$coordinator_pid" 2>/dev/null || true
  fi
  rm -rf "$workdir"
}
trap cleanup EXIT INT TERM

bin=bazel-bin
"$bin/server/shardd-coordinator" --listen=127.0.0.1:0 --data-dir="$workdir/data" \
  2>"$workdir/coordinator.log" &
coordinator_pid=$!

# Wait (bounded) for the coordinator to publish its port.
port=""
for _ in $(seq 100); do
  if [[ -s "$workdir/data/coordinator.port" ]]; then
    port=$(cat "$workdir/data/coordinator.port")
    break
  fi
  kill -0 "$coordinator_pid" 2>/dev/null || break
  sleep 0.1
done
if [[ -z "$port" ]]; then
  echo "run.sh: coordinator did not start; its log:" >&2
  cat "$workdir/coordinator.log" >&2
  exit 1
fi
addr="127.0.0.1:$port"
echo "== coordinator at $addr"

shardctl() { "$bin/client/shardctl" "$@"; }

echo "== shardctl strategies"
shardctl strategies --coordinator "$addr"
echo
echo "== shardctl plan --model tests/data/tiny_moe.json --dp 4"
shardctl plan --coordinator "$addr" --model tests/data/tiny_moe.json --dp 4
echo
for strategy in default diffusion_gemma; do
  echo "== shardctl plan --hf-config tests/data/diffusion_gemma_26b.json --dp 8 --strategy $strategy"
  shardctl plan --coordinator "$addr" --hf-config tests/data/diffusion_gemma_26b.json \
    --dp 8 --strategy "$strategy"
  echo
done
echo "== shardctl status"
shardctl status --coordinator "$addr"
