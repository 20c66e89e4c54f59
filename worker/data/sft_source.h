#ifndef SHARDD_WORKER_DATA_SFT_SOURCE_H_
#define SHARDD_WORKER_DATA_SFT_SOURCE_H_

// Training rows from a prepared SFT dataset (sft_dataset.h), one example
// per row, padded (docs/sft_data.md): sequence k holds example
// order_p[k mod N] of epoch p = k / N, where order_p is a permutation of
// the N examples drawn from StreamSeed(seed, kSftEpoch, p) (every epoch
// sees every example once). A row of S inputs holds the example's tokens
// t_0..t_{L-2} then pad ids; its targets are t_{j+1} where token j + 1
// counts in the loss (the assistant turns), else -1, and -1 over the
// padding. Causal attention keeps the padding out of every counted
// token's view, so a padded row computes what the example alone does.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "worker/data/sequence_source.h"
#include "worker/data/sft_dataset.h"

namespace shardd {
namespace data {

class SftSource : public SequenceSource {
 public:
  SftSource(std::shared_ptr<const SftDataset> data, uint64_t seed);

  const SftDataset& dataset() const { return *data_; }
  // The example sequence `index` holds.
  int64_t Example(int64_t index) const;

  int64_t vocab_size() const override { return data_->vocab_size(); }
  // The row's inputs followed by its last token (out.size() = S + 1): the
  // tokens of the row, without the loss mask. Errors: as FillRow.
  absl::Status Fill(int64_t index, absl::Span<int32_t> out) const override;
  // Errors: INVALID_ARGUMENT for a negative index, empty or unequal spans,
  // or an example of more than S + 1 tokens (naming the example, its JSONL
  // line and the sequence length).
  absl::Status FillRow(int64_t index, absl::Span<int32_t> inputs,
                       absl::Span<int32_t> targets) const override;
  bool masked() const override { return true; }
  uint64_t Fingerprint() const override;
  std::string Describe() const override;

 private:
  std::shared_ptr<const std::vector<int64_t>> Order(int64_t epoch) const;

  std::shared_ptr<const SftDataset> data_;
  uint64_t seed_;
  mutable absl::Mutex mu_;
  // The last epoch's order, kept: consecutive sequences share it.
  mutable int64_t epoch_ ABSL_GUARDED_BY(mu_) = -1;
  mutable std::shared_ptr<const std::vector<int64_t>> order_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_SFT_SOURCE_H_
