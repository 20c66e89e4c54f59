#include "kernels/cpu/grouped_experts.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/bias_element.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/simd_level.h"
#include "kernels/cpu/gate_element.h"

namespace shardd {
namespace kernels {
namespace {

constexpr int64_t kMaxBlasInt = std::numeric_limits<int>::max();

template <typename Vector>
void GrowTo(Vector& v, size_t n) {
  // Never shrink: resize() would value-initialize the tail again next time.
  if (v.size() < n) v.resize(n);
}

template <typename Vector>
size_t CapacityBytes(const Vector& v) {
  return v.capacity() * sizeof(typename Vector::value_type);
}

absl::Status ValidateDims(const ExpertDims& d) {
  if (d.tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts tokens must be >= 0, got ", d.tokens));
  }
  if (d.dim < 1 || d.dim > kMaxBlasInt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "experts dim must be in [1, ", kMaxBlasInt, "], got ", d.dim));
  }
  if (d.intermediate < 1 || 2 * d.intermediate > kMaxBlasInt) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts intermediate must be in [1, ", kMaxBlasInt / 2,
                     "], got ", d.intermediate));
  }
  if (d.experts < 1 || d.experts > kMaxBlasInt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "experts count must be in [1, ", kMaxBlasInt, "], got ", d.experts));
  }
  if (d.top_k < 1 || d.top_k > d.experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts top_k must be in [1, experts=", d.experts,
                     "], got ", d.top_k));
  }
  // Rows are counted and addressed as int32 and passed to cblas as int.
  if (d.tokens > kMaxBlasInt / d.top_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts tokens * top_k must be at most ", kMaxBlasInt,
                     ", got ", d.tokens, " * ", d.top_k));
  }
  return absl::OkStatus();
}

bool SameDims(const ExpertDims& a, const ExpertDims& b) {
  return a.tokens == b.tokens && a.dim == b.dim &&
         a.intermediate == b.intermediate && a.experts == b.experts &&
         a.top_k == b.top_k;
}

// The activation loops are built for each SimdLevel (simd_level.h): the
// bodies are always-inlined into one wrapper per level compiled for that
// level's instructions, and the kernels call the wrapper of
// ActiveSimdLevel(). The results are the same bit for bit on every path: no
// FMA contraction (-ffp-contract=off in BUILD), per-lane arithmetic only,
// and fixed-lane reductions. (OpenBLAS' own kernels still depend on the
// CPU.)
// (SHARDD_TARGET_* and SHARDD_ALWAYS_INLINE come from simd_level.h.)

// a[r, i] = gate(h[r, i], h[r, I + i], w[r]) for n rows (gate_element.h).
template <typename Gate>
SHARDD_ALWAYS_INLINE void ActivationForwardBody(const Gate& gate,
                                                const float* h, const float* w,
                                                int64_t n, int64_t inter,
                                                float* a) {
  for (int64_t r = 0; r < n; ++r) {
    const float* __restrict g = h + r * 2 * inter;
    const float* __restrict u = g + inter;
    float* __restrict out = a + r * inter;
    const float wr = w[r];
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) out[i] = gate.Forward(g[i], u[i], wr);
  }
}

// From da = dL/da [n, I]: dh = dL/dh [n, 2I] and dw[r] = dL/dw[r].
template <typename Gate>
SHARDD_ALWAYS_INLINE void ActivationBackwardBody(const Gate& gate,
                                                 const float* h, const float* w,
                                                 const float* da, int64_t n,
                                                 int64_t inter, float* dh,
                                                 float* dw) {
  // dw[r] is summed in kLanes fixed partial sums, so the result does not
  // depend on the vector width the compiler picked.
  constexpr int64_t kLanes = 8;
  for (int64_t r = 0; r < n; ++r) {
    const float* __restrict g = h + r * 2 * inter;
    const float* __restrict u = g + inter;
    const float* __restrict dar = da + r * inter;
    float* __restrict dg = dh + r * 2 * inter;
    float* __restrict du = dg + inter;
    const float wr = w[r];
    float acc[kLanes] = {};
    for (int64_t base = 0; base < inter; base += kLanes) {
      const int64_t lanes = inter - base < kLanes ? inter - base : kLanes;
#pragma omp simd
      for (int64_t l = 0; l < lanes; ++l) {
        const int64_t i = base + l;
        float w_term, dgi, dui;
        gate.Backward(g[i], u[i], dar[i], wr, &w_term, &dgi, &dui);
        acc[l] += w_term;
        dg[i] = dgi;
        du[i] = dui;
      }
    }
    float sum = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
    dw[r] = sum;
  }
}

// One wrapper per level around each body, and the dispatch between them.
#define SHARDD_ACTIVATION_AT(suffix, attr)                                    \
  template <typename Gate>                                                    \
  attr void ActivationForward##suffix(const Gate& gate, const float* h,       \
                                      const float* w, int64_t n,              \
                                      int64_t inter, float* a) {              \
    ActivationForwardBody(gate, h, w, n, inter, a);                           \
  }                                                                           \
  template <typename Gate>                                                    \
  attr void ActivationBackward##suffix(                                       \
      const Gate& gate, const float* h, const float* w, const float* da,      \
      int64_t n, int64_t inter, float* dh, float* dw) {                       \
    ActivationBackwardBody(gate, h, w, da, n, inter, dh, dw);                 \
  }
SHARDD_ACTIVATION_AT(Baseline, )
SHARDD_ACTIVATION_AT(V3, SHARDD_TARGET_X86_64_V3)
SHARDD_ACTIVATION_AT(V4, SHARDD_TARGET_X86_64_V4)
#undef SHARDD_ACTIVATION_AT

template <typename Gate>
void ActivationForward(SimdLevel level, const Gate& gate, const float* h,
                       const float* w, int64_t n, int64_t inter, float* a) {
  switch (level) {
    case SimdLevel::kX86_64_V4:
      return ActivationForwardV4(gate, h, w, n, inter, a);
    case SimdLevel::kX86_64_V3:
      return ActivationForwardV3(gate, h, w, n, inter, a);
    case SimdLevel::kBaseline:
      break;
  }
  ActivationForwardBaseline(gate, h, w, n, inter, a);
}

template <typename Gate>
void ActivationBackward(SimdLevel level, const Gate& gate, const float* h,
                        const float* w, const float* da, int64_t n,
                        int64_t inter, float* dh, float* dw) {
  switch (level) {
    case SimdLevel::kX86_64_V4:
      return ActivationBackwardV4(gate, h, w, da, n, inter, dh, dw);
    case SimdLevel::kX86_64_V3:
      return ActivationBackwardV3(gate, h, w, da, n, inter, dh, dw);
    case SimdLevel::kBaseline:
      break;
  }
  ActivationBackwardBaseline(gate, h, w, da, n, inter, dh, dw);
}

// Calls fn(gate) with the gate object of `activation`.
template <typename Fn>
void WithGate(GatedActivation activation, const ExpertOptions& options,
              Fn&& fn) {
  switch (activation) {
    case GatedActivation::kSwiGLU:
      return fn(ProductGate<SiluGate>{});
    case GatedActivation::kGeGLU:
      return fn(ProductGate<GeluTanhGate>{});
    default:
      return fn(ClampedSwiGluGate{options.alpha, options.limit});
  }
}

// Runs fn(e) for every expert, given the experts' row offsets [E + 1]. An
// expert's GEMMs, activation and gradient slices touch only its own rows
// and weights, so with enough experts to share out each thread takes whole
// experts (its GEMMs on one thread, no split), the largest first so that
// the last ones to finish are short; with fewer, experts run in order and
// each GEMM is split.
void ForEachExpert(int64_t experts, const int64_t* offsets,
                   absl::FunctionRef<void(int64_t)> fn) {
  if (experts >= 2 * UsableThreads()) {
    std::vector<int64_t> order(experts);
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      return offsets[x + 1] - offsets[x] > offsets[y + 1] - offsets[y];
    });
    ParallelFor(experts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) fn(order[i]);
    });
    return;
  }
  for (int64_t e = 0; e < experts; ++e) fn(e);
}

// out[t] (+)= sum over k of rows[row_of_slot[t * K + k]], skipping masked
// slots; k order makes the sum deterministic.
void ScatterRows(const float* rows, const int32_t* row_of_slot, int64_t tokens,
                 int64_t top_k, int64_t d, bool accumulate, float* out) {
  ParallelFor(tokens, RowGrain(d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* __restrict dst = out + t * d;
      bool written = accumulate;
      for (int64_t k = 0; k < top_k; ++k) {
        const int32_t row = row_of_slot[t * top_k + k];
        if (row < 0) continue;
        const float* __restrict src = rows + static_cast<int64_t>(row) * d;
        if (written) {
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) dst[j] += src[j];
        } else {
          std::memcpy(dst, src, sizeof(float) * d);
          written = true;
        }
      }
      if (!written) std::memset(dst, 0, sizeof(float) * d);
    }
  });
}

// Copies row_token[row]'s row of `from` [T, d] to row `row` of `to` for
// rows [0, n): the gather into expert order.
void GatherRows(const float* from, const int32_t* row_token, int64_t n,
                int64_t d, float* to) {
  ParallelFor(n, RowGrain(d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      std::memcpy(to + row * d, from + static_cast<int64_t>(row_token[row]) * d,
                  sizeof(float) * d);
    }
  });
}

}  // namespace

size_t GroupedExpertsWorkspace::bytes() const {
  return CapacityBytes(expert_offsets) + CapacityBytes(expert_cursor) +
         CapacityBytes(row_token) + CapacityBytes(row_of_slot) +
         CapacityBytes(row_weight) + CapacityBytes(row_dweight) +
         CapacityBytes(xs) + CapacityBytes(h) + CapacityBytes(a) +
         CapacityBytes(o) + CapacityBytes(da) + CapacityBytes(dh) +
         CapacityBytes(dxs);
}

absl::Status GroupedExpertsForward(const ExpertDims& dims,
                                   GatedActivation activation, const float* x,
                                   const int32_t* indices, const float* weights,
                                   const bool* token_mask, const float* w_gu,
                                   const float* w_d, float* y,
                                   GroupedExpertsWorkspace* ws) {
  return GroupedExpertsForward(dims, activation, ExpertOptions(), x, indices,
                               weights, token_mask, w_gu, w_d, y, ws);
}

absl::Status GroupedExpertsForward(const ExpertDims& dims,
                                   GatedActivation activation,
                                   const ExpertOptions& options, const float* x,
                                   const int32_t* indices, const float* weights,
                                   const bool* token_mask, const float* w_gu,
                                   const float* w_d, float* y,
                                   GroupedExpertsWorkspace* ws) {
  SHARDD_RETURN_IF_ERROR(ValidateDims(dims));
  if (activation == GatedActivation::kClampedSwiGLU &&
      !(options.alpha > 0 && options.limit > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts clamped SwiGLU needs alpha and limit > 0, got ",
                     options.alpha, " and ", options.limit));
  }
  SHARDD_ASSIGN_OR_RETURN(const SimdLevel level, ActiveSimdLevel());
  if (ws == nullptr) {
    return absl::InvalidArgumentError("experts workspace must not be null");
  }
  const int64_t t_count = dims.tokens, d = dims.dim, inter = dims.intermediate,
                e_count = dims.experts, k = dims.top_k;
  if (t_count > 0 &&
      (x == nullptr || indices == nullptr || weights == nullptr ||
       w_gu == nullptr || w_d == nullptr || y == nullptr)) {
    return absl::InvalidArgumentError(
        "experts x, indices, weights, w_gu, w_d and y must not be null when "
        "tokens > 0");
  }
  ws->has_forward = false;
  const int64_t slots = t_count * k;

  // Stable counting sort of the assignments by expert.
  GrowTo(ws->expert_offsets, static_cast<size_t>(e_count + 1));
  GrowTo(ws->expert_cursor, static_cast<size_t>(e_count));
  GrowTo(ws->row_of_slot, static_cast<size_t>(slots));
  int64_t* offsets = ws->expert_offsets.data();
  std::fill(offsets, offsets + e_count + 1, 0);
  for (int64_t t = 0; t < t_count; ++t) {
    if (token_mask != nullptr && !token_mask[t]) continue;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = indices[t * k + j];
      if (e < 0 || e >= e_count) {
        return absl::InvalidArgumentError(
            absl::StrCat("experts indices[", t, ", ", j, "] must be in [0, ",
                         e_count, "), got ", e));
      }
      ++offsets[e + 1];
    }
  }
  for (int64_t e = 0; e < e_count; ++e) offsets[e + 1] += offsets[e];
  const int64_t n = offsets[e_count];
  GrowTo(ws->row_token, static_cast<size_t>(n));
  GrowTo(ws->row_weight, static_cast<size_t>(n));
  GrowTo(ws->xs, static_cast<size_t>(n * d));
  GrowTo(ws->h, static_cast<size_t>(n * 2 * inter));
  GrowTo(ws->a, static_cast<size_t>(n * inter));
  GrowTo(ws->o, static_cast<size_t>(n * d));
  int64_t* cursor = ws->expert_cursor.data();
  std::copy(offsets, offsets + e_count, cursor);
  for (int64_t t = 0; t < t_count; ++t) {
    const bool live = token_mask == nullptr || token_mask[t];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = t * k + j;
      if (!live) {
        ws->row_of_slot[slot] = -1;
        continue;
      }
      const int64_t row = cursor[indices[slot]]++;
      ws->row_of_slot[slot] = static_cast<int32_t>(row);
      ws->row_token[row] = static_cast<int32_t>(t);
      ws->row_weight[row] = weights[slot];
    }
  }
  GatherRows(x, ws->row_token.data(), n, d, ws->xs.data());

  const int64_t gu_stride = d * 2 * inter, d_stride = inter * d;
  ForEachExpert(e_count, offsets, [&](int64_t e) {
    const int64_t begin = offsets[e], rows = offsets[e + 1] - begin;
    if (rows == 0) return;  // contributes nothing; see the header
    float* h = ws->h.data() + begin * 2 * inter;
    float* a = ws->a.data() + begin * inter;
    // h[n_e, 2I] = Xe[n_e, D] @ W_gu[e][D, 2I].
    Sgemm(CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
          static_cast<int>(2 * inter), static_cast<int>(d), 1.0f,
          ws->xs.data() + begin * d, static_cast<int>(d), w_gu + e * gu_stride,
          static_cast<int>(2 * inter), 0.0f, h, static_cast<int>(2 * inter));
    if (options.gate_up_bias != nullptr) {
      const float* b = options.gate_up_bias + e * 2 * inter;
      for (int64_t r = 0; r < rows; ++r) {
        float* hr = h + r * 2 * inter;
        for (int64_t i = 0; i < 2 * inter; ++i) hr[i] += b[i];
      }
    }
    // Activated while h is still in cache.
    const float* w = ws->row_weight.data() + begin;
    WithGate(activation, options, [&](const auto& gate) {
      ActivationForward(level, gate, h, w, rows, inter, a);
    });
    // o[n_e, D] = a[n_e, I] @ W_d[e][I, D] (+ w * b_d[e]).
    float* o = ws->o.data() + begin * d;
    Sgemm(CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
          static_cast<int>(d), static_cast<int>(inter), 1.0f, a,
          static_cast<int>(inter), w_d + e * d_stride, static_cast<int>(d),
          0.0f, o, static_cast<int>(d));
    if (options.down_bias != nullptr) {
      const float* b = options.down_bias + e * d;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < d; ++j) {
          o[r * d + j] = AddScaledBiasValue(o[r * d + j], w[r], b[j]);
        }
      }
    }
  });
  ScatterRows(ws->o.data(), ws->row_of_slot.data(), t_count, k, d,
              /*accumulate=*/false, y);

  ws->dims = dims;
  ws->activation = activation;
  ws->options = options;
  ws->rows = n;
  ws->has_forward = true;
  return absl::OkStatus();
}

absl::Status GroupedExpertsBackward(
    const ExpertDims& dims, GatedActivation activation, const float* w_gu,
    const float* w_d, const float* dy, float* dx, bool accumulate_dx,
    float* d_weights, float* dw_gu, float* dw_d, GroupedExpertsWorkspace* ws) {
  return GroupedExpertsBackward(dims, activation, ExpertOptions(), w_gu, w_d,
                                dy, dx, accumulate_dx, d_weights, dw_gu, dw_d,
                                ExpertBiasGrads(), ws);
}

absl::Status GroupedExpertsBackward(
    const ExpertDims& dims, GatedActivation activation,
    const ExpertOptions& options, const float* w_gu, const float* w_d,
    const float* dy, float* dx, bool accumulate_dx, float* d_weights,
    float* dw_gu, float* dw_d, const ExpertBiasGrads& bias_grads,
    GroupedExpertsWorkspace* ws) {
  if (ws == nullptr || !ws->has_forward) {
    return absl::FailedPreconditionError(
        "GroupedExpertsBackward needs a workspace filled by "
        "GroupedExpertsForward");
  }
  if (!SameDims(dims, ws->dims) || activation != ws->activation) {
    return absl::FailedPreconditionError(
        "GroupedExpertsBackward dims or activation differ from the forward's");
  }
  if (options.alpha != ws->options.alpha ||
      options.limit != ws->options.limit ||
      (options.gate_up_bias == nullptr) !=
          (ws->options.gate_up_bias == nullptr) ||
      (options.down_bias == nullptr) != (ws->options.down_bias == nullptr)) {
    return absl::FailedPreconditionError(
        "GroupedExpertsBackward options differ from the forward's");
  }
  const int64_t t_count = dims.tokens, d = dims.dim, inter = dims.intermediate,
                e_count = dims.experts, k = dims.top_k;
  if (t_count == 0) return absl::OkStatus();
  SHARDD_ASSIGN_OR_RETURN(const SimdLevel level, ActiveSimdLevel());
  if (dy == nullptr || w_d == nullptr || (dx != nullptr && w_gu == nullptr)) {
    return absl::InvalidArgumentError(
        "experts dy and w_d (and w_gu for dx) must not be null");
  }
  const int64_t n = ws->rows;
  GrowTo(ws->da, static_cast<size_t>(n * inter));
  GrowTo(ws->row_dweight, static_cast<size_t>(n));
  GrowTo(ws->dh, static_cast<size_t>(n * 2 * inter));
  if (dx != nullptr) GrowTo(ws->dxs, static_cast<size_t>(n * d));

  // dO: dy gathered into expert order (in the forward's o buffer, which a
  // caller may have freed in between).
  GrowTo(ws->o, static_cast<size_t>(n * d));
  float* d_o = ws->o.data();
  GatherRows(dy, ws->row_token.data(), n, d, d_o);

  const int64_t* offsets = ws->expert_offsets.data();
  const int64_t gu_stride = d * 2 * inter, d_stride = inter * d;
  ForEachExpert(e_count, offsets, [&](int64_t e) {
    const int64_t begin = offsets[e], rows = offsets[e + 1] - begin;
    if (rows == 0) return;  // dW += 0: the buffers keep their values
    const float* d_oe = d_o + begin * d;
    float* da = ws->da.data() + begin * inter;
    // dA[n_e, I] = dO[n_e, D] @ W_d[e]^T.
    Sgemm(CblasNoTrans, CblasTrans, static_cast<int>(rows),
          static_cast<int>(inter), static_cast<int>(d), 1.0f, d_oe,
          static_cast<int>(d), w_d + e * d_stride, static_cast<int>(d), 0.0f,
          da, static_cast<int>(inter));
    if (dw_d != nullptr) {
      // dW_d[e][I, D] += A[n_e, I]^T @ dO[n_e, D].
      Sgemm(CblasTrans, CblasNoTrans, static_cast<int>(inter),
            static_cast<int>(d), static_cast<int>(rows), 1.0f,
            ws->a.data() + begin * inter, static_cast<int>(inter), d_oe,
            static_cast<int>(d), 1.0f, dw_d + e * d_stride,
            static_cast<int>(d));
    }
    const float* h = ws->h.data() + begin * 2 * inter;
    const float* w = ws->row_weight.data() + begin;
    float* dwr = ws->row_dweight.data() + begin;
    float* dh = ws->dh.data() + begin * 2 * inter;
    WithGate(activation, options, [&](const auto& gate) {
      ActivationBackward(level, gate, h, w, da, rows, inter, dh, dwr);
    });
    if (options.down_bias != nullptr) {
      // o = ... + w * b_d[e]: dw gains dO . b_d[e], db_d[e] the w-weighted
      // sum of dO.
      const float* b = options.down_bias + e * d;
      float* db =
          bias_grads.down == nullptr ? nullptr : bias_grads.down + e * d;
      for (int64_t r = 0; r < rows; ++r) {
        const float* dor = d_oe + r * d;
        float dot = 0.0f;
        for (int64_t j = 0; j < d; ++j) dot += dor[j] * b[j];
        dwr[r] += dot;
        if (db != nullptr) {
          for (int64_t j = 0; j < d; ++j) db[j] += w[r] * dor[j];
        }
      }
    }
    if (bias_grads.gate_up != nullptr) {
      float* db = bias_grads.gate_up + e * 2 * inter;
      for (int64_t r = 0; r < rows; ++r) {
        const float* dhr = dh + r * 2 * inter;
        for (int64_t i = 0; i < 2 * inter; ++i) db[i] += dhr[i];
      }
    }
    if (dw_gu != nullptr) {
      // dW_gu[e][D, 2I] += Xe[n_e, D]^T @ dH[n_e, 2I].
      Sgemm(CblasTrans, CblasNoTrans, static_cast<int>(d),
            static_cast<int>(2 * inter), static_cast<int>(rows), 1.0f,
            ws->xs.data() + begin * d, static_cast<int>(d), dh,
            static_cast<int>(2 * inter), 1.0f, dw_gu + e * gu_stride,
            static_cast<int>(2 * inter));
    }
    if (dx != nullptr) {
      // dXs[n_e, D] = dH[n_e, 2I] @ W_gu[e]^T.
      Sgemm(CblasNoTrans, CblasTrans, static_cast<int>(rows),
            static_cast<int>(d), static_cast<int>(2 * inter), 1.0f, dh,
            static_cast<int>(2 * inter), w_gu + e * gu_stride,
            static_cast<int>(2 * inter), 0.0f, ws->dxs.data() + begin * d,
            static_cast<int>(d));
    }
  });
  if (d_weights != nullptr) {
    for (int64_t slot = 0; slot < t_count * k; ++slot) {
      const int32_t row = ws->row_of_slot[slot];
      d_weights[slot] = row < 0 ? 0.0f : ws->row_dweight[row];
    }
  }
  if (dx != nullptr) {
    ScatterRows(ws->dxs.data(), ws->row_of_slot.data(), t_count, k, d,
                accumulate_dx, dx);
  }
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
