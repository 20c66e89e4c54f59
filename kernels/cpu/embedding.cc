#include "kernels/cpu/embedding.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardd {
namespace kernels {
namespace {

absl::Status ValidateArgs(const float* table, int64_t vocab_size, int64_t dim,
                          const int32_t* ids, int64_t num_tokens,
                          const float* other, const char* table_name,
                          const char* other_name) {
  if (vocab_size < 0 || dim < 0 || num_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "embedding: sizes must be >= 0, got vocab_size=", vocab_size,
        " dim=", dim, " num_tokens=", num_tokens));
  }
  if (num_tokens > 0 && ids == nullptr) {
    return absl::InvalidArgumentError("embedding: ids is null");
  }
  if (num_tokens > 0 && dim > 0) {
    if (table == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("embedding: ", table_name, " is null"));
    }
    if (other == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("embedding: ", other_name, " is null"));
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (ids[t] < 0 || ids[t] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "embedding: token id ", ids[t], " at position ", t,
          " is out of range; allowed [0, vocab_size=", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EmbeddingForward(const float* table, int64_t vocab_size,
                              int64_t dim, const int32_t* ids,
                              int64_t num_tokens, float* out) {
  SHARDD_RETURN_IF_ERROR(ValidateArgs(table, vocab_size, dim, ids, num_tokens,
                                      out, "table", "out"));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = table + static_cast<int64_t>(ids[t]) * dim;
    std::copy(row, row + dim, out + t * dim);
  }
  return absl::OkStatus();
}

absl::Status EmbeddingBackward(const float* dout, const int32_t* ids,
                               int64_t num_tokens, int64_t vocab_size,
                               int64_t dim, float* dtable,
                               int64_t padding_id) {
  SHARDD_RETURN_IF_ERROR(ValidateArgs(dtable, vocab_size, dim, ids, num_tokens,
                                      dout, "dtable", "dout"));
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (ids[t] == padding_id) continue;
    float* row = dtable + static_cast<int64_t>(ids[t]) * dim;
    const float* g = dout + t * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] += g[d];
  }
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
