#include "kernels/cuda/op_checks.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/dtype.h"

namespace shardd {
namespace kernels {
namespace cuda {

absl::Status CheckNotNull(const void* pointer, absl::string_view name,
                          absl::string_view op) {
  if (pointer != nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is null"));
}

absl::Status CheckInRange(int64_t value, int64_t lo, int64_t hi,
                          absl::string_view name, absl::string_view op) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      op, ": ", name, " must be in [", lo, ", ", hi, "], got ", value));
}

absl::Status CheckWorkspace(const void* workspace, size_t workspace_bytes,
                            size_t required, absl::string_view op) {
  if (required == 0) return absl::OkStatus();
  if (workspace == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": workspace is null; ", required, " bytes are needed"));
  }
  if (reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": workspace must be aligned to ", kWorkspaceAlignment, " bytes"));
  }
  if (workspace_bytes < required) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": workspace_bytes is ", workspace_bytes, ", need ", required));
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
