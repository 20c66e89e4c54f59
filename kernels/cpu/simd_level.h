#ifndef SHARDD_KERNELS_CPU_SIMD_LEVEL_H_
#define SHARDD_KERNELS_CPU_SIMD_LEVEL_H_

// The x86-64 instruction-set levels the CPU kernels' own vector loops are
// built for (GCC's micro-architecture levels), and which one runs. The
// kernels give the same bits at every level (no FMA contraction, per-lane
// arithmetic, fixed-lane reductions), so the level is a speed choice; the
// override exists to prove that on one machine (tools/test_portability.sh).
//
// The environment variable SHARDD_CPU_ISA picks a level for the process:
// "x86-64" (SSE2 baseline), "x86-64-v3" (AVX2, FMA) or "x86-64-v4"
// (AVX-512 F/BW/CD/DQ/VL). Unset or empty: the highest this CPU runs.

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

// Function attributes for a kernel body's per-level clones: the body is
// SHARDD_ALWAYS_INLINE and each wrapper carries a SHARDD_TARGET_*; the
// library builds with -ffp-contract=off so no level contracts into FMAs.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SHARDD_TARGET_X86_64_V3 __attribute__((target("arch=x86-64-v3")))
#define SHARDD_TARGET_X86_64_V4 __attribute__((target("arch=x86-64-v4")))
#else
#define SHARDD_TARGET_X86_64_V3
#define SHARDD_TARGET_X86_64_V4
#endif
#define SHARDD_ALWAYS_INLINE inline __attribute__((always_inline))

namespace shardd {
namespace kernels {

enum class SimdLevel { kBaseline = 0, kX86_64_V3 = 1, kX86_64_V4 = 2 };

inline constexpr char kSimdLevelEnv[] = "SHARDD_CPU_ISA";

// "x86-64", "x86-64-v3" or "x86-64-v4".
const char* SimdLevelName(SimdLevel level);

// Errors: INVALID_ARGUMENT naming the allowed names.
absl::StatusOr<SimdLevel> ParseSimdLevel(absl::string_view name);

// The highest level both this CPU and this build can run (builds other
// than GCC on x86-64 have only the baseline loops).
SimdLevel SupportedSimdLevel();

// The level a value of SHARDD_CPU_ISA asks for (null or empty: the
// supported one). Errors as ActiveSimdLevel's.
absl::StatusOr<SimdLevel> ResolveSimdLevel(const char* value);

// The level the kernels use: the override if one is set, else
// SHARDD_CPU_ISA, else SupportedSimdLevel(). The environment is read once.
// Errors: INVALID_ARGUMENT (SHARDD_CPU_ISA not a level name),
// FAILED_PRECONDITION (a level above SupportedSimdLevel()); both name the
// variable, and every kernel call that needs the level returns them.
absl::StatusOr<SimdLevel> ActiveSimdLevel();

// For tests and benchmarks: makes the kernels use `level` from now on,
// process-wide. Errors: FAILED_PRECONDITION for a level above
// SupportedSimdLevel() (nothing changes then).
absl::Status OverrideSimdLevel(SimdLevel level);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_SIMD_LEVEL_H_
