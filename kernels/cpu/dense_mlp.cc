#include "kernels/cpu/dense_mlp.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/gate_element.h"
#include "kernels/cpu/gemm.h"

namespace shardd {
namespace kernels {
namespace {

constexpr int64_t kMaxBlasInt = std::numeric_limits<int>::max();

// Calls fn(gate) with the gate object of `activation` (gate_element.h); the
// dense MLP is the grouped experts' activation with routing weight 1, which
// gives the same bits as leaving the weight out.
template <typename Fn>
void WithGate(GatedActivation activation, Fn&& fn) {
  if (activation == GatedActivation::kSwiGLU) {
    fn(ProductGate<SiluGate>{});
  } else {
    fn(ProductGate<GeluTanhGate>{});
  }
}

absl::Status ValidateDims(const DenseMlpDims& dims,
                          GatedActivation activation) {
  if (dims.tokens < 0 || dims.dim < 1 || dims.intermediate < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dense_mlp: need tokens >= 0, dim >= 1, intermediate >= 1; got "
        "tokens=",
        dims.tokens, " dim=", dims.dim, " intermediate=", dims.intermediate));
  }
  if (dims.tokens > kMaxBlasInt || dims.dim > kMaxBlasInt ||
      dims.intermediate > kMaxBlasInt) {
    return absl::InvalidArgumentError(
        "dense_mlp: tokens, dim and intermediate must fit a cblas int");
  }
  if (activation != GatedActivation::kSwiGLU &&
      activation != GatedActivation::kGeGLU) {
    return absl::InvalidArgumentError(
        "dense_mlp: activation must be kSwiGLU or kGeGLU");
  }
  return absl::OkStatus();
}

template <typename T>
void Grow(std::vector<T>* v, int64_t n) {
  if (static_cast<int64_t>(v->size()) < n) v->resize(n);
}

}  // namespace

size_t DenseMlpWorkspace::bytes() const {
  return sizeof(float) *
         (x.capacity() + gate.capacity() + up.capacity() + hidden.capacity() +
          d_hidden.capacity() + d_gate.capacity());
}

absl::Status DenseMlpForward(const DenseMlpDims& dims,
                             GatedActivation activation, const float* x,
                             const float* gate_proj, const float* up_proj,
                             const float* down_proj, float* y,
                             DenseMlpWorkspace* ws, bool accumulate_y) {
  SHARDD_RETURN_IF_ERROR(ValidateDims(dims, activation));
  if (ws == nullptr) {
    return absl::InvalidArgumentError("dense_mlp: workspace is null");
  }
  const int64_t t = dims.tokens, d = dims.dim, in = dims.intermediate;
  if (t > 0 && (x == nullptr || gate_proj == nullptr || up_proj == nullptr ||
                down_proj == nullptr || y == nullptr)) {
    return absl::InvalidArgumentError(
        "dense_mlp: x, gate_proj, up_proj, down_proj and y must be non-null");
  }
  ws->has_forward = false;
  Grow(&ws->x, t * d);
  Grow(&ws->gate, t * in);
  Grow(&ws->up, t * in);
  Grow(&ws->hidden, t * in);
  if (t > 0) {
    std::copy(x, x + t * d, ws->x.data());
    const int T = static_cast<int>(t), D = static_cast<int>(d),
              I = static_cast<int>(in);
    float* g = ws->gate.data();
    float* u = ws->up.data();
    float* a = ws->hidden.data();
    Sgemm(CblasNoTrans, CblasTrans, T, I, D, 1.0f, x, D,
                gate_proj, D, 0.0f, g, I);
    Sgemm(CblasNoTrans, CblasTrans, T, I, D, 1.0f, x, D,
                up_proj, D, 0.0f, u, I);
    WithGate(activation, [&](const auto& gate) {
      for (int64_t i = 0; i < t * in; ++i) a[i] = gate.Forward(g[i], u[i], 1.0f);
    });
    Sgemm(CblasNoTrans, CblasTrans, T, D, I, 1.0f, a, I,
                down_proj, I, accumulate_y ? 1.0f : 0.0f, y, D);
  }
  ws->dims = dims;
  ws->activation = activation;
  ws->has_forward = true;
  return absl::OkStatus();
}

absl::Status DenseMlpBackward(const DenseMlpDims& dims,
                              GatedActivation activation,
                              const float* gate_proj, const float* up_proj,
                              const float* down_proj, const float* dy,
                              float* dx, bool accumulate_dx, float* d_gate_proj,
                              float* d_up_proj, float* d_down_proj,
                              DenseMlpWorkspace* ws) {
  SHARDD_RETURN_IF_ERROR(ValidateDims(dims, activation));
  if (ws == nullptr || !ws->has_forward) {
    return absl::FailedPreconditionError(
        "dense_mlp: backward without a forward on this workspace");
  }
  if (ws->dims.tokens != dims.tokens || ws->dims.dim != dims.dim ||
      ws->dims.intermediate != dims.intermediate ||
      ws->activation != activation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "dense_mlp: backward dims/activation differ from the forward's "
        "(forward tokens=",
        ws->dims.tokens, " dim=", ws->dims.dim,
        " intermediate=", ws->dims.intermediate, ")"));
  }
  const int64_t t = dims.tokens, d = dims.dim, in = dims.intermediate;
  if (t == 0) return absl::OkStatus();
  const bool need_dh =
      dx != nullptr || d_gate_proj != nullptr || d_up_proj != nullptr;
  if (dy == nullptr || (need_dh && down_proj == nullptr) ||
      (dx != nullptr && (gate_proj == nullptr || up_proj == nullptr))) {
    return absl::InvalidArgumentError(
        "dense_mlp: dy, and the weights the requested gradients need, must "
        "be non-null");
  }
  const int T = static_cast<int>(t), D = static_cast<int>(d),
            I = static_cast<int>(in);
  const float* x = ws->x.data();
  const float* g = ws->gate.data();
  const float* u = ws->up.data();
  const float* a = ws->hidden.data();

  // dW_down += dy^T @ A   [D, I]
  if (d_down_proj != nullptr) {
    Sgemm(CblasTrans, CblasNoTrans, D, I, T, 1.0f, dy, D,
                a, I, 1.0f, d_down_proj, I);
  }
  if (!need_dh) return absl::OkStatus();

  Grow(&ws->d_hidden, t * in);
  Grow(&ws->d_gate, t * in);
  float* du = ws->d_hidden.data();  // dA first, dU in place after
  float* dg = ws->d_gate.data();
  // dA = dy @ down_proj   [T, I]
  Sgemm(CblasNoTrans, CblasNoTrans, T, I, D, 1.0f, dy, D,
              down_proj, I, 0.0f, du, I);
  WithGate(activation, [&](const auto& gate) {
    for (int64_t i = 0; i < t * in; ++i) {
      float w_term;  // no routing weight here
      gate.Backward(g[i], u[i], du[i], 1.0f, &w_term, &dg[i], &du[i]);
    }
  });
  // dW_gate += dG^T @ x, dW_up += dU^T @ x   [I, D]
  if (d_gate_proj != nullptr) {
    Sgemm(CblasTrans, CblasNoTrans, I, D, T, 1.0f, dg, I,
                x, D, 1.0f, d_gate_proj, D);
  }
  if (d_up_proj != nullptr) {
    Sgemm(CblasTrans, CblasNoTrans, I, D, T, 1.0f, du, I,
                x, D, 1.0f, d_up_proj, D);
  }
  // dx = dG @ gate_proj + dU @ up_proj   [T, D]
  if (dx != nullptr) {
    Sgemm(CblasNoTrans, CblasNoTrans, T, D, I, 1.0f, dg, I,
                gate_proj, D, accumulate_dx ? 1.0f : 0.0f, dx, D);
    Sgemm(CblasNoTrans, CblasNoTrans, T, D, I, 1.0f, du, I,
                up_proj, D, 1.0f, dx, D);
  }
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
