#include "kernels/cpu/linear.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/bias_element.h"
#include "kernels/cpu/gemm.h"

namespace shardd {
namespace kernels {
namespace {

absl::Status Check(int64_t tokens, int64_t in, int64_t out) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (tokens < 0 || in < 1 || out < 1 || tokens > kMax || in > kMax ||
      out > kMax) {
    return absl::InvalidArgumentError(absl::StrCat(
        "linear: need tokens >= 0 and in, out in [1, 2^31), got tokens ",
        tokens, ", in ", in, ", out ", out));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LinearForward(const float* x, const float* w, int64_t tokens,
                           int64_t in, int64_t out, float* y, bool accumulate) {
  if (absl::Status s = Check(tokens, in, out); !s.ok()) return s;
  if (tokens == 0) return absl::OkStatus();
  if (x == nullptr || w == nullptr || y == nullptr) {
    return absl::InvalidArgumentError("linear: x, w and y must not be null");
  }
  Sgemm(CblasNoTrans, CblasTrans, tokens, out, in, 1.0f, x,
              in, w, in, accumulate ? 1.0f : 0.0f, y, out);
  return absl::OkStatus();
}

absl::Status LinearBackward(const float* x, const float* w, const float* dy,
                            int64_t tokens, int64_t in, int64_t out, float* dx,
                            bool accumulate_dx, float* dw) {
  if (absl::Status s = Check(tokens, in, out); !s.ok()) return s;
  if (tokens == 0) return absl::OkStatus();
  if (dy == nullptr || (dx != nullptr && w == nullptr) ||
      (dw != nullptr && x == nullptr)) {
    return absl::InvalidArgumentError(
        "linear backward: dy, and w for dx / x for dw, must not be null");
  }
  if (dx != nullptr) {
    Sgemm(CblasNoTrans, CblasNoTrans, tokens, in, out,
                1.0f, dy, out, w, in, accumulate_dx ? 1.0f : 0.0f, dx, in);
  }
  if (dw != nullptr) {
    Sgemm(CblasTrans, CblasNoTrans, out, in, tokens, 1.0f,
                dy, out, x, in, 1.0f, dw, in);
  }
  return absl::OkStatus();
}

void AddBias(const float* b, int64_t tokens, int64_t out, float* y) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      y[t * out + o] = AddBiasValue(y[t * out + o], b[o]);
    }
  }
}

void BiasBackward(const float* dy, int64_t tokens, int64_t out, float* db) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < out; ++o) db[o] += dy[t * out + o];
  }
}

}  // namespace kernels
}  // namespace shardd
