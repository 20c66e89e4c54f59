#!/usr/bin/env bash
# Runs the numerically sensitive tests under every OpenBLAS kernel this CPU
# can execute (OPENBLAS_CORETYPE), every SIMD level of the project's own
# activation kernels (SHARDD_CPU_ISA) and 1 and 2 OpenBLAS threads, and
# prints the matrix. A machine of another kind (AVX2-only AMD, AVX-512
# Intel) picks one of these kernels by itself, so passing here for all of
# them is what makes tools/test.sh pass there. docs/testing.md explains the
# tolerances and records the matrix.
#
#   tools/test_portability.sh [--quick] [--markdown FILE]
#
# --quick: only the diagonal (each core type at the best SIMD level and
#          1 thread, each SIMD level with the CPU's own core type) instead of
#          the whole cross product.
# --markdown FILE: also writes the matrix as a Markdown table to FILE.
#
# Unit-level tests run for every combination; the multi-process training and
# checkpoint tests (they start real workers, which inherit the environment)
# once per core type. Exits non-zero if any run fails or if OpenBLAS did not
# take the core type it was given.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
markdown=""
while (($#)); do
  case "$1" in
    --quick) quick=1 ;;
    --markdown)
      shift
      markdown="${1:?--markdown needs a file}"
      ;;
    *)
      echo "usage: $0 [--quick] [--markdown FILE]" >&2
      exit 2
      ;;
  esac
  shift
done

tools/setup.sh >/dev/null
config=()
[[ -x /usr/local/cuda/bin/nvcc ]] && config=(--config=cuda)

# Every CPU kernel test, and the executor, model and store tests whose
# numerics ride on them.
mapfile -t kernel_tests < <(bazel query --noshow_progress \
  'kind("cc_test", //kernels/cpu/...)' 2>/dev/null)
unit_tests=(
  "${kernel_tests[@]}"
  //worker/exec:step_executor_test
  //worker/exec:muon_optimizer_test
  //worker/exec:device_parity_cpu_test
  //worker/shards:shard_checkpoint_test
  //worker/shards:lora_merge_test
  //worker:worker_runtime_test
  //worker/model:moe_model_test
  //worker/model:moe_model_diffusion_test
  //worker/model:expert_parallel_model_test
  //worker/model:packed_rows_test
  //worker/model:device_moe_model_cpu_test
  //testing:numerics_test
)
process_tests=(
  //tests:train_integration_test
  //tests:checkpoint_integration_test
)
bazel build "${config[@]}" "${unit_tests[@]}" "${process_tests[@]}"

flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() {
  local f
  for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done
}
cpu_model=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')

# The OpenBLAS kernels this CPU executes (the rest would die of SIGILL).
mapfile -t core_types < <(tools/openblas_core_types.sh --why)
# GCC's micro-architecture levels (simd_level.h).
simd_levels=(x86-64)
has avx avx2 bmi1 bmi2 f16c fma abm movbe xsave && simd_levels+=(x86-64-v3)
has avx512f avx512bw avx512cd avx512dq avx512vl &&
  [[ " ${simd_levels[*]} " == *" x86-64-v3 "* ]] && simd_levels+=(x86-64-v4)
native_core=$(OPENBLAS_VERBOSE=2 bazel-bin/kernels/cpu/router_test \
  --gtest_list_tests 2>&1 | sed -n 's/^Core: //p' | head -1)

echo "portability: ${cpu_model}; OpenBLAS picks ${native_core} by itself"
echo "portability: core types: ${core_types[*]}"
echo "portability: SIMD levels: ${simd_levels[*]}"

logs=$(mktemp -d)
failures=0
# The logs stay where something failed, and the script says where.
trap 'if ((failures)); then echo "portability: logs in $logs" >&2; else rm -rf "$logs"; fi' EXIT
declare -A cell
passes=0

# run_units CORE LEVEL THREADS: every unit test binary under that setting.
run_units() {
  local core=$1 level=$2 threads=$3 target bin name status=PASS
  local log="$logs/${core}_${level}_${threads}.log"
  : >"$log"
  # OpenBLAS must really use the kernel asked for.
  local got
  got=$(OPENBLAS_VERBOSE=2 OPENBLAS_CORETYPE=$core \
    bazel-bin/kernels/cpu/router_test --gtest_list_tests 2>&1 |
    sed -n 's/^Core: //p' | head -1)
  if [[ "${got,,}" != "${core,,}" ]]; then
    echo "portability: OPENBLAS_CORETYPE=$core gave core '$got'" | tee -a "$log"
    status=FAIL
  fi
  for target in "${unit_tests[@]}"; do
    name=${target#//}
    bin="bazel-bin/${name/://}"
    local tmp runfiles="$PWD/$bin.runfiles"
    tmp=$(mktemp -d)
    # As `bazel test` runs it: in its runfiles tree, where the test data is.
    if ! (cd "$runfiles/shardd" && TEST_TMPDIR="$tmp" \
      TEST_SRCDIR="$runfiles" TEST_WORKSPACE=shardd \
      OPENBLAS_CORETYPE=$core OPENBLAS_NUM_THREADS=$threads \
      SHARDD_CPU_ISA=$level "$runfiles/../$(basename "$bin")" \
      >>"$log" 2>&1); then
      echo "portability: FAILED $target (core $core, $level, $threads threads)"
      status=FAIL
    fi
    rm -rf "$tmp"
  done
  cell["$core|$level|$threads"]=$status
  if [[ $status == PASS ]]; then
    passes=$((passes + 1))
  else
    failures=$((failures + 1))
  fi
  printf 'portability: %-11s %-9s threads=%s  %s\n' "$core" "$level" \
    "$threads" "$status"
}

best_level=${simd_levels[-1]}
for core in "${core_types[@]}"; do
  for level in "${simd_levels[@]}"; do
    for threads in 1 2; do
      if ((quick)); then
        # The diagonal: every core type at the best level with 1 thread,
        # every level and thread count with OpenBLAS' own choice.
        if ! { [[ $level == "$best_level" && $threads == 1 ]] ||
          [[ "${core,,}" == "${native_core,,}" ]]; }; then
          continue
        fi
      fi
      run_units "$core" "$level" "$threads"
    done
  done
done

# The multi-process tests: once per core type, through bazel (runfiles,
# scratch directories), with the environment passed to the test and so to
# the workers it starts.
declare -A process_cell
for core in "${core_types[@]}"; do
  if bazel test "${config[@]}" --nocache_test_results \
    --test_env=OPENBLAS_CORETYPE="$core" --test_env=OPENBLAS_NUM_THREADS=1 \
    "${process_tests[@]}" >"$logs/process_$core.log" 2>&1; then
    process_cell[$core]=PASS
    passes=$((passes + 1))
  else
    process_cell[$core]=FAIL
    failures=$((failures + 1))
    grep -E '^//' "$logs/process_$core.log" || true
  fi
  printf 'portability: %-11s multi-process tests  %s\n' "$core" \
    "${process_cell[$core]}"
done

table() {
  local header="| OPENBLAS_CORETYPE |" rule="|---|" level threads core row
  for level in "${simd_levels[@]}"; do
    for threads in 1 2; do
      header+=" $level, $threads thr |"
      rule+="---|"
    done
  done
  header+=" multi-process |"
  rule+="---|"
  echo "$header"
  echo "$rule"
  for core in "${core_types[@]}"; do
    row="| $core |"
    for level in "${simd_levels[@]}"; do
      for threads in 1 2; do
        row+=" ${cell["$core|$level|$threads"]:-—} |"
      done
    done
    row+=" ${process_cell[$core]} |"
    echo "$row"
  done
}

echo
echo "CPU: ${cpu_model} (OpenBLAS' own choice: ${native_core})"
table
if [[ -n "$markdown" ]]; then
  {
    echo "CPU: ${cpu_model} (OpenBLAS' own choice: ${native_core})"
    echo
    table
  } >"$markdown"
fi
echo "portability: ${passes} settings passed, ${failures} failed"
exit $((failures > 0))
