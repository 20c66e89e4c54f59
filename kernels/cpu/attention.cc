#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/simd_level.h"
#include "kernels/cpu/vec_exp.h"

namespace shardd {
namespace kernels {
namespace {

// Queries and keys per block: a [64, 256] fp32 score block (64 KiB) stays in
// L1/L2 next to its query and key rows.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t Dv(const AttentionDims& d) {
  return d.v_head_dim == 0 ? d.head_dim : d.v_head_dim;
}

bool MulOverflows(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(product, f, &product)) return true;
  }
  return false;
}

// Row-major views of one (sequence, head) slice.
struct HeadViews {
  const float* q;  // [T] rows of Dh, stride ldq
  const float* k;  // [S] rows of Dh, stride ldk
  const float* v;  // [S] rows of Dv, stride ldv
  int64_t ldq, ldk, ldv, ldo;
};

HeadViews Views(const AttentionDims& d, const float* q, const float* k,
                const float* v, int64_t b, int64_t h) {
  const int64_t group = d.q_heads / d.kv_heads;
  const int64_t g = h / group;
  const int64_t dv = Dv(d);
  HeadViews out;
  out.ldq = d.q_heads * d.head_dim;
  out.ldk = d.kv_heads * d.head_dim;
  out.ldv = d.kv_heads * dv;
  out.ldo = d.q_heads * dv;
  out.q = q + (b * d.q_len * d.q_heads + h) * d.head_dim;
  out.k = k + (b * d.kv_len * d.kv_heads + g) * d.head_dim;
  out.v = v + (b * d.kv_len * d.kv_heads + g) * dv;
  return out;
}

// How many pool slots split `tasks` independent tasks.
int64_t Slots(int64_t tasks) {
  return std::max<int64_t>(1, std::min<int64_t>(tasks, UsableThreads()));
}

void Grow(std::vector<float>* v, int64_t n) {
  if (static_cast<int64_t>(v->size()) < n) v->resize(n);
}

// The score rows' element loops, cloned per SIMD level (simd_level.h) with
// the same bits on every level: VecExp, per-lane arithmetic, fixed-lane sums.
constexpr int64_t kLanes = 8;

// The largest of row[lo, hi) (-inf for an empty range).
SHARDD_ALWAYS_INLINE float RowMaxBody(const float* row, int64_t lo,
                                      int64_t hi) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t c = lo; c < hi; ++c) m = row[c] > m ? row[c] : m;
  return m;
}

// row[c] = exp(row[c] - shift) for c in [lo, hi), 0 for the other c in
// [0, n) (the masked keys); returns the sum of the row, added in kLanes
// fixed partial sums.
SHARDD_ALWAYS_INLINE float ExpRowBody(float* __restrict row, int64_t n,
                                      int64_t lo, int64_t hi, float shift) {
  float acc[kLanes] = {};
  for (int64_t base = 0; base < n; base += kLanes) {
    const int64_t lanes = n - base < kLanes ? n - base : kLanes;
#pragma omp simd
    for (int64_t l = 0; l < lanes; ++l) {
      const int64_t c = base + l;
      const float e = VecExp(row[c] - shift);
      const float value = c >= lo && c < hi ? e : 0.0f;
      row[c] = value;
      acc[l] += value;
    }
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

#define SHARDD_ATTENTION_ROWS_AT(suffix, attr)                             \
  attr float RowMax##suffix(const float* row, int64_t lo, int64_t hi) {    \
    return RowMaxBody(row, lo, hi);                                        \
  }                                                                        \
  attr float ExpRow##suffix(float* row, int64_t n, int64_t lo, int64_t hi, \
                            float shift) {                                 \
    return ExpRowBody(row, n, lo, hi, shift);                              \
  }
SHARDD_ATTENTION_ROWS_AT(Baseline, )
SHARDD_ATTENTION_ROWS_AT(V3, SHARDD_TARGET_X86_64_V3)
SHARDD_ATTENTION_ROWS_AT(V4, SHARDD_TARGET_X86_64_V4)
#undef SHARDD_ATTENTION_ROWS_AT

// The clones of one SIMD level.
struct RowOps {
  float (*max)(const float* row, int64_t lo, int64_t hi);
  float (*exp)(float* row, int64_t n, int64_t lo, int64_t hi, float shift);
};

RowOps RowOpsFor(SimdLevel level) {
  switch (level) {
    case SimdLevel::kX86_64_V4:
      return {RowMaxV4, ExpRowV4};
    case SimdLevel::kX86_64_V3:
      return {RowMaxV3, ExpRowV3};
    case SimdLevel::kBaseline:
      break;
  }
  return {RowMaxBaseline, ExpRowBaseline};
}

// The keys [*lo, *hi) of the block [j0, j0 + bk) that the query at `pos`
// sees, relative to j0. Every mask lets a query see one contiguous run of
// keys, which MaskKeyRange gives for a single position.
// `first`: the first key the query may see besides the mask (packed
// sequences' key_begin), else 0.
void RowKeys(const MaskRule& rule, int64_t pos, int64_t s, int64_t j0,
             int64_t bk, int64_t first, int64_t* lo, int64_t* hi) {
  int64_t begin, end;
  MaskKeyRange(rule, pos, pos, s, &begin, &end);
  begin = std::max(begin, first);
  *lo = std::min(std::max(begin - j0, int64_t{0}), bk);
  *hi = std::max(std::min(end - j0, bk), *lo);
}

// The first key query i of sequence b may see besides the mask.
int64_t FirstKey(const AttentionOptions& o, int64_t b, int64_t t, int64_t i) {
  return PackedFirstKey(o.key_begin, t, b, i);
}

// The keys a block of queries [i0, i0 + bq) of sequence b may see.
void BlockKeys(const MaskRule& rule, const AttentionOptions& o, int64_t b,
               int64_t t, int64_t s, int64_t i0, int64_t bq,
               int64_t* begin, int64_t* end) {
  MaskKeyRange(rule, i0 + o.q_offset, i0 + bq - 1 + o.q_offset, s, begin,
               end);
  if (o.key_begin == nullptr) return;
  int64_t first = s;
  for (int64_t r = 0; r < bq; ++r) {
    first = std::min(first, FirstKey(o, b, t, i0 + r));
  }
  *begin = std::min(std::max(*begin, first), *end);
}

}  // namespace

absl::Status ValidateAttention(const AttentionDims& d,
                               const AttentionOptions& o) {
  if (d.batch < 1 || d.q_len < 0 || d.kv_len < 0 || d.q_heads < 1 ||
      d.kv_heads < 1 || d.head_dim < 1 || d.v_head_dim < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention dims: need batch >= 1, q_len and kv_len >= 0, heads and "
        "head_dim >= 1, v_head_dim >= 0; got batch ",
        d.batch, ", q_len ", d.q_len, ", kv_len ", d.kv_len, ", q_heads ",
        d.q_heads, ", kv_heads ", d.kv_heads, ", head_dim ", d.head_dim,
        ", v_head_dim ", d.v_head_dim));
  }
  if (d.q_heads % d.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention dims.kv_heads: must divide q_heads (",
                     d.q_heads, "), got ", d.kv_heads));
  }
  const int64_t dv = Dv(d);
  if (MulOverflows({d.batch, d.q_len, d.q_heads, std::max(d.head_dim, dv)}) ||
      MulOverflows({d.batch, d.kv_len, d.kv_heads, std::max(d.head_dim, dv)}) ||
      MulOverflows({d.q_heads, std::max(d.head_dim, dv), 2}) ||
      d.q_heads * std::max(d.head_dim, dv) > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        "attention dims: sizes overflow (row strides must fit an int)");
  }
  if (!std::isfinite(o.scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention options.scale: must be finite, got ", o.scale));
  }
  if (o.q_offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention options.q_offset: must be >= 0, got ", o.q_offset));
  }
  if (o.mask == AttentionMask::kSlidingWindow && o.window < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention options.window: a sliding-window mask needs window >= 1, "
        "got ",
        o.window));
  }
  if (o.mask == AttentionMask::kBlockCausal && o.block < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention options.block: a block-causal mask needs block >= 1, got ",
        o.block));
  }
  switch (o.mask) {
    case AttentionMask::kBidirectional:
    case AttentionMask::kCausal:
    case AttentionMask::kSlidingWindow:
    case AttentionMask::kBlockCausal:
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError("attention options.mask: unknown mask");
}

absl::Status AttentionForward(const AttentionDims& d, const AttentionOptions& o,
                              const float* q, const float* k, const float* v,
                              float* out, float* lse, AttentionWorkspace* ws) {
  if (absl::Status valid = ValidateAttention(d, o); !valid.ok()) return valid;
  const int64_t dv = Dv(d);
  const int64_t t = d.q_len, s = d.kv_len;
  const MaskRule rule = o.rule();
  if (t == 0) return absl::OkStatus();
  SHARDD_ASSIGN_OR_RETURN(const SimdLevel level, ActiveSimdLevel());
  const RowOps ops = RowOpsFor(level);
  if (q == nullptr || out == nullptr || lse == nullptr || ws == nullptr ||
      (s > 0 && (k == nullptr || v == nullptr))) {
    return absl::InvalidArgumentError(
        "attention: q, k, v, out, lse and ws must not be null");
  }
  // (sequence, head) pairs are independent; each slot of the pool takes
  // every slots-th one with its own score block.
  const int64_t pairs = d.batch * d.q_heads;
  const int64_t slots = Slots(pairs);
  Grow(&ws->scores, slots * kBlockQ * kBlockK);
  Grow(&ws->acc, slots * kBlockQ * dv);
  Grow(&ws->row_max, slots * kBlockQ);
  Grow(&ws->row_sum, slots * kBlockQ);
  ParallelFor(slots, 1, [&](int64_t slot, int64_t) {
    float* scores = ws->scores.data() + slot * kBlockQ * kBlockK;
    float* acc = ws->acc.data() + slot * kBlockQ * dv;
    float* m = ws->row_max.data() + slot * kBlockQ;
    float* l = ws->row_sum.data() + slot * kBlockQ;
    for (int64_t pair = slot; pair < pairs; pair += slots) {
      const int64_t b = pair / d.q_heads, h = pair % d.q_heads;
      const HeadViews hv = Views(d, q, k, v, b, h);
      float* o_head = out + (b * t * d.q_heads + h) * dv;
      float* lse_head = lse + (b * d.q_heads + h) * t;
      for (int64_t i0 = 0; i0 < t; i0 += kBlockQ) {
        const int64_t bq = std::min(kBlockQ, t - i0);
        std::fill(m, m + bq, kNegInf);
        std::fill(l, l + bq, 0.0f);
        std::fill(acc, acc + bq * dv, 0.0f);
        int64_t k_begin, k_end;
        BlockKeys(rule, o, b, t, s, i0, bq, &k_begin, &k_end);
        for (int64_t j0 = k_begin; j0 < k_end; j0 += kBlockK) {
          const int64_t bk = std::min(kBlockK, k_end - j0);
          Sgemm(CblasNoTrans, CblasTrans, bq, bk, d.head_dim, o.scale,
                hv.q + i0 * hv.ldq, hv.ldq, hv.k + j0 * hv.ldk, hv.ldk, 0.0f,
                scores, bk);
          bool any = false;
          for (int64_t r = 0; r < bq; ++r) {
            float* row = scores + r * bk;
            int64_t lo, hi;
            RowKeys(rule, i0 + r + o.q_offset, s, j0, bk,
                    FirstKey(o, b, t, i0 + r), &lo, &hi);
            const float block_max = ops.max(row, lo, hi);
            if (block_max == kNegInf) {
              std::fill(row, row + bk, 0.0f);
              continue;
            }
            any = true;
            const float m_new = std::max(m[r], block_max);
            const float correction = std::exp(m[r] - m_new);
            const float sum = ops.exp(row, bk, lo, hi, m_new);
            l[r] = l[r] * correction + sum;
            if (correction != 1.0f) {
              for (int64_t e = 0; e < dv; ++e) acc[r * dv + e] *= correction;
            }
            m[r] = m_new;
          }
          if (!any) continue;
          Sgemm(CblasNoTrans, CblasNoTrans, bq, dv, bk, 1.0f, scores, bk,
                hv.v + j0 * hv.ldv, hv.ldv, 1.0f, acc, dv);
        }
        for (int64_t r = 0; r < bq; ++r) {
          if (o.sinks != nullptr) {
            const float sink = o.sinks[h];
            const float m_new = std::max(m[r], sink);
            const float correction = std::exp(m[r] - m_new);
            l[r] = l[r] * correction + std::exp(sink - m_new);
            for (int64_t e = 0; e < dv; ++e) acc[r * dv + e] *= correction;
            m[r] = m_new;
          }
          float* o_row = o_head + (i0 + r) * hv.ldo;
          if (l[r] > 0.0f) {
            const float inv = 1.0f / l[r];
            for (int64_t e = 0; e < dv; ++e) o_row[e] = acc[r * dv + e] * inv;
            lse_head[i0 + r] = m[r] + std::log(l[r]);
          } else {
            std::fill(o_row, o_row + dv, 0.0f);
            lse_head[i0 + r] = kNegInf;
          }
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status AttentionBackward(const AttentionDims& d,
                               const AttentionOptions& o, const float* q,
                               const float* k, const float* v, const float* out,
                               const float* lse, const float* d_out, float* dq,
                               float* dk, float* dv_out, float* d_sinks,
                               AttentionWorkspace* ws) {
  if (absl::Status valid = ValidateAttention(d, o); !valid.ok()) return valid;
  const int64_t dv = Dv(d);
  const int64_t t = d.q_len, s = d.kv_len;
  const MaskRule rule = o.rule();
  if (t == 0) return absl::OkStatus();
  SHARDD_ASSIGN_OR_RETURN(const SimdLevel level, ActiveSimdLevel());
  const RowOps ops = RowOpsFor(level);
  if (q == nullptr || out == nullptr || lse == nullptr || d_out == nullptr ||
      ws == nullptr || (s > 0 && (k == nullptr || v == nullptr))) {
    return absl::InvalidArgumentError(
        "attention backward: q, k, v, out, lse, d_out and ws must not be "
        "null");
  }
  // A key/value head's gradients sum over the query heads that share it, so
  // a task is one (sequence, kv head) and its query heads in order; with
  // sinks, whose gradients sum over the sequences too, a task is one kv
  // head over every sequence. Either way each output has one writer and
  // the order of its sums is the serial one, at every thread count.
  const int64_t group = d.q_heads / d.kv_heads;
  const bool per_sequence = d_sinks == nullptr;
  const int64_t tasks = per_sequence ? d.batch * d.kv_heads : d.kv_heads;
  const int64_t slots = Slots(tasks);
  Grow(&ws->scores, slots * kBlockQ * kBlockK);
  Grow(&ws->dp, slots * kBlockQ * kBlockK);
  Grow(&ws->row_delta, slots * kBlockQ);
  ParallelFor(slots, 1, [&](int64_t slot, int64_t) {
    float* p = ws->scores.data() + slot * kBlockQ * kBlockK;
    float* dp = ws->dp.data() + slot * kBlockQ * kBlockK;
    float* delta = ws->row_delta.data() + slot * kBlockQ;
    for (int64_t task = slot; task < tasks; task += slots) {
      const int64_t g = task % d.kv_heads;
      const int64_t b_begin = per_sequence ? task / d.kv_heads : 0;
      const int64_t b_end = per_sequence ? b_begin + 1 : d.batch;
      for (int64_t b = b_begin; b < b_end; ++b) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const HeadViews hv = Views(d, q, k, v, b, h);
          const int64_t q_at = (b * t * d.q_heads + h);
          const float* o_head = out + q_at * dv;
          const float* do_head = d_out + q_at * dv;
          float* dq_head = dq == nullptr ? nullptr : dq + q_at * d.head_dim;
          const int64_t kv_at =
              b * s * d.kv_heads + h / (d.q_heads / d.kv_heads);
          float* dk_head = dk == nullptr ? nullptr : dk + kv_at * d.head_dim;
          float* dv_head = dv_out == nullptr ? nullptr : dv_out + kv_at * dv;
          const float* lse_head = lse + (b * d.q_heads + h) * t;
          for (int64_t i0 = 0; i0 < t; i0 += kBlockQ) {
            const int64_t bq = std::min(kBlockQ, t - i0);
            // delta_i = dO_i . O_i (the softmax backward's row term).
            for (int64_t r = 0; r < bq; ++r) {
              const float* o_row = o_head + (i0 + r) * hv.ldo;
              const float* do_row = do_head + (i0 + r) * hv.ldo;
              float sum = 0.0f;
              for (int64_t e = 0; e < dv; ++e) sum += o_row[e] * do_row[e];
              delta[r] = sum;
              if (d_sinks != nullptr && o.sinks != nullptr &&
                  lse_head[i0 + r] != kNegInf) {
                // d sink = -p_sink * delta (the sink carries no value).
                d_sinks[h] -= std::exp(o.sinks[h] - lse_head[i0 + r]) * sum;
              }
            }
            int64_t k_begin, k_end;
            BlockKeys(rule, o, b, t, s, i0, bq, &k_begin, &k_end);
            for (int64_t j0 = k_begin; j0 < k_end; j0 += kBlockK) {
              const int64_t bk = std::min(kBlockK, k_end - j0);
              Sgemm(CblasNoTrans, CblasTrans, bq, bk, d.head_dim, o.scale,
                    hv.q + i0 * hv.ldq, hv.ldq, hv.k + j0 * hv.ldk, hv.ldk,
                    0.0f, p, bk);
              bool any = false;
              for (int64_t r = 0; r < bq; ++r) {
                const float row_lse = lse_head[i0 + r];
                int64_t lo = 0, hi = 0;
                if (row_lse != kNegInf) {
                  RowKeys(rule, i0 + r + o.q_offset, s, j0, bk,
                          FirstKey(o, b, t, i0 + r), &lo, &hi);
                }
                ops.exp(p + r * bk, bk, lo, hi, row_lse);
                any = any || lo < hi;
              }
              if (!any) continue;
              if (dv_head != nullptr) {
                // dV += P^T dO.
                Sgemm(CblasTrans, CblasNoTrans, bk, dv, bq, 1.0f, p, bk,
                      do_head + i0 * hv.ldo, hv.ldo, 1.0f,
                      dv_head + j0 * hv.ldv, hv.ldv);
              }
              if (dq_head == nullptr && dk_head == nullptr) continue;
              // dP = dO V^T; dS = P * (dP - delta), in place.
              Sgemm(CblasNoTrans, CblasTrans, bq, bk, dv, 1.0f,
                    do_head + i0 * hv.ldo, hv.ldo, hv.v + j0 * hv.ldv, hv.ldv,
                    0.0f, dp, bk);
              for (int64_t r = 0; r < bq; ++r) {
                for (int64_t c = 0; c < bk; ++c) {
                  dp[r * bk + c] = p[r * bk + c] * (dp[r * bk + c] - delta[r]);
                }
              }
              if (dq_head != nullptr) {
                // dQ += scale dS K.
                Sgemm(CblasNoTrans, CblasNoTrans, bq, d.head_dim, bk, o.scale,
                      dp, bk, hv.k + j0 * hv.ldk, hv.ldk, 1.0f,
                      dq_head + i0 * hv.ldq, hv.ldq);
              }
              if (dk_head != nullptr) {
                // dK += scale dS^T Q.
                Sgemm(CblasTrans, CblasNoTrans, bk, d.head_dim, bq, o.scale, dp,
                      bk, hv.q + i0 * hv.ldq, hv.ldq, 1.0f,
                      dk_head + j0 * hv.ldk, hv.ldk);
              }
            }
          }
        }
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
