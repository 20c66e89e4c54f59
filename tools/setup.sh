#!/usr/bin/env bash
# Installs the Debian packages shardd needs (tools/packages.txt) when they are
# missing. Idempotent: with everything present it only checks and returns.
# CUDA and NCCL are not Debian packages; they are used from /usr/local/cuda
# when present (only `--config=cuda` builds need them).
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t wanted < <(grep -v '^\s*#' tools/packages.txt | grep -v '^\s*$')
missing=()
for line in "${wanted[@]}"; do
  read -r pkg stand_in <<<"$line"
  # "PACKAGE COMMAND": a COMMAND already on PATH stands in for PACKAGE.
  if [[ -n "${stand_in:-}" ]] && command -v "$stand_in" >/dev/null; then
    continue
  fi
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#wanted[@]} packages present"
else
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: run as root (or: sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The npm packages the deploy/k8s tests validate manifests with, exactly as
# locked, into the git-ignored deploy/k8s/tests/node_modules (bazel test
# downloads nothing). Reinstalled only when the lock file changed.
npm_dir=deploy/k8s/tests
if ! cmp -s "$npm_dir/package-lock.json" \
    "$npm_dir/node_modules/.shardd-package-lock.json"; then
  echo "setup: npm ci in $npm_dir"
  (cd "$npm_dir" && npm ci --no-audit --no-fund --loglevel=error)
  cp "$npm_dir/package-lock.json" \
    "$npm_dir/node_modules/.shardd-package-lock.json"
else
  echo "setup: npm packages in $npm_dir/node_modules up to date"
fi

if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: CUDA found at /usr/local/cuda ($(/usr/local/cuda/bin/nvcc --version | tail -1))"
else
  echo "setup: no CUDA at /usr/local/cuda; --config=cuda builds are unavailable (CPU builds are unaffected)"
fi
