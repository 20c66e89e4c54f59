#ifndef SHARDD_KERNELS_CPU_ROUTER_AUX_LOSS_ELEMENT_H_
#define SHARDD_KERNELS_CPU_ROUTER_AUX_LOSS_ELEMENT_H_

// The load-balancing loss's per-element arithmetic (router_aux_loss.h has
// the math), one definition for the CPU kernel (router_aux_loss.cc) and
// the CUDA kernels (kernels/cuda/router_aux_loss_kernels.cu), in double with
// each operation rounded once (no FMA on either side). The sums over rows
// (a row's dot, the probability sums) are each side's own.
// Dependency-free so that nvcc can include it.

#include <cstdint>

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// Expert e's term of the loss's sum: (c_e / R) * (P_e / R).
SHARDD_HOST_DEVICE_INLINE double RouterAuxLossTerm(int64_t count,
                                                   double prob_sum,
                                                   double rows) {
  return RnDMul(RnDDiv(static_cast<double>(count), rows),
                RnDDiv(prob_sum, rows));
}

// g_e = scale * E * c_e / R^2: d loss / d p_e, the same for every row.
SHARDD_HOST_DEVICE_INLINE double RouterAuxProbGrad(double scale,
                                                   int64_t experts,
                                                   int64_t count,
                                                   double rows) {
  return RnDDiv(RnDMul(RnDMul(scale, static_cast<double>(experts)),
                       static_cast<double>(count)),
                RnDMul(rows, rows));
}

// One step of a row's dot sum_e p_e g_e.
SHARDD_HOST_DEVICE_INLINE double RouterAuxDotStep(double dot, float p,
                                                  double g) {
  return RnDAdd(dot, RnDMul(static_cast<double>(p), g));
}

// d loss / d logit_e = p_e (g_e - dot), through the softmax.
SHARDD_HOST_DEVICE_INLINE float RouterAuxLogitGrad(float p, double g,
                                                   double dot) {
  return static_cast<float>(RnDMul(static_cast<double>(p), RnDSub(g, dot)));
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ROUTER_AUX_LOSS_ELEMENT_H_
