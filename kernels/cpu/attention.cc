#include "kernels/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace shardd {
namespace kernels {
namespace {

// Queries and keys per block: a [64, 128] fp32 score block (32 KiB) stays in
// L1/L2 next to its query and key rows.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 128;
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

void Grow(std::vector<float>* v, int64_t n) {
  if (static_cast<int64_t>(v->size()) < n) v->resize(n);
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
  if (q == nullptr || out == nullptr || lse == nullptr || ws == nullptr ||
      (s > 0 && (k == nullptr || v == nullptr))) {
    return absl::InvalidArgumentError(
        "attention: q, k, v, out, lse and ws must not be null");
  }
  Grow(&ws->scores, kBlockQ * kBlockK);
  Grow(&ws->acc, kBlockQ * dv);
  Grow(&ws->row_max, kBlockQ);
  Grow(&ws->row_sum, kBlockQ);
  float* scores = ws->scores.data();
  float* acc = ws->acc.data();
  float* m = ws->row_max.data();
  float* l = ws->row_sum.data();

  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.q_heads; ++h) {
      const HeadViews hv = Views(d, q, k, v, b, h);
      float* o_head = out + (b * t * d.q_heads + h) * dv;
      float* lse_head = lse + (b * d.q_heads + h) * t;
      for (int64_t i0 = 0; i0 < t; i0 += kBlockQ) {
        const int64_t bq = std::min(kBlockQ, t - i0);
        std::fill(m, m + bq, kNegInf);
        std::fill(l, l + bq, 0.0f);
        std::fill(acc, acc + bq * dv, 0.0f);
        int64_t k_begin, k_end;
        MaskKeyRange(rule, i0 + o.q_offset, i0 + bq - 1 + o.q_offset, s,
                     &k_begin, &k_end);
        for (int64_t j0 = k_begin; j0 < k_end; j0 += kBlockK) {
          const int64_t bk = std::min(kBlockK, k_end - j0);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bq, bk,
                      d.head_dim, o.scale, hv.q + i0 * hv.ldq, hv.ldq,
                      hv.k + j0 * hv.ldk, hv.ldk, 0.0f, scores, bk);
          bool any = false;
          for (int64_t r = 0; r < bq; ++r) {
            const int64_t pos = i0 + r + o.q_offset;
            float* row = scores + r * bk;
            float block_max = kNegInf;
            for (int64_t c = 0; c < bk; ++c) {
              if (!MaskAllows(rule, pos, j0 + c)) row[c] = kNegInf;
              block_max = std::max(block_max, row[c]);
            }
            if (block_max == kNegInf) {
              std::fill(row, row + bk, 0.0f);
              continue;
            }
            any = true;
            const float m_new = std::max(m[r], block_max);
            const float correction = std::exp(m[r] - m_new);
            float sum = 0.0f;
            for (int64_t c = 0; c < bk; ++c) {
              row[c] = std::exp(row[c] - m_new);
              sum += row[c];
            }
            l[r] = l[r] * correction + sum;
            if (correction != 1.0f) {
              for (int64_t e = 0; e < dv; ++e) acc[r * dv + e] *= correction;
            }
            m[r] = m_new;
          }
          if (!any) continue;
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bq, dv, bk,
                      1.0f, scores, bk, hv.v + j0 * hv.ldv, hv.ldv, 1.0f, acc,
                      dv);
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
  }
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
  if (q == nullptr || out == nullptr || lse == nullptr || d_out == nullptr ||
      ws == nullptr || (s > 0 && (k == nullptr || v == nullptr))) {
    return absl::InvalidArgumentError(
        "attention backward: q, k, v, out, lse, d_out and ws must not be "
        "null");
  }
  Grow(&ws->scores, kBlockQ * kBlockK);
  Grow(&ws->dp, kBlockQ * kBlockK);
  Grow(&ws->row_delta, kBlockQ);
  float* p = ws->scores.data();
  float* dp = ws->dp.data();
  float* delta = ws->row_delta.data();

  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.q_heads; ++h) {
      const HeadViews hv = Views(d, q, k, v, b, h);
      const int64_t q_at = (b * t * d.q_heads + h);
      const float* o_head = out + q_at * dv;
      const float* do_head = d_out + q_at * dv;
      float* dq_head = dq == nullptr ? nullptr : dq + q_at * d.head_dim;
      const int64_t kv_at = b * s * d.kv_heads + h / (d.q_heads / d.kv_heads);
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
        MaskKeyRange(rule, i0 + o.q_offset, i0 + bq - 1 + o.q_offset, s,
                     &k_begin, &k_end);
        for (int64_t j0 = k_begin; j0 < k_end; j0 += kBlockK) {
          const int64_t bk = std::min(kBlockK, k_end - j0);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bq, bk,
                      d.head_dim, o.scale, hv.q + i0 * hv.ldq, hv.ldq,
                      hv.k + j0 * hv.ldk, hv.ldk, 0.0f, p, bk);
          bool any = false;
          for (int64_t r = 0; r < bq; ++r) {
            const int64_t pos = i0 + r + o.q_offset;
            const float row_lse = lse_head[i0 + r];
            float* row = p + r * bk;
            for (int64_t c = 0; c < bk; ++c) {
              const bool on =
                  row_lse != kNegInf && MaskAllows(rule, pos, j0 + c);
              row[c] = on ? std::exp(row[c] - row_lse) : 0.0f;
              any = any || on;
            }
          }
          if (!any) continue;
          if (dv_head != nullptr) {
            // dV += P^T dO.
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, bk, dv, bq,
                        1.0f, p, bk, do_head + i0 * hv.ldo, hv.ldo, 1.0f,
                        dv_head + j0 * hv.ldv, hv.ldv);
          }
          if (dq_head == nullptr && dk_head == nullptr) continue;
          // dP = dO V^T; dS = P * (dP - delta), in place.
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bq, bk, dv, 1.0f,
                      do_head + i0 * hv.ldo, hv.ldo, hv.v + j0 * hv.ldv, hv.ldv,
                      0.0f, dp, bk);
          for (int64_t r = 0; r < bq; ++r) {
            for (int64_t c = 0; c < bk; ++c) {
              dp[r * bk + c] = p[r * bk + c] * (dp[r * bk + c] - delta[r]);
            }
          }
          if (dq_head != nullptr) {
            // dQ += scale dS K.
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bq,
                        d.head_dim, bk, o.scale, dp, bk, hv.k + j0 * hv.ldk,
                        hv.ldk, 1.0f, dq_head + i0 * hv.ldq, hv.ldq);
          }
          if (dk_head != nullptr) {
            // dK += scale dS^T Q.
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, bk, d.head_dim,
                        bq, o.scale, dp, bk, hv.q + i0 * hv.ldq, hv.ldq, 1.0f,
                        dk_head + j0 * hv.ldk, hv.ldk);
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
