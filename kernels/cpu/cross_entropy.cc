#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/cross_entropy_element.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/softcap.h"

namespace shardd {
namespace kernels {
namespace {

constexpr int64_t kMaxBlasInt = std::numeric_limits<int>::max();

absl::Status Validate(const float* hidden, const float* weight, int64_t tokens,
                      int64_t dim, int64_t vocab, const int32_t* targets,
                      const CrossEntropyOptions& options) {
  if (tokens < 0 || dim < 1 || vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cross_entropy: need tokens >= 0, dim >= 1, vocab >= 1; got tokens=",
        tokens, " dim=", dim, " vocab=", vocab));
  }
  if (tokens > kMaxBlasInt || dim > kMaxBlasInt || vocab > kMaxBlasInt) {
    return absl::InvalidArgumentError(
        "cross_entropy: tokens, dim and vocab must fit a cblas int");
  }
  if (options.block_rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cross_entropy: block_rows must be >= 1, got ", options.block_rows));
  }
  if (!(options.softcap >= 0) || !std::isfinite(options.softcap)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cross_entropy: softcap must be finite and >= 0, got ",
                     options.softcap));
  }
  if (tokens == 0) return absl::OkStatus();
  if (hidden == nullptr || weight == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError(
        "cross_entropy: hidden, weight and targets must be non-null");
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t target = targets[t];
    if (target == options.ignore_index) continue;
    if (target < 0 || target >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("cross_entropy: target ", target, " at position ", t,
                       " is out of range; allowed [0, vocab=", vocab,
                       ") or ignore_index=", options.ignore_index));
    }
  }
  return absl::OkStatus();
}

// One sweep over the row blocks. With want_grad false it only sums the loss.
CrossEntropyResult Run(const float* hidden, const float* weight, int64_t tokens,
                       int64_t dim, int64_t vocab, const int32_t* targets,
                       const CrossEntropyOptions& options, bool want_grad,
                       float loss_scale, float* dhidden, float* dweight,
                       bool accumulate_dhidden) {
  CrossEntropyResult result;
  if (tokens == 0) return result;
  const int64_t block = std::min(options.block_rows, tokens);
  const int D = static_cast<int>(dim), V = static_cast<int>(vocab);
  std::vector<float> logits(block * vocab);
  const bool capped = options.softcap > 0;
  // The capped logits, kept for the cap's backward.
  std::vector<float> capped_logits(capped && want_grad ? block * vocab : 0);
  std::vector<double> row_loss(block);
  std::vector<char> row_counted(block);
  for (int64_t start = 0; start < tokens; start += block) {
    const int64_t rows = std::min(block, tokens - start);
    const int B = static_cast<int>(rows);
    const float* h = hidden + start * dim;
    // logits[rows, V] = h[rows, D] @ weight[V, D]^T
    Sgemm(CblasNoTrans, CblasTrans, B, V, D, 1.0f, h, D, weight, D, 0.0f,
          logits.data(), V);
    if (capped) {
      SoftcapForward(logits.data(), rows * vocab, options.softcap);
      if (want_grad) {
        std::copy(logits.begin(), logits.begin() + rows * vocab,
                  capped_logits.begin());
      }
    }
    // Rows are independent; each one's loss term lands in row_loss and the
    // terms are added in row order below, as a serial loop would.
    ParallelFor(rows, RowGrain(vocab), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* row = logits.data() + r * vocab;
        const int32_t target = targets[start + r];
        if (target == options.ignore_index) {
          if (want_grad) std::fill(row, row + vocab, 0.0f);
          row_counted[r] = 0;
          continue;
        }
        row_counted[r] = 1;
        const float target_logit = row[target];
        const float max = *std::max_element(row, row + vocab);
        // Overwrite the row with exp(logit - max); it becomes dlogits below.
        double sum = 0.0;
        for (int64_t j = 0; j < vocab; ++j) {
          row[j] = SoftmaxTerm(row[j], max);
          sum += row[j];
        }
        row_loss[r] = CrossEntropyRowLoss(max, sum, target_logit);
        if (want_grad) {
          const float scale = CrossEntropyGradScale(loss_scale, sum);
          for (int64_t j = 0; j < vocab; ++j) {
            row[j] = CrossEntropyLogitGrad(row[j], scale, j == target,
                                           loss_scale);
          }
        }
      }
    });
    bool any_counted = false;
    for (int64_t r = 0; r < rows; ++r) {
      if (row_counted[r] == 0) continue;
      any_counted = true;
      result.loss_sum += row_loss[r];
      ++result.count;
    }
    if (!want_grad) continue;
    if (capped) {
      SoftcapBackward(capped_logits.data(), logits.data(), rows * vocab,
                      options.softcap);
    }
    const float* dl = logits.data();
    if (dhidden != nullptr) {
      // dhidden[rows, D] = dlogits[rows, V] @ weight[V, D]
      Sgemm(CblasNoTrans, CblasNoTrans, B, D, V, 1.0f, dl, V, weight, D,
            accumulate_dhidden ? 1.0f : 0.0f, dhidden + start * dim, D);
    }
    if (dweight != nullptr && any_counted) {
      // dweight[V, D] += dlogits[rows, V]^T @ h[rows, D]
      Sgemm(CblasTrans, CblasNoTrans, V, D, B, 1.0f, dl, V, h, D, 1.0f, dweight,
            D);
    }
  }
  if (result.count > 0) result.mean_loss = result.loss_sum / result.count;
  return result;
}

}  // namespace

absl::StatusOr<CrossEntropyResult> LmHeadCrossEntropyForward(
    const float* hidden, const float* weight, int64_t tokens, int64_t dim,
    int64_t vocab, const int32_t* targets, const CrossEntropyOptions& options) {
  SHARDD_RETURN_IF_ERROR(
      Validate(hidden, weight, tokens, dim, vocab, targets, options));
  return Run(hidden, weight, tokens, dim, vocab, targets, options,
             /*want_grad=*/false, 0.0f, nullptr, nullptr, false);
}

absl::StatusOr<CrossEntropyResult> LmHeadCrossEntropyBackward(
    const float* hidden, const float* weight, int64_t tokens, int64_t dim,
    int64_t vocab, const int32_t* targets, float loss_scale, float* dhidden,
    float* dweight, bool accumulate_dhidden,
    const CrossEntropyOptions& options) {
  SHARDD_RETURN_IF_ERROR(
      Validate(hidden, weight, tokens, dim, vocab, targets, options));
  if (!std::isfinite(loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cross_entropy: loss_scale must be finite, got ", loss_scale));
  }
  return Run(hidden, weight, tokens, dim, vocab, targets, options,
             /*want_grad=*/true, loss_scale, dhidden, dweight,
             accumulate_dhidden);
}

}  // namespace kernels
}  // namespace shardd
