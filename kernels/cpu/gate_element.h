#ifndef SHARDD_KERNELS_CPU_GATE_ELEMENT_H_
#define SHARDD_KERNELS_CPU_GATE_ELEMENT_H_

// The gated MLPs' per-element arithmetic, one definition for the CPU kernels
// (dense_mlp.cc, grouped_experts.cc and its SIMD clones) and the CUDA kernels
// (kernels/cuda/dense_mlp_kernels.cu, grouped_experts_kernels.cu): the gate
// nonlinearities f(g) and f'(g), and the activation a = f(g) u w of one
// (gate, up) pair with its routing weight w, forward and backward. Every
// operation is rounded once (ieee_ops.h) and exp is VecExp on both sides, so
// the device gives the CPU's bits from the same inputs. Dependency-free so
// that nvcc can include it.

#include "kernels/cpu/ieee_ops.h"
#include "kernels/cpu/vec_exp.h"

namespace shardd {
namespace kernels {

// silu(g) = g sigmoid(g).
struct SiluGate {
  // sigmoid(g), and exactly 0 below -40 where the clamped exp would leave
  // g e^-40 instead of the true |silu(g)| < 2e-16.
  SHARDD_HOST_DEVICE_INLINE static float Sigmoid(float g) {
    const float s = RnDiv(1.0f, RnAdd(1.0f, VecExp(-g)));
    return g > -40.0f ? s : 0.0f;
  }
  SHARDD_HOST_DEVICE_INLINE static float Value(float g) {
    return RnMul(g, Sigmoid(g));
  }
  // f = g s, f' = s (1 + g (1 - s)).
  SHARDD_HOST_DEVICE_INLINE static void ValueAndGrad(float g, float* f, float* df) {
    const float s = Sigmoid(g);
    *f = RnMul(g, s);
    *df = RnMul(s, RnAdd(1.0f, RnMul(g, RnSub(1.0f, s))));
  }
};

// gelu with the tanh approximation: 0.5 g (1 + tanh(c (g + a g^3))).
struct GeluTanhGate {
  static constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float kA = 0.044715f;
  // tanh(z) = 1 - 2 / (1 + e^(2z)), saturating cleanly at +-1.
  SHARDD_HOST_DEVICE_INLINE static float Tanh(float z) {
    return RnSub(1.0f, RnDiv(2.0f, RnAdd(1.0f, VecExp(RnMul(2.0f, z)))));
  }
  SHARDD_HOST_DEVICE_INLINE static float Inner(float g) {
    return RnMul(kC, RnAdd(g, RnMul(RnMul(RnMul(kA, g), g), g)));
  }
  SHARDD_HOST_DEVICE_INLINE static float Value(float g) {
    return RnMul(RnMul(0.5f, g), RnAdd(1.0f, Tanh(Inner(g))));
  }
  SHARDD_HOST_DEVICE_INLINE static void ValueAndGrad(float g, float* f, float* df) {
    const float th = Tanh(Inner(g));
    *f = RnMul(RnMul(0.5f, g), RnAdd(1.0f, th));
    // Past |g| = 10, th is exactly +-1 and the second term 0; clamping g
    // there keeps inf * 0 out of it for huge g.
    float gc = g > -10.0f ? g : -10.0f;
    gc = gc < 10.0f ? gc : 10.0f;
    // 0.5 (1 + th) + 0.5 gc (1 - th^2) c (1 + 3 a gc^2)
    const float slope = RnMul(
        RnMul(RnMul(RnMul(0.5f, gc), RnSub(1.0f, RnMul(th, th))), kC),
        RnAdd(1.0f, RnMul(RnMul(RnMul(3.0f, kA), gc), gc)));
    *df = RnAdd(RnMul(0.5f, RnAdd(1.0f, th)), slope);
  }
};

// a = f(g) u w. Backward gives, from da = dL/da, the routing weight's term
// da f u (summed over the row into dL/dw), dL/dg and dL/du.
template <typename Act>
struct ProductGate {
  SHARDD_HOST_DEVICE_INLINE float Forward(float g, float u, float w) const {
    return RnMul(RnMul(Act::Value(g), u), w);
  }
  SHARDD_HOST_DEVICE_INLINE void Backward(float g, float u, float da, float w,
                                   float* w_term, float* dg, float* du) const {
    float f, df;
    Act::ValueAndGrad(g, &f, &df);
    *w_term = RnMul(RnMul(da, f), u);
    const float daw = RnMul(da, w);
    *dg = RnMul(RnMul(daw, u), df);
    *du = RnMul(daw, f);
  }
};

// GPT-OSS's clamped SwiGLU: a = g' sigmoid(alpha g') (u' + 1) w with
// g' = min(g, limit) and u' = clamp(u, -limit, limit); NaN stays NaN.
struct ClampedSwiGluGate {
  float alpha, limit;
  SHARDD_HOST_DEVICE_INLINE float Gate(float g) const {
    return g > limit ? limit : g;
  }
  SHARDD_HOST_DEVICE_INLINE float Up(float u) const {
    return u > limit ? limit : (u < -limit ? -limit : u);
  }
  SHARDD_HOST_DEVICE_INLINE float Forward(float g, float u, float w) const {
    const float gc = Gate(g);
    const float glu = RnMul(gc, SiluGate::Sigmoid(RnMul(alpha, gc)));
    return RnMul(RnMul(glu, RnAdd(Up(u), 1.0f)), w);
  }
  SHARDD_HOST_DEVICE_INLINE void Backward(float g, float u, float da, float w,
                                   float* w_term, float* dg, float* du) const {
    const float gc = Gate(g);
    const float uc1 = RnAdd(Up(u), 1.0f);
    const float s = SiluGate::Sigmoid(RnMul(alpha, gc));
    const float glu = RnMul(gc, s);
    *w_term = RnMul(RnMul(da, glu), uc1);
    const float daw = RnMul(da, w);
    // d(g sigmoid(alpha g))/dg = s + alpha g s (1 - s); the clamps pass
    // gradient inside their range, bounds included (torch.clamp).
    const float dglu =
        RnAdd(s, RnMul(RnMul(RnMul(alpha, gc), s), RnSub(1.0f, s)));
    *dg = g <= limit ? RnMul(RnMul(daw, uc1), dglu) : 0.0f;
    *du = u >= -limit && u <= limit ? RnMul(daw, glu) : 0.0f;
  }
};

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_GATE_ELEMENT_H_
