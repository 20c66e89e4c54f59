#include "kernels/cpu/simd_level.h"

#include <atomic>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardd {
namespace kernels {
namespace {

// -1: no override.
std::atomic<int> override_level{-1};

absl::StatusOr<SimdLevel> CheckSupported(SimdLevel level,
                                         absl::string_view source) {
  const SimdLevel supported = SupportedSimdLevel();
  if (static_cast<int>(level) > static_cast<int>(supported)) {
    return absl::FailedPreconditionError(
        absl::StrCat(source, SimdLevelName(level),
                     " is not available: this CPU and build run up to ",
                     SimdLevelName(supported)));
  }
  return level;
}

}  // namespace

const char* SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kX86_64_V3:
      return "x86-64-v3";
    case SimdLevel::kX86_64_V4:
      return "x86-64-v4";
    case SimdLevel::kBaseline:
      break;
  }
  return "x86-64";
}

absl::StatusOr<SimdLevel> ParseSimdLevel(absl::string_view name) {
  for (SimdLevel level :
       {SimdLevel::kBaseline, SimdLevel::kX86_64_V3, SimdLevel::kX86_64_V4}) {
    if (name == SimdLevelName(level)) return level;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("CPU level must be one of x86-64, x86-64-v3, x86-64-v4 "
                   "(or unset for the best this CPU runs), got '",
                   name, "'"));
}

SimdLevel SupportedSimdLevel() {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return SimdLevel::kX86_64_V4;
  if (__builtin_cpu_supports("x86-64-v3")) return SimdLevel::kX86_64_V3;
#endif
  return SimdLevel::kBaseline;
}

absl::StatusOr<SimdLevel> ResolveSimdLevel(const char* value) {
  if (value == nullptr || *value == '\0') return SupportedSimdLevel();
  absl::StatusOr<SimdLevel> level = ParseSimdLevel(value);
  if (!level.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kSimdLevelEnv, ": ", level.status().message()));
  }
  return CheckSupported(*level, absl::StrCat(kSimdLevelEnv, "="));
}

absl::StatusOr<SimdLevel> ActiveSimdLevel() {
  const int forced = override_level.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<SimdLevel>(forced);
  static const absl::StatusOr<SimdLevel>* const from_env =
      new absl::StatusOr<SimdLevel>(
          ResolveSimdLevel(std::getenv(kSimdLevelEnv)));
  return *from_env;
}

absl::Status OverrideSimdLevel(SimdLevel level) {
  absl::StatusOr<SimdLevel> checked = CheckSupported(level, "level ");
  if (!checked.ok()) return checked.status();
  override_level.store(static_cast<int>(level), std::memory_order_relaxed);
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
