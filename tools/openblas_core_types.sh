#!/usr/bin/env bash
# Prints the OpenBLAS x86-64 kernels (OPENBLAS_CORETYPE values) that the
# installed OpenBLAS has and this CPU can execute, one per line, oldest
# first. OpenBLAS takes any name it knows, even one whose instructions the
# CPU lacks (it then dies of SIGILL), so the CPU's flags decide.
#
#   tools/openblas_core_types.sh [--why]
#
# --why: also says on stderr which kernels were left out and why.
# Used by tools/test_portability.sh and //tests:openblas_core_types_test.
set -euo pipefail

why=0
[[ "${1:-}" == "--why" ]] && why=1

lib=""
for candidate in \
  "$(ldconfig -p 2>/dev/null | sed -n 's/.*libopenblas\.so\.0 .*=> //p' | head -1)" \
  /usr/lib/x86_64-linux-gnu/libopenblas.so.0; do
  if [[ -n "$candidate" && -e "$candidate" ]]; then
    lib=$(readlink -f "$candidate")
    break
  fi
done
if [[ -z "$lib" ]]; then
  echo "openblas_core_types: no libopenblas.so.0 found (tools/setup.sh installs it)" >&2
  exit 1
fi

flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() {
  local f
  for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done
}

avx512=(avx512f avx512bw avx512cd avx512dq avx512vl)
# Each kernel and the CPU flags its code needs (OpenBLAS' own detection in
# driver/others/dynamic.c asks for the same).
kernels=(
  "Prescott|pni"
  "Nehalem|ssse3 sse4_1 sse4_2 popcnt"
  "Sandybridge|avx"
  "Haswell|avx avx2 fma"
  "Zen|avx avx2 fma"
  "SkylakeX|${avx512[*]}"
  "Cooperlake|${avx512[*]} avx512_bf16"
  "SapphireRapids|${avx512[*]} avx512_bf16 avx512_fp16 amx_bf16 amx_tile"
)
for entry in "${kernels[@]}"; do
  name=${entry%%|*}
  # shellcheck disable=SC2206
  needs=(${entry#*|})
  if ! grep -aq "sgemm_kernel_${name^^}" "$lib"; then
    ((why)) && echo "openblas_core_types: $name: not built into $lib" >&2
    continue
  fi
  if ! has "${needs[@]}"; then
    ((why)) && echo "openblas_core_types: $name: this CPU lacks some of: ${needs[*]}" >&2
    continue
  fi
  echo "$name"
done
