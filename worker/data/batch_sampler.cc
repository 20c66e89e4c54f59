#include "worker/data/batch_sampler.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/fingerprint.h"
#include "common/status_macros.h"
#include "worker/data/order_k_source.h"
#include "worker/data/sft_dataset.h"
#include "worker/data/sft_source.h"

namespace shardd {
namespace data {

absl::StatusOr<BatchSampler> BatchSampler::Create(
    std::shared_ptr<const SequenceSource> source,
    const BatchSamplerOptions& options) {
  if (source == nullptr) {
    return absl::InvalidArgumentError("source must not be null");
  }
  if (options.global_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_batch must be >= 1, got ", options.global_batch));
  }
  if (options.seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len must be >= 1, got ", options.seq_len));
  }
  if (options.microbatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatches must be >= 1, got ", options.microbatches));
  }
  if (options.ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ranks must be >= 1, got ", options.ranks));
  }
  const int64_t slices = int64_t{options.ranks} * options.microbatches;
  if (options.global_batch % slices != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "global_batch (", options.global_batch,
        ") must be divisible by ranks (", options.ranks, ") * microbatches (",
        options.microbatches, ") = ", slices));
  }
  if (options.model_vocab_size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model_vocab_size must be >= 0 (0 skips the check), got ",
                     options.model_vocab_size));
  }
  if (options.model_vocab_size > 0 &&
      source->vocab_size() > options.model_vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("model_vocab_size ", options.model_vocab_size,
                     " is smaller than the data's vocabulary ",
                     source->vocab_size(), " (", source->Describe(), ")"));
  }
  BatchSampler sampler;
  sampler.source_ = std::move(source);
  sampler.options_ = options;
  sampler.rows_per_rank_ = options.global_batch / slices;
  sampler.rows_per_microbatch_ = options.global_batch / options.microbatches;
  Fingerprint64 fp;
  fp.AddString("batch_sampler");
  fp.AddInt(static_cast<int64_t>(sampler.source_->Fingerprint()));
  fp.AddInt(options.global_batch);
  fp.AddInt(options.seq_len);
  sampler.fingerprint_ = fp.value();
  return sampler;
}

absl::StatusOr<int64_t> BatchSampler::SequenceIndex(int64_t step, int32_t rank,
                                                    int32_t microbatch,
                                                    int64_t row) const {
  if (step < 0 ||
      step > std::numeric_limits<int64_t>::max() / options_.global_batch - 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step must be in [0, ",
        std::numeric_limits<int64_t>::max() / options_.global_batch - 1,
        "], got ", step));
  }
  if (rank < 0 || rank >= options_.ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank must be in [0, ", options_.ranks, "), got ", rank));
  }
  if (microbatch < 0 || microbatch >= options_.microbatches) {
    return absl::InvalidArgumentError(absl::StrCat("microbatch must be in [0, ",
                                                   options_.microbatches,
                                                   "), got ", microbatch));
  }
  if (row < 0 || row >= rows_per_rank_) {
    return absl::InvalidArgumentError(
        absl::StrCat("row must be in [0, ", rows_per_rank_, "), got ", row));
  }
  return step * options_.global_batch + microbatch * rows_per_microbatch_ +
         rank * rows_per_rank_ + row;
}

absl::Status BatchSampler::FillRows(int64_t first_sequence, int64_t rows,
                                    MicroBatch* out) const {
  const int64_t s = options_.seq_len;
  out->rows = rows;
  out->seq_len = s;
  out->inputs.resize(rows * s);
  out->targets.resize(rows * s);
  out->sequence_indices.resize(rows);
  const bool packed = source_->packed();
  out->segment_starts.resize(packed ? rows * s : 0);
  const int64_t canvas = source_->canvas();
  out->canvas_starts.resize(canvas > 0 ? rows : 0);
  out->canvas_targets.resize(rows * canvas);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t index = first_sequence + r;
    SHARDD_RETURN_IF_ERROR(source_->FillRow(
        index, absl::MakeSpan(out->inputs).subspan(r * s, s),
        absl::MakeSpan(out->targets).subspan(r * s, s),
        packed ? absl::MakeSpan(out->segment_starts).subspan(r * s, s)
               : absl::Span<int32_t>()));
    out->sequence_indices[r] = index;
    if (canvas > 0) {
      SHARDD_RETURN_IF_ERROR(source_->FillCanvas(
          index, s, &out->canvas_starts[r],
          absl::MakeSpan(out->canvas_targets).subspan(r * canvas, canvas)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> BatchSampler::CountedTargets(int64_t step) const {
  int64_t canvas = 0;
  return CountedTargets(step, &canvas);
}

absl::StatusOr<int64_t> BatchSampler::CountedTargets(int64_t step,
                                                     int64_t* canvas) const {
  int64_t counted = 0;
  *canvas = 0;
  MicroBatch batch;
  for (int32_t m = 0; m < options_.microbatches; ++m) {
    SHARDD_RETURN_IF_ERROR(FillAllRanks(step, m, &batch));
    for (int32_t t : batch.targets) counted += t >= 0;
    for (int32_t t : batch.canvas_targets) *canvas += t >= 0;
  }
  return counted;
}

absl::Status BatchSampler::Fill(int64_t step, int32_t rank, int32_t microbatch,
                                MicroBatch* out) const {
  SHARDD_ASSIGN_OR_RETURN(int64_t first,
                          SequenceIndex(step, rank, microbatch, 0));
  return FillRows(first, rows_per_rank_, out);
}

absl::StatusOr<MicroBatch> BatchSampler::Get(int64_t step, int32_t rank,
                                             int32_t microbatch) const {
  MicroBatch batch;
  SHARDD_RETURN_IF_ERROR(Fill(step, rank, microbatch, &batch));
  return batch;
}

absl::Status BatchSampler::FillAllRanks(int64_t step, int32_t microbatch,
                                        MicroBatch* out) const {
  // Rank 0's first row starts the block; ranks follow contiguously.
  SHARDD_ASSIGN_OR_RETURN(int64_t first,
                          SequenceIndex(step, /*rank=*/0, microbatch, 0));
  return FillRows(first, rows_per_microbatch_, out);
}

absl::StatusOr<MicroBatch> BatchSampler::GetAllRanks(int64_t step,
                                                     int32_t microbatch) const {
  MicroBatch batch;
  SHARDD_RETURN_IF_ERROR(FillAllRanks(step, microbatch, &batch));
  return batch;
}

DataPosition BatchSampler::PositionAt(int64_t step) const {
  DataPosition position;
  position.step = step;
  position.fingerprint = fingerprint_;
  return position;
}

absl::StatusOr<int64_t> BatchSampler::ResumeStep(
    const DataPosition& position) const {
  if (position.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data position step must be >= 0, got ", position.step));
  }
  if (position.fingerprint != fingerprint_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "data position was saved by a different data stream (fingerprint ",
        position.fingerprint, ", this stream ", fingerprint_, ": ",
        source_->Describe(), ", global_batch ", options_.global_batch,
        ", seq_len ", options_.seq_len, ")"));
  }
  return position.step;
}

absl::StatusOr<std::shared_ptr<const SequenceSource>> CreateDataSource(
    const DataSourceOptions& options) {
  if (options.model_vocab_size < 2 ||
      options.model_vocab_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model_vocab_size must be in [2, 2147483647], got ",
                     options.model_vocab_size));
  }
  if (!options.path.empty() && SftDataset::IsDataset(options.path)) {
    SHARDD_ASSIGN_OR_RETURN(
        std::unique_ptr<SftDataset> dataset,
        SftDataset::Open(options.path, options.model_vocab_size));
    return std::shared_ptr<const SequenceSource>(std::make_shared<SftSource>(
        std::shared_ptr<const SftDataset>(std::move(dataset)), options.seed,
        options.packing, options.diffusion));
  }
  if (!options.path.empty()) {
    TokenFileOptions file_options;
    file_options.format = options.format;
    file_options.vocab_size = options.model_vocab_size;
    file_options.vocab_check = options.vocab_check;
    TokenSourceOptions source_options;
    source_options.seed = options.seed;
    source_options.offsets = options.offsets;
    SHARDD_ASSIGN_OR_RETURN(
        std::unique_ptr<TokenFileSource> source,
        TokenFileSource::Open(options.path, file_options, source_options));
    return std::shared_ptr<const SequenceSource>(std::move(source));
  }
  if (options.synthetic_order >= 2) {
    OrderKOptions order_k;
    order_k.order = options.synthetic_order;
    order_k.seed = options.seed;
    SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<OrderKSource> source,
                            OrderKSource::Create(order_k));
    if (source->vocab_size() > options.model_vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "synthetic_order: the order-k source's vocabulary (",
          source->vocab_size(), ") must be <= the model's (",
          options.model_vocab_size, ")"));
    }
    return std::shared_ptr<const SequenceSource>(std::move(source));
  }
  MarkovOptions markov = options.markov;
  markov.seed = options.seed;
  if (markov.vocab_size == 0) {
    markov.vocab_size =
        std::min<int64_t>(options.model_vocab_size, MarkovChain::kMaxVocab);
  }
  if (markov.vocab_size > options.model_vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "markov vocab_size (", markov.vocab_size,
        ") must be <= model_vocab_size (", options.model_vocab_size, ")"));
  }
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<MarkovSource> source,
                          MarkovSource::Create(markov));
  return std::shared_ptr<const SequenceSource>(std::move(source));
}

}  // namespace data
}  // namespace shardd
