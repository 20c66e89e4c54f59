#!/usr/bin/env bash
# The README's test command: installs what is missing, runs the whole test
# suite, and (when CUDA is present) checks that the CUDA targets compile and
# link. Extra arguments go to `bazel test`.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
status=0
bazel test //... "$@" || status=$?
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  bazel build --config=cuda //kernels/... || status=1
fi
exit $status
