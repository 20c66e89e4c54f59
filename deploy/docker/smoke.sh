#!/usr/bin/env bash
# Checks a built shardd image end to end: every binary finds its shared
# libraries, and a coordinator and 2 CPU workers started from the image (as
# its user, uid 10001, on the host's loopback) train the small MoE for 20
# steps driven by the image's shardctl; the loss must fall and the
# coordinator's /metrics must count the steps.
#
#   deploy/docker/smoke.sh [IMAGE]            # default shardd:latest
#
# SHARDD_ENGINE picks how containers run: docker (default when present) or
# podman run each process as a container with --network host; chroot
# (podman-built images, as root) runs the binaries from the image's root
# filesystem instead, for machines whose container runtime cannot start
# containers (e.g. VMs that forbid the runtime's setrlimit calls).
set -euo pipefail
cd "$(dirname "$0")/../.."

image=${1:-shardd:latest}
engine=${SHARDD_ENGINE:-$(command -v docker >/dev/null && echo docker || echo podman)}
port=${SHARDD_SMOKE_PORT:-7470}
metrics_port=$((port + 1))
steps=20
work=$(mktemp -d /tmp/shardd-image-smoke.XXXXXX)
chmod 755 "$work"
cp tests/data/small_moe.json "$work/"
chmod 644 "$work/small_moe.json"
# The coordinator's --data-dir, writable by the image's user.
mkdir "$work/data"
chmod 777 "$work/data"
pids=()
root=""
ctr=""

cleanup() {
  local status=$?
  # Workers first, the coordinator last; SIGKILL after 10 s.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2>/dev/null || true
  done
  for _ in $(seq 100); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive == 0)) && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ -n "$root" ]]; then
    umount "$root/work" "$root/dev" "$root/proc" 2>/dev/null || true
    podman umount "$ctr" >/dev/null 2>&1 || true
  fi
  [[ -n "$ctr" ]] && podman rm -f "$ctr" >/dev/null 2>&1 || true
  if ((status != 0)); then
    for log in "$work"/*.log; do
      [[ -f "$log" ]] || continue
      echo "---- $(basename "$log")" >&2
      tail -n 15 "$log" >&2
    done
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT

if [[ "$engine" == chroot ]]; then
  ctr=$(podman create "$image" true)
  root=$(podman mount "$ctr")
  mkdir -p "$root/work"
  mount --bind /proc "$root/proc"
  mount --bind /dev "$root/dev"
  mount --bind "$work" "$root/work"
  user=$(podman image inspect "$image" --format '{{.Config.User}}')
  runner=(chroot --userspec="$user" "$root")
else
  # docker/podman run forward SIGTERM to the container's process.
  runner=("$engine" run --rm --network host -v "$work:/work" "$image")
fi
in_image() { "${runner[@]}" "$@"; }
# Long-running processes: exec, so that the recorded pid is the process (or
# the engine's client, which forwards signals to it).
start() {
  local log="$1"
  shift
  (exec "${runner[@]}" "$@" > "$work/$log" 2>&1) &
  pids+=($!)
}

echo "== $image ($engine)"
for binary in shardd-coordinator shardd-worker shardctl; do
  if ! libraries=$(in_image ldd "/usr/local/bin/$binary" 2>&1); then
    echo "smoke: /usr/local/bin/$binary: $libraries" >&2
    exit 1
  fi
  missing=$(grep 'not found' <<<"$libraries" || true)
  if [[ -n "$missing" ]]; then
    echo "smoke: $binary is missing shared libraries:" >&2
    echo "$missing" >&2
    exit 1
  fi
done
echo "== every binary finds its shared libraries"

start coordinator.log shardd-coordinator --listen="127.0.0.1:$port" --workers=2 \
  --data-dir=/work/data --metrics-listen="127.0.0.1:$metrics_port"
for rank in 0 1; do
  start "worker$rank.log" shardd-worker --coordinator="127.0.0.1:$port" \
    --coordinator-timeout=60s --listen=127.0.0.1:0 --device=cpu \
    --requested-rank="$rank"
done

alive=0
deadline=$((SECONDS + 60))
while ((SECONDS < deadline)); do
  for pid in "${pids[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "smoke: a process exited early" >&2
      exit 1
    fi
  done
  alive=$(in_image shardctl status --coordinator "127.0.0.1:$port" \
    --timeout 2 2>/dev/null | grep -c ' alive ' || true)
  ((alive >= 2)) && break
  sleep 0.3
done
if ((alive < 2)); then
  echo "smoke: only $alive of 2 workers registered within 60 s" >&2
  exit 1
fi
echo "== 2 workers registered"

in_image shardctl train --coordinator "127.0.0.1:$port" \
  --model /work/small_moe.json --steps "$steps" --global-batch 32 --seq 32 \
  --lr 0.01 --seed 1 --json > "$work/train.json"
python3 - "$work/train.json" "$steps" "http://127.0.0.1:$metrics_port/metrics" <<'PY'
import json, sys, urllib.request
# `shardctl train --json`: a line per step, the summary last.
report = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
steps = int(sys.argv[2])
losses = report["losses"]
assert len(losses) == steps, f"expected {steps} losses, got {len(losses)}"
assert losses[-1] < 0.5 * losses[0], f"the loss did not fall: {losses}"
assert report["peak_unsharded_bytes"] == report["planned_peak_unsharded_bytes"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
text = opener.open(sys.argv[3], timeout=5).read().decode()
done = [l for l in text.splitlines()
        if l.startswith("shardd_coordinator_job_steps_done{")]
assert done and float(done[0].split()[-1]) == steps, done
print(f"== trained {steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
      f"peak {report['peak_unsharded_bytes']} B as planned; {done[0]}")
PY
echo "== image smoke test passed"
