#include "kernels/cuda/rope.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/op_checks.h"
#include "kernels/cuda/rope_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

template <typename T>
absl::Status Rotate(const DeviceRopeTable& table, RopeLayout layout,
                    const RopeShape& shape, const int32_t* positions, T* x,
                    bool inverse, cudaStream_t stream) {
  constexpr const char* kOp = "cuda RopeRotate";
  if (shape.tokens < 0 || shape.heads < 1 || shape.token_stride < 0 ||
      shape.head_stride < 0 || shape.dim_offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": need tokens >= 0, heads >= 1 and non-negative strides"));
  }
  if (table.rotary_dim < 2 || table.rotary_dim % 2 != 0 ||
      table.positions < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp,
        ": table.rotary_dim must be even and >= 2 and positions >= 1, "
        "got ",
        table.rotary_dim, " and ", table.positions));
  }
  if (shape.tokens == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(table.cos, "table.cos", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(table.sin, "table.sin", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(positions, "positions", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  RopeLaunch r;
  r.cos = table.cos;
  r.sin = table.sin;
  r.half = table.rotary_dim / 2;
  r.positions = table.positions;
  r.interleaved = layout == RopeLayout::kInterleaved;
  r.tokens = shape.tokens;
  r.heads = shape.heads;
  r.token_stride = shape.token_stride;
  r.head_stride = shape.head_stride;
  r.dim_offset = shape.dim_offset;
  r.sign = inverse ? -1.0f : 1.0f;
  SHARDD_CUDA_RETURN_IF_ERROR(LaunchRope(r, positions, x, stream), kOp);
  return absl::OkStatus();
}

}  // namespace

absl::Status RopeRotate(const DeviceRopeTable& table, RopeLayout layout,
                        const RopeShape& shape, const int32_t* positions,
                        float* x, bool inverse, cudaStream_t stream) {
  return Rotate(table, layout, shape, positions, x, inverse, stream);
}

absl::Status RopeRotate(const DeviceRopeTable& table, RopeLayout layout,
                        const RopeShape& shape, const int32_t* positions,
                        uint16_t* x, bool inverse, cudaStream_t stream) {
  return Rotate(table, layout, shape, positions, x, inverse, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
