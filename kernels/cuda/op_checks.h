#ifndef SHARDD_KERNELS_CUDA_OP_CHECKS_H_
#define SHARDD_KERNELS_CUDA_OP_CHECKS_H_

// Host-side argument checks shared by the CUDA ops. They never touch the
// device, so bad arguments fail before anything is launched.

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace shardd {
namespace kernels {
namespace cuda {

// INVALID_ARGUMENT "<op>: <name> is null" when `pointer` is null.
absl::Status CheckNotNull(const void* pointer, absl::string_view name,
                          absl::string_view op);

// INVALID_ARGUMENT naming `name` unless lo <= value <= hi.
absl::Status CheckInRange(int64_t value, int64_t lo, int64_t hi,
                          absl::string_view name, absl::string_view op);

// INVALID_ARGUMENT unless `workspace` is non-null (when required > 0),
// aligned to kWorkspaceAlignment and at least `required` bytes.
absl::Status CheckWorkspace(const void* workspace, size_t workspace_bytes,
                            size_t required, absl::string_view op);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_OP_CHECKS_H_
