#ifndef SHARDD_WORKER_DATA_SFT_SOURCE_H_
#define SHARDD_WORKER_DATA_SFT_SOURCE_H_

// Training rows from a prepared SFT dataset (sft_dataset.h;
// docs/sft_data.md). Examples come in epochs: epoch p visits the N
// examples in order_p, a permutation drawn from StreamSeed(seed,
// kSftEpoch, p), so every epoch sees each example once.
//
// Padded (packing off): sequence k holds example order_p[k mod N] of epoch
// p = k / N. A row of S inputs holds its tokens t_0..t_{L-2} then pad ids;
// target j is t_{j+1} where that token counts in the loss (the assistant
// turns), else -1, and -1 over the padding. Causal attention keeps the
// padding out of every counted token's view.
//
// Packed (the default): each epoch's examples, in order, are cut greedily
// into rows: an example of L tokens takes L positions (its last token
// predicts nothing), joining the current row while it fits S, else
// starting the next; an example of S + 1 tokens fills a row alone (as
// padded). Sequence k is the k-th row over the epochs. segment_starts
// gives each position its example's first position, so attention and
// RoPE positions stay within the example; the rest of a row is padding
// (targets -1). Rows depend on S; an example longer than S + 1 is
// INVALID_ARGUMENT naming it and its JSONL line.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/data/sequence_source.h"
#include "worker/data/sft_dataset.h"

namespace shardd {
namespace data {

// DiffusionGemma's rows (docs/sft_data.md, "DiffusionGemma"), as NeMo
// AutoModel's dLLM collator makes them: one example per row (never
// packed). The prompt is the example's tokens before its first counted
// one, at P; the response runs from P to the example's end, then the
// dataset's eos_id up to a multiple of `block` (R tokens, counted), then
// pad ids. The encoder's targets are every next token of the P + R (the prompt's too);
// the canvas is the R response tokens, then `canvas` - R rows of padding,
// scored where the dataset counts the token and over the eos fill.
struct DiffusionRows {
  int64_t canvas = 0;  // Canvas rows per sequence; 0: not DiffusionGemma.
  int64_t block = 0;   // Canvas rows per diffusion block.
};

class SftSource : public SequenceSource {
 public:
  SftSource(std::shared_ptr<const SftDataset> data, uint64_t seed,
            bool packing, DiffusionRows diffusion = {});

  const SftDataset& dataset() const { return *data_; }
  bool packing() const { return packing_; }
  // The example sequence `index` holds (padded rows).
  int64_t Example(int64_t index) const;
  // The examples packed row `index` of `seq` positions holds, in order.
  // Errors: as FillRow.
  absl::StatusOr<std::vector<int64_t>> Pack(int64_t index, int64_t seq) const;

  int64_t vocab_size() const override { return data_->vocab_size(); }
  // The row's inputs followed by its last target where it has one, else
  // a pad id (out.size() = S + 1): the row's tokens without the loss mask
  // or segments. Errors: as FillRow.
  absl::Status Fill(int64_t index, absl::Span<int32_t> out) const override;
  // Errors: INVALID_ARGUMENT for a negative index, empty or unequal spans
  // (segment_starts: as long as inputs when packing, else empty), or an
  // example of more than S + 1 tokens (naming the example, its JSONL line
  // and the sequence length).
  absl::Status FillRow(int64_t index, absl::Span<int32_t> inputs,
                       absl::Span<int32_t> targets,
                       absl::Span<int32_t> segment_starts) const override;
  bool masked() const override { return true; }
  int64_t canvas() const override { return diffusion_.canvas; }
  // Errors: as FillRow, and FAILED_PRECONDITION without DiffusionRows.
  absl::Status FillCanvas(int64_t index, int64_t seq, int32_t* start,
                          absl::Span<int32_t> targets) const override;
  bool packed() const override { return packing_; }
  // The first example longer than seq + 1 tokens, as FillRow names it.
  absl::Status CheckSequenceLength(int64_t seq) const override;
  uint64_t Fingerprint() const override;
  std::string Describe() const override;

 private:
  std::shared_ptr<const std::vector<int64_t>> Order(int64_t epoch) const;

  // Epoch p's rows: the positions in order_p where each starts, and N.
  absl::StatusOr<std::shared_ptr<const std::vector<int64_t>>> Rows(
      int64_t epoch, int64_t seq) const;
  absl::Status CheckLength(int64_t example, int64_t seq) const;
  // DiffusionRows' layout of `example`: P and R. INVALID_ARGUMENT naming
  // the example and its line when it counts no token or P + R exceeds seq
  // or R the canvas, FAILED_PRECONDITION for a dataset without eos_id.
  struct Split {
    int64_t prompt = 0, response = 0;
  };
  absl::StatusOr<Split> DiffusionSplit(int64_t example, int64_t seq) const;
  absl::Status FillDiffusionRow(int64_t example, absl::Span<int32_t> inputs,
                                absl::Span<int32_t> targets) const;

  std::shared_ptr<const SftDataset> data_;
  uint64_t seed_;
  bool packing_;
  DiffusionRows diffusion_;
  mutable absl::Mutex mu_;
  // The last epoch's order, kept: consecutive sequences share it.
  mutable int64_t epoch_ ABSL_GUARDED_BY(mu_) = -1;
  mutable std::shared_ptr<const std::vector<int64_t>> order_
      ABSL_GUARDED_BY(mu_);
  // Packing for rows of rows_seq_ positions: cumulative rows through each
  // epoch, and the last epoch's row starts.
  mutable int64_t rows_seq_ ABSL_GUARDED_BY(mu_) = -1;
  mutable std::vector<int64_t> rows_through_ ABSL_GUARDED_BY(mu_);
  mutable int64_t rows_epoch_ ABSL_GUARDED_BY(mu_) = -1;
  mutable std::shared_ptr<const std::vector<int64_t>> rows_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_SFT_SOURCE_H_
