#!/usr/bin/env bash
# Runs the CPU kernel tests under every OpenBLAS kernel this CPU executes
# (OPENBLAS_CORETYPE; tools/openblas_core_types.sh), so that a machine sees
# what the other kinds of x86-64 machine would, as far as its instructions
# allow: an AVX-512 Xeon runs the Zen/Haswell kernels an AMD EPYC picks,
# and the SkylakeX kernels too. Fails when a test fails under any kernel, or
# when OpenBLAS does not take the kernel it is given.
#
#   openblas_core_types_test.sh CORE_TYPES_SCRIPT TEST_BINARY...
set -uo pipefail

core_types_script=$1
shift
mapfile -t cores < <("$core_types_script" --why)
if ((${#cores[@]} == 0)); then
  echo "FAIL: no OpenBLAS kernel this CPU can run (is libopenblas installed?)"
  exit 1
fi
echo "kernels: ${cores[*]}"
failures=0
runs=0
scratch=${TEST_TMPDIR:-$(mktemp -d)}
for core in "${cores[@]}"; do
  for bin in "$@"; do
    log="$scratch/${core}_$(basename "$bin").log"
    OPENBLAS_VERBOSE=2 OPENBLAS_CORETYPE=$core "$bin" --gtest_brief=1 \
      >"$log" 2>&1
    status=$?
    runs=$((runs + 1))
    got=$(sed -n 's/^Core: //p' "$log" | head -1)
    if [[ "${got,,}" != "${core,,}" ]]; then
      echo "FAIL: OPENBLAS_CORETYPE=$core ran kernel '$got' in $(basename "$bin")"
      failures=$((failures + 1))
    elif ((status != 0)); then
      echo "FAIL: $(basename "$bin") under $core (exit $status):"
      grep -E 'Failure|FAILED|Expected|Which is|actual' "$log" | head -20
      failures=$((failures + 1))
    else
      echo "ok: $(basename "$bin") under $core"
    fi
  done
done
echo "$((runs - failures)) of $runs runs passed under ${#cores[@]} kernels"
((failures == 0))
