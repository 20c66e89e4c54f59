#!/usr/bin/env bash
# Installs the Debian packages shardd needs (tools/packages.txt) when they are
# missing. Idempotent: with everything present it only checks and returns.
# The tests' Python packages (PyPI) are tools/python_env.sh's, which
# tools/test.sh runs after this; the main job and the image need none.
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

if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: CUDA found at /usr/local/cuda ($(/usr/local/cuda/bin/nvcc --version | tail -1))"
else
  echo "setup: no CUDA at /usr/local/cuda; --config=cuda builds are unavailable (CPU builds are unaffected)"
fi
