#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) outside bazel and
# runs each for a bounded time on its seed corpus. Exits non-zero when a
# fuzzer finds a crash, leak, timeout or sanitizer report.
#
#   tools/run_fuzzers.sh                 # 60 s per target
#   tools/run_fuzzers.sh --seconds 300   # or FUZZ_SECONDS=300
#   tools/run_fuzzers.sh --jobs 4        # parallel fuzzing processes
#
# Outputs (binaries, the growing corpus, crash artifacts) go to
# $FUZZ_OUT (default /tmp/shardd-fuzz); the committed seed corpus is only read.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-60}"
jobs="${FUZZ_JOBS:-1}"
out="${FUZZ_OUT:-/tmp/shardd-fuzz}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds|-t) seconds="$2"; shift 2 ;;
    --seconds=*) seconds="${1#*=}"; shift ;;
    --jobs|-j) jobs="$2"; shift 2 ;;
    --jobs=*) jobs="${1#*=}"; shift ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "run_fuzzers.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done
if ! [[ "$seconds" =~ ^[0-9]+$ && "$seconds" -ge 1 ]]; then
  echo "run_fuzzers.sh: --seconds must be a positive integer, got '$seconds'" >&2
  exit 2
fi
if ! [[ "$jobs" =~ ^[0-9]+$ && "$jobs" -ge 1 ]]; then
  echo "run_fuzzers.sh: --jobs must be a positive integer, got '$jobs'" >&2
  exit 2
fi

cxx="${CXX_FUZZ:-}"
if [[ -z "$cxx" ]]; then
  for c in clang++ clang++-14 clang++-15 clang++-16; do
    if command -v "$c" >/dev/null; then cxx="$c"; break; fi
  done
fi
if [[ -z "$cxx" ]]; then
  echo "run_fuzzers.sh: clang++ not found; install clang and libclang-rt-dev" \
       "(tools/setup.sh)" >&2
  exit 2
fi

# Generated protobuf sources come from bazel.
bazel build //proto:shardd_cc_proto
bin="$(bazel info bazel-bin 2>/dev/null)"

# The same Abseil link line as //third_party:absl.
mapfile -t absl_libs < <(grep -o '"-labsl_[a-z0-9_]*"' third_party/BUILD.bazel |
                         tr -d '"')

mkdir -p "$out"
cxxflags=(-std=c++17 -g -O1 -fno-omit-frame-pointer
          -fsanitize=fuzzer,address,undefined
          -fno-sanitize-recover=undefined
          -I. -I"$bin")

# Sources every target links: the model parsers and the protos.
common_srcs=(model/native_spec.cc model/hf_config.cc model/model_util.cc
             model/json_describe.cc common/dtype.cc
             "$bin/proto/model.pb.cc")
# The coordinator's logic (no gRPC adapters, no mains).
coordinator_srcs=()
for f in server/*.cc server/jobs/*.cc planner/*.cc program/*.cc layout/*.cc \
         checkpoint/*.cc; do
  case "$f" in
    *_test.cc|*_main.cc|*/grpc_*|server/coordinator_server.cc) ;;
    *) coordinator_srcs+=("$f") ;;
  esac
done
coordinator_srcs+=(common/logging.cc "$bin/proto/plan.pb.cc"
                   "$bin/proto/coordinator.pb.cc" "$bin/proto/worker.pb.cc")
checkpoint_srcs=(checkpoint/checkpoint_index.cc
                 checkpoint/json_text.cc checkpoint/safetensors.cc
                 checkpoint/file_util.cc)

# build_and_run NAME "EXTRA SOURCES" "EXTRA LIBS" CORPUS_DIR...
build_and_run() {
  local name="$1" extra_srcs="$2" extra_libs="$3"; shift 3
  local corpus_dirs=("$@")
  local exe="$out/$name"
  echo "== building $name with $cxx"
  # shellcheck disable=SC2086  # word splitting of the source lists
  "$cxx" "${cxxflags[@]}" -o "$exe" \
    "tests/fuzz/$name.cc" "${common_srcs[@]}" $extra_srcs \
    -lprotobuf "${absl_libs[@]}" $extra_libs -lpthread
  local work="$out/corpus/$name"
  mkdir -p "$work" "$out/artifacts"
  echo "== fuzzing $name for ${seconds}s ($jobs job(s)); corpus $work"
  local args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048
              -max_len=65536 -print_final_stats=1
              -artifact_prefix="$out/artifacts/$name-")
  if [[ -f "tests/fuzz/${name%_fuzzer}.dict" ]]; then
    args+=(-dict="tests/fuzz/${name%_fuzzer}.dict")
  fi
  if [[ "$jobs" -gt 1 ]]; then
    args+=(-fork="$jobs")
  fi
  # The first directory receives new inputs; the committed seeds are read-only.
  "$exe" "${args[@]}" "$work" "${corpus_dirs[@]}"
}

status=0
build_and_run config_parser_fuzzer "" "" \
  tests/fuzz/corpus/config_parser tests/data || status=$?
build_and_run submit_model_fuzzer "${coordinator_srcs[*]}" "-lsqlite3 -lxxhash" \
  tests/fuzz/corpus/submit_model || status=$?
build_and_run checkpoint_index_fuzzer "${checkpoint_srcs[*]}" "-lxxhash" \
  tests/fuzz/corpus/checkpoint_index || status=$?
if [[ $status -ne 0 ]]; then
  echo "run_fuzzers.sh: FAILED (exit $status); artifacts in $out/artifacts" >&2
else
  echo "run_fuzzers.sh: no findings"
fi
exit $status
