#include "kernels/cpu/rms_norm.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/rms_norm_element.h"

namespace shardd {
namespace kernels {
namespace {

absl::Status ValidateShape(int64_t rows, int64_t dim) {
  if (rows < 0 || dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("rms_norm: need rows >= 0 and dim >= 1, got rows=", rows,
                     " dim=", dim));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RmsNormForward(const float* x, const float* weight, int64_t rows,
                            int64_t dim, float eps, float* y, float* inv_rms) {
  SHARDD_RETURN_IF_ERROR(ValidateShape(rows, dim));
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rms_norm: eps must be finite and >= 0, got ", eps));
  }
  if (rows > 0 && (x == nullptr || weight == nullptr || y == nullptr ||
                   inv_rms == nullptr)) {
    return absl::InvalidArgumentError(
        "rms_norm: x, weight, y and inv_rms must be non-null");
  }
  ParallelFor(rows, RowGrain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      double sum_sq = 0.0;
      for (int64_t d = 0; d < dim; ++d) sum_sq += double{xr[d]} * xr[d];
      const float inv = RmsNormInverse(sum_sq, dim, eps);
      inv_rms[r] = inv;
      // (x * inv_rms) * weight, in that order, as the HF reference computes
      // it.
      for (int64_t d = 0; d < dim; ++d) yr[d] = RmsNormOut(xr[d], inv, weight[d]);
    }
  });
  return absl::OkStatus();
}

absl::Status RmsNormBackward(const float* dy, const float* x,
                             const float* weight, const float* inv_rms,
                             int64_t rows, int64_t dim, float* dx,
                             float* dweight, bool accumulate_dx) {
  SHARDD_RETURN_IF_ERROR(ValidateShape(rows, dim));
  if (rows > 0 && (dy == nullptr || x == nullptr || weight == nullptr ||
                   inv_rms == nullptr || dx == nullptr || dweight == nullptr)) {
    return absl::InvalidArgumentError(
        "rms_norm: dy, x, weight, inv_rms, dx and dweight must be non-null");
  }
  // Sum this call's contribution in double first and add it once, so the
  // result does not depend on what dweight already holds.
  // dweight sums over rows: one partial per chunk of rows, added in chunk
  // order, so the bits do not depend on the thread count.
  const int64_t grain = RowGrain(dim);
  const int64_t chunks = (rows + grain - 1) / grain;
  std::vector<double> dw_partial(chunks * dim, 0.0);
  ParallelFor(rows, grain, [&](int64_t begin, int64_t end) {
    double* dw_sum = dw_partial.data() + (begin / grain) * dim;
    for (int64_t r = begin; r < end; ++r) {
      const float* dyr = dy + r * dim;
      const float* xr = x + r * dim;
      float* dxr = dx + r * dim;
      const float inv = inv_rms[r];
      double dot = 0.0;  // sum_k g_k * xhat_k
      for (int64_t d = 0; d < dim; ++d) {
        const float xhat = RmsNormHat(xr[d], inv);
        dot += double{dyr[d]} * weight[d] * xhat;
        dw_sum[d] += double{dyr[d]} * xhat;
      }
      const float mean_dot = RmsNormMeanDot(dot, dim);
      for (int64_t d = 0; d < dim; ++d) {
        const float grad =
            RmsNormInputGrad(dyr[d], xr[d], weight[d], inv, mean_dot);
        dxr[d] = accumulate_dx ? dxr[d] + grad : grad;
      }
    }
  });
  for (int64_t d = 0; d < dim; ++d) {
    double sum = 0.0;
    for (int64_t c = 0; c < chunks; ++c) sum += dw_partial[c * dim + d];
    dweight[d] += static_cast<float>(sum);
  }
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
