#ifndef SHARDD_TESTING_NUMERICS_H_
#define SHARDD_TESTING_NUMERICS_H_

// Tolerances for comparing two fp32 training runs that compute the same
// mathematics in different orders: another world size or strategy (each
// rank's GEMMs sum over its own tokens, the reduce-scatter adds the ranks'
// partial sums), another OpenBLAS kernel (blocking picked from the shapes
// and the CPU), another thread count. The bounds follow from the arithmetic;
// docs/testing.md derives them and records what they were measured at and
// which bugs they catch. No test here tunes a tolerance to a machine.

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "proto/model.pb.h"

namespace shardd {
namespace testing_util {

// fp32's unit roundoff.
inline constexpr double kFp32UnitRoundoff = 0x1p-24;

// Higham's gamma_n = n u / (1 - n u): any order of an n-term fp32 sum is
// within gamma(n) * sum |x_i| of the exact sum (Accuracy and Stability of
// Numerical Algorithms, 2nd ed., Lemma 3.1 and Section 4.2); a chain of
// operations adds its lengths to first order.
double Gamma(double n);

struct StepTolerances {
  double loss = 0.0;  // Relative, on a step's mean loss.
  double grad = 0.0;  // Normwise relative, on any tensor's gradient.
};

// For one step of the native MoE (moe_model.h) with `dims`, over `tokens`
// tokens in all (ranks, micro-batches and gradient passes together) on
// `world` ranks:
//  - n_fwd, the forward pass's longest chain of reductions, taken as the
//    sum of every branch of a layer (RMSNorm D, router D, softmax E, experts
//    D then I then the top-k combine, dense MLP D then M, two residual adds)
//    plus the head (RMSNorm D, logits D, log-sum-exp V), plus, with the
//    load-balancing loss, E + world + 2 (its probability sums rounded to
//    fp32, all-reduced over the ranks, and its E-term value);
//  - n_bwd: backward runs each forward reduction over the transposed
//    dimension (the same lengths), then the weight gradients sum over the
//    tokens and the reduce-scatter over the ranks, and divides once.
// loss = 2 gamma(n_fwd): the loss is a mean of positive terms, so the bound
// relative to sum |x| is relative to the loss; 2 because both runs round.
// grad = 2 gamma(n_fwd + n_bwd) sqrt(tokens): a weight gradient is a sum of
// per-token terms of both signs, and for T terms of independent signs
// sum |x| is about sqrt(T) |sum x| in the 2-norm over a tensor.
StepTolerances MoeStepTolerances(const v1::ModelDims& dims, int64_t tokens,
                                 int world);

using ParamMap = std::map<std::string, std::vector<float>>;

// Parameters and AdamW moments by name (unsharded), after some step.
struct TrainingState {
  const ParamMap* params = nullptr;
  const ParamMap* exp_avg = nullptr;
  const ParamMap* exp_avg_sq = nullptr;
};

// The same, owning its maps.
struct TrainingStateMaps {
  ParamMap params, exp_avg, exp_avg_sq;
  TrainingState view() const { return {&params, &exp_avg, &exp_avg_sq}; }
};

// Expects |got - want| <= rel_tol |want| and returns the share of that
// bound used.
double ExpectRelativelyNear(double got, double want, double rel_tol);

// The largest share of its bound each check used (1 = at the bound).
struct BoundUse {
  double loss = 0.0, grad_norm = 0.0, exp_avg = 0.0, exp_avg_sq = 0.0,
         params = 0.0;
  void Merge(const BoundUse& other);
  std::string ToString() const;
};

// Expects that `got`, a run that took optimizer step `step` (0-based) from
// `before` (the reference's state), ended where the reference did (`want`)
// within fp32 rounding. For each tensor not in `frozen`:
//  - the clipped gradient g, seen through m = beta1 m_prev + (1 - beta1) g,
//    normwise within 2 tol.grad (the gradient's own error, plus the clip
//    coefficient's, which comes from the global norm: tol.grad relative);
//  - v = beta2 v_prev + (1 - beta2) g^2 within what that does to g^2;
//  - every parameter within AdamW's first-order sensitivity to those
//    errors at that element (lr (dm_hat / den' + |update| ds / den'),
//    den = sqrt(v_hat) + eps, ds the error of sqrt(v_hat)), plus the
//    roundings of the update itself. Where v_hat is tiny next to the
//    gradient error the bound is loose because AdamW really amplifies the
//    rounding there; elsewhere it is tight.
// Tensors in `frozen` must be bitwise unchanged with zero moments.
// `use` (may be null) collects the share of each bound used.
void ExpectStepWithinRounding(const std::set<std::string>& frozen,
                              const kernels::AdamWConfig& adamw, int step,
                              const StepTolerances& tol,
                              const TrainingState& before,
                              const TrainingState& want,
                              const TrainingState& got, BoundUse* use);

// Loss comparisons between free-running runs (no shared state after step
// 0): the absolute tolerance on the loss computed after `updates` optimizer
// steps. From the same start the first loss differs by tol.loss * loss.
// Each update s then lets the rounding of its gradient (normwise
// dg = 2 tol.grad * ||g_s||, with ||g_s|| <= `clipped_norm`) move the
// parameters, and to first order in lr the loss moves by
//   sum_i (dL/dp_i) dp_i,   |dp_i| <= lr |d update_i / d g_i| |dg_i|,
// where |g_i| |d update_i / d g_i| <= kappa_s for AdamW at step s + 1:
//   kappa_s = (1 - beta1) / bc1 * sqrt(bc2 / (1 - beta2)) * (1 + sqrt(s + 1))
// (|g| / sqrt(v_hat) <= sqrt(bc2 / (1 - beta2)), and |m_hat| / sqrt(v_hat)
// grows at most like sqrt(steps)). AdamW amplifies exactly where |g_i| is
// tiny, and the loss feels a parameter through its gradient, so each term is
// at most lr kappa_s |dg_i|. The terms' signs follow the rounding errors,
// which are independent across elements: their sum stays within
// lambda = 7 times its 2-norm, lr kappa_s lambda dg, except with probability
// below 2 exp(-lambda^2 / 2) < 1e-10 (Hoeffding; the probabilistic rounding
// analysis of Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019). The
// worst case (Cauchy-Schwarz, sqrt(n) in place of lambda) would allow a
// visibly different training curve.
double FreeRunningLossTolerance(int updates, double loss,
                                const kernels::AdamWConfig& adamw,
                                double clipped_norm, const StepTolerances& tol);

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_NUMERICS_H_
