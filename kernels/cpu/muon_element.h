#ifndef SHARDD_KERNELS_CPU_MUON_ELEMENT_H_
#define SHARDD_KERNELS_CPU_MUON_ELEMENT_H_

// Muon's per-element arithmetic (kernels/cpu/muon.h describes the
// optimizer), one definition for the CPU (muon.cc) and the device, each
// operation rounded once (ieee_ops.h), so a GPU worker's momentum,
// normalised update and parameters equal a CPU worker's bit for bit given
// the same Newton-Schulz GEMMs. The GEMMs and the Frobenius norm's sum are
// each side's own (OpenBLAS / cuBLAS; the CPU sums in double); the norm
// enters here as its sum of squares. Dependency-free so that nvcc can
// include it.

#include <cmath>

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// m_new = beta * m + (1 - beta) * g; both products rounded before the add.
SHARDD_HOST_DEVICE_INLINE float MuonMomentum(float m, float g, float beta,
                                             float one_minus_beta) {
  return RnAdd(RnMul(beta, m), RnMul(one_minus_beta, g));
}

// Nesterov's look-ahead: (1 - beta) * g + beta * m_new.
SHARDD_HOST_DEVICE_INLINE float MuonNesterov(float g, float m_new, float beta,
                                             float one_minus_beta) {
  return RnAdd(RnMul(one_minus_beta, g), RnMul(beta, m_new));
}

// ||X||_F + eps from the sum of squares (computed in double by the caller),
// rounded to fp32 before eps is added.
SHARDD_HOST_DEVICE_INLINE float MuonNormDenominator(double sum_of_squares,
                                                    float eps) {
#ifdef __CUDA_ARCH__
  const double norm = sqrt(sum_of_squares);
#else
  const double norm = std::sqrt(sum_of_squares);
#endif
  return RnAdd(static_cast<float>(norm), eps);
}

// The factors of p * (1 - lr * wd) - lr * u, computed in double and
// rounded to fp32 once each.
struct MuonApplyScalars {
  float decay;
  float step;
};

SHARDD_HOST_DEVICE_INLINE MuonApplyScalars MuonApplyScalarsFor(double lr,
                                                               double wd) {
  return {static_cast<float>(1.0 - lr * wd), static_cast<float>(lr)};
}

// p_new = p * decay - step * u; both products rounded before the subtraction.
SHARDD_HOST_DEVICE_INLINE float MuonParamUpdate(float p, float u,
                                                MuonApplyScalars s) {
  return RnSub(RnMul(p, s.decay), RnMul(s.step, u));
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_MUON_ELEMENT_H_
