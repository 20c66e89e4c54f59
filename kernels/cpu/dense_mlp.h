#ifndef SHARDD_KERNELS_CPU_DENSE_MLP_H_
#define SHARDD_KERNELS_CPU_DENSE_MLP_H_

// Dense gated MLP (the optional dense branch next to the MoE), fp32, with the
// HF (out, in) weight layout:
//
//   gate_proj [I, D], up_proj [I, D], down_proj [D, I]
//   G = x @ gate_proj^T            [T, I]   (cblas_sgemm)
//   U = x @ up_proj^T              [T, I]   (cblas_sgemm)
//   A = act(G) * U                 [T, I]
//   y = A @ down_proj^T            [T, D]   (cblas_sgemm)
//
// with act = silu (SwiGLU) or gelu with the tanh approximation (GeGLU), the
// same GatedActivation the grouped experts use.
//
// All arrays are dense and row-major. The GEMMs run through kernels::Sgemm
// (gemm.h, split over the compute pool); the elementwise loops are
// single-threaded.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/grouped_experts.h"  // GatedActivation

namespace shardd {
namespace kernels {

struct DenseMlpDims {
  int64_t tokens = 0;        // T >= 0
  int64_t dim = 0;           // D >= 1
  int64_t intermediate = 0;  // I >= 1
};

// Saved activations of one forward plus backward scratch. Owned by the
// caller: one per dense-MLP call whose backward is still pending (e.g. one
// per layer and pass), reused across steps. Buffers only grow, so a warm
// workspace makes no allocation. Not thread-safe.
struct DenseMlpWorkspace {
  DenseMlpDims dims;  // of the last forward
  GatedActivation activation = GatedActivation::kSwiGLU;
  bool has_forward = false;  // set by a successful forward

  // Saved by the forward.
  std::vector<float> x;       // [T, D] input copy (for dW_gate, dW_up)
  std::vector<float> gate;    // [T, I] G, pre-activation
  std::vector<float> up;      // [T, I] U
  std::vector<float> hidden;  // [T, I] A = act(G) * U (for dW_down)

  // Backward scratch: dA, then dU in place [T, I]; dG [T, I].
  std::vector<float> d_hidden;
  std::vector<float> d_gate;

  // Bytes held (capacity), for memory accounting.
  size_t bytes() const;
};

// Forward. x: [T, D]; gate_proj, up_proj: [I, D]; down_proj: [D, I];
// y: [T, D], overwritten, or added to when `accumulate_y` is true (the dense
// branch summed onto the MoE output). Saves what the backward needs in `ws`.
// Pointers may be null only when T == 0.
// Errors: INVALID_ARGUMENT for bad dims (T < 0, D or I < 1, sizes beyond
// cblas' int), an unknown activation, or a null pointer.
absl::Status DenseMlpForward(const DenseMlpDims& dims,
                             GatedActivation activation, const float* x,
                             const float* gate_proj, const float* up_proj,
                             const float* down_proj, float* y,
                             DenseMlpWorkspace* ws, bool accumulate_y = false);

// Backward of the last DenseMlpForward on `ws`, whose weights must be passed
// again unchanged. dy: [T, D].
//   dx [T, D]: ACTIVATION gradient, overwritten, or added to when
//     `accumulate_dx` is true (the MoE branch shares the normed input).
//   d_gate_proj, d_up_proj [I, D] and d_down_proj [D, I]: PARAMETER
//     gradients, ADDED to (they accumulate across passes and micro-batches).
// Any output may be null to skip it (frozen weights pass null dW). The
// workspace is not consumed: calling backward twice adds the parameter
// gradients twice.
// Errors: FAILED_PRECONDITION if `ws` holds no forward or `dims` /
// `activation` differ from the forward's; INVALID_ARGUMENT for a required
// null pointer.
absl::Status DenseMlpBackward(const DenseMlpDims& dims,
                              GatedActivation activation,
                              const float* gate_proj, const float* up_proj,
                              const float* down_proj, const float* dy,
                              float* dx, bool accumulate_dx, float* d_gate_proj,
                              float* d_up_proj, float* d_down_proj,
                              DenseMlpWorkspace* ws);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_DENSE_MLP_H_
