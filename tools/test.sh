#!/usr/bin/env bash
# The README's test command: installs what is missing (Debian packages, then
# the tests' Python environment from PyPI) and runs the whole test suite. Where nvcc is present (/usr/local/cuda) the suite runs under
# --config=cuda, so the CUDA kernels, the NCCL communicator and the device
# allocator compile and link too and their CPU-runnable tests run; tests
# tagged "gpu" are built but not run there (they need a GPU: run them with
# `bazel test --config=cuda --test_tag_filters=gpu //...` on a GPU machine).
# Then the GPU check's bundle is built and dry-run (tools/gpu_check.sh
# --dry-run), and the default (CUDA-free) build is checked to still build. Extra
# arguments go to `bazel test`. First, tools/check_layering.sh checks that
# no package depends on one above it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
# The tests' Python environment: torch, transformers, safetensors,
# kubernetes-validate at tools/python-requirements.txt's versions.
tools/python_env.sh
status=0
# Dependencies point one way (docs/design.md, "Package map").
tools/check_layering.sh || status=1
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  bazel test --config=cuda --test_tag_filters=-gpu //... "$@" || status=$?
  # The GPU check's bundle from this tree, and its dry run: everything
  # tools/gpu_check.sh needs is built, fits the device tool and is present.
  { tools/gpu_bundle.sh && tools/gpu_check.sh --dry-run; } || status=1
  bazel build //... || status=1
else
  bazel test //... "$@" || status=$?
fi
exit $status
