#ifndef SHARDD_KERNELS_CPU_MUON_H_
#define SHARDD_KERNELS_CPU_MUON_H_

// The pieces of Muon (Keller Jordan's "MomentUm Orthogonalized by Newton-
// Schulz", as published in his reference implementation) on fp32 host
// buffers: the element-wise SGD momentum with Nesterov's look-ahead, the
// quintic Newton-Schulz iteration that maps a matrix to (approximately) the
// nearest semi-orthogonal one, and the shape scale of the update. The
// optimizer that applies them to FSDP shards is worker/exec/muon_optimizer.h.

#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {

struct MuonConfig {
  double lr = 0.02;        // > 0 (the peak; a schedule scales it)
  double momentum = 0.95;  // beta, in [0, 1)
  int ns_steps = 5;        // Newton-Schulz iterations, in [1, 100]
};

// The quintic's coefficients (a, b, c) of the published implementation,
// tuned so the iteration pushes singular values into about [0.7, 1.2] fast
// instead of converging to exactly 1.
inline constexpr float kNewtonSchulzA = 3.4445f;
inline constexpr float kNewtonSchulzB = -4.7750f;
inline constexpr float kNewtonSchulzC = 2.0315f;
// Added to the Frobenius norm before normalising (the published 1e-7).
inline constexpr float kNewtonSchulzEps = 1e-7f;

// The momentum buffer after one step, element-wise in fp32:
//   m[i] = beta * m[i] + (1 - beta) * g[i].
// (torch's momentum.lerp_(grad, 1 - beta) up to its rounding.)
void MuonMomentumStep(const float* grad, float* momentum, int64_t n,
                      float beta);

// The Nesterov update of that step, without touching the momentum:
//   out[i] = (1 - beta) * g[i] + beta * m_new[i]
// with m_new[i] computed exactly as MuonMomentumStep would, so the update
// can be prepared before the step commits and the momentum written later
// with the same bits. `out` may not alias the inputs.
void MuonNesterovUpdate(const float* grad, const float* momentum, int64_t n,
                        float beta, float* out);

// Replaces the rows x cols row-major matrix `x` by its Newton-Schulz
// orthogonalisation, in fp32 with OpenBLAS sgemm:
//   X = x (transposed when rows > cols, so X X^T is the smaller Gram matrix)
//   X = X / (||X||_F + 1e-7)           (the norm summed in double)
//   `steps` times: A = X X^T;  B = b A + c A A;  X = a X + B X
//   transposed back.
// `workspace` holds at least NewtonSchulzWorkspace(rows, cols) floats. The
// GEMM calls depend only on (rows, cols, steps), so equal inputs give equal
// bits whatever computed them.
// Errors: INVALID_ARGUMENT for rows or cols < 1 or beyond a cblas int, steps
// outside [1, 100], null pointers. Nothing is written on error.
absl::Status NewtonSchulz(float* x, int64_t rows, int64_t cols, int steps,
                          float* workspace);
int64_t NewtonSchulzWorkspace(int64_t rows, int64_t cols);

// The update's scale sqrt(max(1, fan_out / fan_in)) for a weight that maps
// fan_in inputs to fan_out outputs (rows / cols of a torch Linear weight).
double MuonShapeScale(int64_t fan_out, int64_t fan_in);

// p[i] = p[i] * (1 - lr * wd) - lr * update[i] in fp32 (the update already
// multiplied by MuonShapeScale), as the published p.mul_(1 - lr * wd);
// p.add_(update, alpha=-lr); the two factors are computed in double and
// rounded to fp32 once.
void MuonApply(float* param, const float* update, int64_t n, double lr,
               double weight_decay);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_MUON_H_
