#!/usr/bin/env bash
# Shows that the equivalence tests catch broken gradient reductions: applies
# one deliberate bug at a time to the reduce-scatter path, rebuilds
# //worker/exec:step_executor_test, runs its equivalence suites and reports how
# many cases fail; then restores the sources. Every mutation must make
# tests fail. docs/testing.md records a run.
#
#   tools/mutation_check.sh
#
# The files it mutates must have no uncommitted changes (they are restored
# with git checkout).
set -euo pipefail
cd "$(dirname "$0")/.."

files=(worker/shards/shard_store.cc worker/exec/step_executor.cc)
if ! git diff --quiet -- "${files[@]}"; then
  echo "mutation_check: ${files[*]} have uncommitted changes" >&2
  exit 2
fi
restore() { git checkout -- "${files[@]}"; }
trap restore EXIT

config=()
[[ -x /usr/local/cuda/bin/nvcc ]] && config=(--config=cuda)
filter='Worlds/*:*ReferenceTest*:*MixedPrecision*'

# mutate FILE PERL_EXPRESSION: applies it; fails if it changed nothing.
mutate() {
  local file=$1 expr=$2 before
  before=$(sha1sum "$file")
  perl -0pi -e "$expr" "$file"
  if [[ "$(sha1sum "$file")" == "$before" ]]; then
    echo "mutation_check: the pattern no longer matches $file" >&2
    exit 2
  fi
}

status=0
run() {
  local name=$1
  bazel build "${config[@]}" //worker/exec:step_executor_test >/dev/null 2>&1 || {
    echo "mutation_check: $name does not build" >&2
    exit 2
  }
  local out
  out=$(bazel-bin/worker/step_executor_test --gtest_filter="$filter" 2>&1 ||
    true)
  # Failed cases, once each, without gtest's dump of the parameter.
  local names failed passed
  names=$(grep '^\[  FAILED  \] [A-Za-z]' <<<"$out" |
    sed 's/^\[  FAILED  \] //; s/, where GetParam.*//; s/ (.*//' | sort -u ||
    true)
  failed=$(grep -c . <<<"$names" || true)
  passed=$(grep -c '^\[       OK \]' <<<"$out" || true)
  printf '%-20s %2d cases fail, %2d pass\n' "$name" "$failed" "$passed"
  [[ -n "$names" ]] && sed 's/^/    /' <<<"$names"
  if [[ $name != unmodified && $failed -eq 0 ]]; then
    echo "mutation_check: $name was not caught" >&2
    status=1
  fi
  if [[ $name == unmodified && $failed -ne 0 ]]; then status=1; fi
  restore
}

run unmodified

# 1. The reduce-scatter sums instead of averaging over the shard group.
mutate worker/shards/shard_store.cc \
  's/(shard_group->ReduceScatter\(\s*state->unsharded_grad\.data\(\), out, chunk, state->reduce, )ReduceOp::kAvg/${1}ReduceOp::kSum/s'
run missing_average

# 2. Shard rank 1's contribution is lost: it reduces a zeroed buffer.
mutate worker/shards/shard_store.cc \
  's/(  SHARDD_RETURN_IF_ERROR\(shard_group->ReduceScatter\()/  if (options_.shard_rank == 1) {\n    std::memset(state->unsharded_grad.data(), 0,\n                chunk * elem * shard_group->world_size());\n  }\n$1/s'
run one_rank_dropped

# 3. Padding rows counted: the last rank's padding rows get a copy of the
#    last real row's gradient, and the executor counts them as trainable
#    rows (norm, clipping, AdamW).
mutate worker/shards/shard_store.cc \
  's/(    if \(rows <= 0\) break;\n)(    AddInto\(values)/$1    for (int64_t p = rows; p < param->rows_per_rank; ++p) {\n      AddInto(values + (param->dim0 - 1) * param->row_numel, param->row_numel,\n              unit->reduce,\n              base + (r * unit->grad_chunk_numel + param->grad_offset +\n                      p * param->row_numel) * elem);\n    }\n$2/s'
mutate worker/exec/step_executor.cc \
  's/std::min\(rows_per_rank, dim0 - r \* rows_per_rank\)\)/rows_per_rank)/s'
run padding_row_counted

# 4. A wrong offset in the flat (Megatron-FSDP) buffer: the reduced chunk
#    lands one element late.
mutate worker/shards/shard_store.cc 's/add\(0, 0, chunk\);/add(0, 1, chunk - 1);/s'
run flat_offset_by_one

exit $status
