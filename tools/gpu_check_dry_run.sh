#!/usr/bin/env bash
# tools/gpu_check.sh --dry-run: everything about the GPU check that can be
# checked without a GPU, so that the few minutes a GPU is lent are not spent
# on a missing file. Checks gpu_bundle/bundle.tar.xz (tools/gpu_bundle.sh):
#   - present and at most 64 MiB (what the device tool carries);
#   - holds every label of its MANIFEST, and (where Bazel is here) every
#     gpu-tagged test of the tree, so a stale bundle is caught;
#   - its binaries are x86-64 executables whose libraries resolve from the
#     bundle's lib/ and this machine (CUDA's from /usr/local/cuda);
# and that the files the check's parts read exist (models, benchmark twins,
# deploy/local/run.sh; Python parses). Then lists what each part would run.
# Exit 0 when all holds, 1 otherwise (each problem named).
set -uo pipefail
cd "$(dirname "$0")/.."

source tools/gpu_check_plan.sh
bundle=gpu_bundle/bundle.tar.xz
limit=$((64 * 1024 * 1024))
problems=()
problem() { problems+=("$1"); echo "PROBLEM: $1"; }

if [[ ! -f "$bundle" ]]; then
  echo "PROBLEM: $bundle is missing; build it with tools/gpu_bundle.sh"
  exit 1
fi
size=$(stat -c %s "$bundle")
echo "bundle: $bundle, $((size / 1024 / 1024)) MiB ($size bytes; limit $limit)"
((size <= limit)) || problem "bundle is $size bytes, over the device tool's 64 MiB"

root=$(mktemp -d /tmp/gpu-dry-run.XXXXXX)
trap 'rm -rf "$root"' EXIT
tar -C "$root" -xJf "$bundle" || { problem "bundle does not unpack"; }
manifest="$root/bin/MANIFEST"
labels=()
if [[ -f "$manifest" ]]; then
  mapfile -t labels <"$manifest"
else
  problem "bundle has no bin/MANIFEST (built by an older tools/gpu_bundle.sh)"
fi
path_of() { local p=${1#//}; echo "${p/://}"; }
for label in "${labels[@]}"; do
  [[ -f "$root/bin/$(path_of "$label")" ]] || problem "bundle lacks $label"
done
if command -v bazel >/dev/null; then
  mapfile -t tagged < <(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null)
  ((${#tagged[@]} > 0)) || problem "bazel query found no gpu-tagged tests"
  for label in "${tagged[@]}"; do
    [[ " ${labels[*]} " == *" $label "* ]] ||
      problem "gpu-tagged $label is not in the bundle (stale: rerun tools/gpu_bundle.sh)"
  done
fi

# Libraries: the bundle's own first, then this machine's CUDA.
ld_path="$root/lib"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d "$d" ]] && ld_path+=":$d"
done
bins=0
while IFS= read -r b; do
  bins=$((bins + 1))
  readelf -h "$b" 2>/dev/null | grep -q 'Machine:.*X86-64' ||
    problem "${b#"$root/bin/"} is not an x86-64 executable"
  missing=$(LD_LIBRARY_PATH="$ld_path" ldd "$b" 2>&1 | grep 'not found' |
    grep -v -E 'libcuda\.so|libnvidia' || true)
  [[ -z "$missing" ]] || problem "${b#"$root/bin/"}: $(echo $missing)"
done < <(find "$root/bin" -type f ! -name MANIFEST | sort)
echo "binaries: $bins (gpu-tagged tests: $(grep -c _test "$manifest" 2>/dev/null || echo 0))"

train_files=()
for m in $gc_models; do train_files+=("tests/data/${m%%:*}.json"); done
for f in "${train_files[@]}" "$gc_fsdp2_model" bench/torch_grouped_mm.py \
  bench/torch_sdpa.py bench/gpu_vs_fsdp2.sh deploy/local/run.sh \
  tools/gpu_check_plan.sh; do
  [[ -f "$f" ]] || problem "$f is missing"
done
for py in bench/torch_grouped_mm.py bench/torch_sdpa.py; do
  [[ -f "$py" ]] && ! python3 -c "import ast, sys; ast.parse(open(sys.argv[1]).read())" "$py" &&
    problem "$py does not parse"
done
bash -n bench/gpu_vs_fsdp2.sh deploy/local/run.sh tools/gpu_check.sh ||
  problem "a shell script of the check does not parse"

shapes=()
for s in "${gc_fsdp2_shapes[@]}"; do shapes+=("${s/ /x}"); done
echo "===== would run (tools/gpu_check.sh, default: ${gc_parts[*]})"
echo "tests:    each gpu-tagged test binary, $gc_test_timeout s timeout each:"
grep _test "$manifest" 2>/dev/null | sed 's/^/            /'
echo "diag:     device_moe_model_hf_test --gtest_filter=*MarginSweep* ($gc_diag_timeout s)"
echo "train:    deploy/local/run.sh, $gc_steps steps of $gc_models on cuda:0 and on the CPU ($gc_train_timeout s each)"
echo "bench:    grouped_experts_cuda_bench and bench/torch_grouped_mm.py at $gc_tokens tokens ($gc_bench_timeout s each)"
echo "attn:     attention_cuda_bench and bench/torch_sdpa.py ($gc_bench_timeout s each)"
echo "fsdp2:    bench/gpu_vs_fsdp2.sh $gc_fsdp2_model ${shapes[*]} ($gc_bench_timeout s each)"
echo "sanitize: compute-sanitizer memcheck over the kernel tests ($gc_sanitize_timeout s, in parallel)"
if ((${#problems[@]} > 0)); then
  echo "gpu_check dry run: ${#problems[@]} problem(s)"
  exit 1
fi
echo "gpu_check dry run: OK"
