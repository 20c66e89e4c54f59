#ifndef SHARDD_WORKER_DATA_BATCH_SAMPLER_H_
#define SHARDD_WORKER_DATA_BATCH_SAMPLER_H_

// Splits every global batch into deterministic, disjoint per-rank
// micro-batches over a random-access SequenceSource.
//
// Mapping. B = global_batch (sequences per optimizer step), M =
// microbatches, R = ranks (the data-parallel world, dp_shard * dp_replicate;
// the caller numbers ranks 0..R-1), b = B / (R * M) rows per rank and
// micro-batch. Step s reads sequences [s*B, (s+1)*B). Micro-batch-major:
//   micro-batch m of the step = sequences s*B + [m*B/M, (m+1)*B/M),
//   rank r's rows of it       = s*B + m*B/M + [r*b, (r+1)*b).
// So the union over ranks of micro-batch m is the same contiguous block for
// every R: 1, 2 or 4 ranks (or one unsharded process) see exactly the same
// sequences in each micro-batch, which keeps per-micro-batch statistics
// (MoE load balancing, router aux losses) identical across world sizes. The
// step's set of sequences does not depend on M either.
//
// Rows. Each sequence has seq_len + 1 tokens t_0..t_S; its row holds
// inputs t_0..t_{S-1} and targets t_1..t_S.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/data/markov_source.h"
#include "worker/data/sequence_source.h"
#include "worker/data/sft_source.h"
#include "worker/data/token_file.h"

namespace shardd {
namespace data {

struct BatchSamplerOptions {
  int64_t global_batch = 0;  // B >= 1, sequences per optimizer step.
  int64_t seq_len = 0;       // S >= 1, input tokens per row.
  int32_t microbatches = 1;  // M >= 1.
  int32_t ranks = 1;         // R >= 1; B must be divisible by R * M.
  // The model's vocabulary; the source's ids must fit. 0 skips the check.
  int64_t model_vocab_size = 0;
};

// One micro-batch, row-major [rows, seq_len].
struct MicroBatch {
  int64_t rows = 0;
  int64_t seq_len = 0;
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;
  // Global sequence index of each row (for logs and tests).
  std::vector<int64_t> sequence_indices;
  // A masked source (SequenceSource::masked()): the counted targets of the
  // whole step's global batch, every rank and micro-batch (the loss's
  // denominator); 0 otherwise.
  int64_t step_counted = 0;
  // A packed source (SequenceSource::packed()): [rows, seq_len], each
  // position's example start within its row; empty otherwise.
  std::vector<int32_t> segment_starts;
  // DiffusionGemma's SFT rows (SequenceSource::canvas() > 0): each row's
  // response start [rows] and canvas targets [rows, canvas] (-1: not
  // scored), and the scored canvas targets of the step's global batch;
  // empty and 0 otherwise.
  std::vector<int32_t> canvas_starts;
  std::vector<int32_t> canvas_targets;
  int64_t step_canvas_counted = 0;
};

// Where a data stream stands; saved in checkpoints. Resuming at `step`
// reproduces the batches of an uninterrupted run from that step on.
struct DataPosition {
  int64_t step = 0;  // Next optimizer step to read.
  // BatchSampler::fingerprint() of the stream that wrote it.
  uint64_t fingerprint = 0;
};

class BatchSampler {
 public:
  // Errors: INVALID_ARGUMENT when `source` is null, global_batch, seq_len,
  // microbatches or ranks is < 1, global_batch is not divisible by ranks *
  // microbatches (naming all three), or the source's vocabulary exceeds
  // model_vocab_size.
  static absl::StatusOr<BatchSampler> Create(
      std::shared_ptr<const SequenceSource> source,
      const BatchSamplerOptions& options);

  const BatchSamplerOptions& options() const { return options_; }
  const SequenceSource& source() const { return *source_; }
  // b = B / (R * M).
  int64_t rows_per_rank() const { return rows_per_rank_; }
  // B / M, the rows of an all-ranks micro-batch.
  int64_t rows_per_microbatch() const { return rows_per_microbatch_; }

  // The counted targets (not -1) of step `step`'s whole global batch: the
  // same on every rank, computed without communication. Errors: as Fill.
  absl::StatusOr<int64_t> CountedTargets(int64_t step) const;
  // The same count and, into *canvas, the global batch's scored canvas
  // targets (0 for a source without a canvas).
  absl::StatusOr<int64_t> CountedTargets(int64_t step, int64_t* canvas) const;

  // Global sequence index of `row` of (step, rank, microbatch). Errors:
  // INVALID_ARGUMENT naming the argument out of range, or a step so large
  // the index overflows.
  absl::StatusOr<int64_t> SequenceIndex(int64_t step, int32_t rank,
                                        int32_t microbatch, int64_t row) const;

  // Rank `rank`'s slice of micro-batch `microbatch` of `step`. Reuses the
  // buffers of `out`. Thread-safe. Errors: as SequenceIndex and the
  // source's Fill.
  absl::Status Fill(int64_t step, int32_t rank, int32_t microbatch,
                    MicroBatch* out) const;
  absl::StatusOr<MicroBatch> Get(int64_t step, int32_t rank,
                                 int32_t microbatch) const;

  // Unsharded view: all ranks' slices of micro-batch `microbatch` of
  // `step`, concatenated in rank order (B / M rows). Errors: as Fill.
  absl::Status FillAllRanks(int64_t step, int32_t microbatch,
                            MicroBatch* out) const;
  absl::StatusOr<MicroBatch> GetAllRanks(int64_t step,
                                         int32_t microbatch) const;

  // Identifies the stream: the source's fingerprint, global_batch and
  // seq_len. Not ranks or microbatches, which only regroup a step's
  // sequences, so a run may resume on another world size.
  uint64_t fingerprint() const { return fingerprint_; }
  DataPosition PositionAt(int64_t step) const;
  // The step to resume at. Errors: INVALID_ARGUMENT for a negative step;
  // FAILED_PRECONDITION when the position was written by a different
  // stream (other data, seed, global_batch or seq_len).
  absl::StatusOr<int64_t> ResumeStep(const DataPosition& position) const;

 private:
  BatchSampler() = default;
  absl::Status FillRows(int64_t first_sequence, int64_t rows,
                        MicroBatch* out) const;

  std::shared_ptr<const SequenceSource> source_;
  BatchSamplerOptions options_;
  int64_t rows_per_rank_ = 0;
  int64_t rows_per_microbatch_ = 0;
  uint64_t fingerprint_ = 0;
};

// Choosing a source from a training config.
struct DataSourceOptions {
  // Empty: synthetic Markov data. Otherwise an SFT dataset directory
  // (sft_dataset.h) or a token file (see token_file.h).
  std::string path;
  // An SFT dataset's rows: several examples packed per row, or one padded.
  bool packing = true;
  // DiffusionGemma's block-diffusion step: an SFT dataset's rows split
  // into prompt and canvas (sft_source.h; ignored by other sources).
  DiffusionRows diffusion;
  TokenFormat format = TokenFormat::kAuto;
  VocabCheck vocab_check = VocabCheck::kAuto;
  OffsetMode offsets = OffsetMode::kRandom;
  // The model's vocabulary (>= 2).
  int64_t model_vocab_size = 0;
  uint64_t seed = 0;
  // Markov chain shape; its vocab_size 0 means min(model_vocab_size,
  // 65536), its seed is replaced by `seed`.
  MarkovOptions markov = {/*vocab_size=*/0};
  // >= 2 (and no path): the order-k source of order_k_source.h with this
  // order (its vocabulary must fit the model's) instead of the Markov chain.
  int32_t synthetic_order = 0;
};

// Errors: INVALID_ARGUMENT for model_vocab_size < 2 or a Markov or
// order-k vocabulary above it, and the errors of MarkovSource::Create /
// OrderKSource::Create / TokenFileSource::Open.
absl::StatusOr<std::shared_ptr<const SequenceSource>> CreateDataSource(
    const DataSourceOptions& options);

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_BATCH_SAMPLER_H_
