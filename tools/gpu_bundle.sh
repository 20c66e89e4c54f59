#!/usr/bin/env bash
# Builds the CUDA binaries here (--config=cuda) and copies them, with the
# shared libraries they need that a GPU machine's image may lack, into
# gpu_bundle/ (git-ignored), for a GPU machine that has no Bazel:
#
#   gpu_bundle/bin/<package>/<target>   same layout as bazel-bin
#   gpu_bundle/lib/                     non-system, non-CUDA shared libraries
#   gpu_bundle.tar.xz                   both, compressed (what travels: the
#                                       device tool carries 64 MiB at most)
#
# Left out on purpose: glibc, libstdc++/libgcc_s (the target's are newer and
# backward compatible) and the CUDA libraries (driver, cudart, cuBLAS, NCCL:
# hundreds of MB; tools/gpu_check.sh finds the target's own copies).
set -euo pipefail
cd "$(dirname "$0")/.."

# Every gpu-tagged test, so a new one cannot be left out of the bundle.
mapfile -t gpu_tests < <(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null)
((${#gpu_tests[@]} > 0)) || { echo "no gpu-tagged tests found" >&2; exit 1; }
binaries=(
  //server:shardd-coordinator //worker:shardd-worker //client:shardctl
  //bench:grouped_experts_cuda_bench //bench:attention_cuda_bench
)
bazel build --config=cuda "${gpu_tests[@]}" "${binaries[@]}"

out=gpu_bundle
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for label in "${gpu_tests[@]}" "${binaries[@]}"; do
  path=${label#//}
  path=${path/://}
  mkdir -p "$out/bin/$(dirname "$path")"
  cp -L "bazel-bin/$path" "$out/bin/$path"
  # Resolved libraries (bazel's _solib_k8 ones included).
  ldd "bazel-bin/$path" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
    while read -r lib; do
      case "$(basename "$lib")" in
        libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | \
          ld-linux* | libstdc++.so* | libgcc_s.so* | libcuda.so* | \
          libcudart.so* | libcublas* | libnccl.so* | libnvidia*) continue ;;
      esac
      [[ -e "$out/lib/$(basename "$lib")" ]] || cp -L "$lib" "$out/lib/"
    done
done
# What the bundle must hold; tools/gpu_check.sh --dry-run checks it.
printf '%s\n' "${gpu_tests[@]}" "${binaries[@]}" >"$out/bin/MANIFEST"
chmod -R u+w "$out"
strip --strip-debug "$out"/bin/*/* "$out"/bin/*/*/* "$out"/lib/* 2>/dev/null || true
tar -C "$out" -cf - bin lib | xz -T2 -6 >"$out.tar.xz.tmp"
mv "$out.tar.xz.tmp" "$out/bundle.tar.xz"
du -sh "$out/bin" "$out/lib" "$out/bundle.tar.xz"
