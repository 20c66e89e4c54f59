#ifndef SHARDD_WORKER_DATA_SEQUENCE_SOURCE_H_
#define SHARDD_WORKER_DATA_SEQUENCE_SOURCE_H_

// A random-access source of token sequences. Sequence k depends only on the
// source's configuration (seed included) and k, never on which sequences
// were read before, so every rank can produce exactly its slice of a global
// batch with no communication and an unsharded process can reproduce the
// whole batch.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace shardd {
namespace data {

class SequenceSource {
 public:
  virtual ~SequenceSource() = default;

  // Token ids lie in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;

  // Writes sequence `index` (>= 0), out.size() tokens long, into `out`.
  // Thread-safe. Errors: INVALID_ARGUMENT for a negative index, an empty
  // `out` or a length the source cannot serve, and source-specific errors
  // (see the implementations).
  virtual absl::Status Fill(int64_t index, absl::Span<int32_t> out) const = 0;

  // Sequence `index` as a training row of S = inputs.size() positions:
  // inputs and targets (-1: not counted in the loss), and for a packed
  // source (packed()) segment_starts, each position's example start in the
  // row (empty for other sources). By default the S + 1 tokens of Fill,
  // targets shifted by one, all counted; a source with a loss mask
  // (masked()) overrides it. Errors: as Fill.
  virtual absl::Status FillRow(int64_t index, absl::Span<int32_t> inputs,
                               absl::Span<int32_t> targets,
                               absl::Span<int32_t> segment_starts) const {
    if (inputs.empty() || inputs.size() != targets.size() ||
        !segment_starts.empty()) {
      return absl::InvalidArgumentError(
          "FillRow: inputs and targets must be equal and non-empty, "
          "segment_starts empty");
    }
    std::vector<int32_t> tokens(inputs.size() + 1);
    const absl::Status filled = Fill(index, absl::MakeSpan(tokens));
    if (!filled.ok()) return filled;
    std::copy(tokens.begin(), tokens.end() - 1, inputs.begin());
    std::copy(tokens.begin() + 1, tokens.end(), targets.begin());
    return absl::OkStatus();
  }
  // Whether FillRow leaves targets out of the loss (so the loss's
  // denominator depends on the batch).
  virtual bool masked() const { return false; }
  // Whether rows hold several sequences (FillRow's segment_starts).
  virtual bool packed() const { return false; }
  // DiffusionGemma's SFT rows (sft_source.h's DiffusionRows): the canvas
  // rows of each sequence, 0 for other sources; and sequence `index`'s
  // canvas for rows of `seq` positions: where its response starts and
  // targets.size() == canvas() tokens, the scored ones (-1: not scored).
  virtual int64_t canvas() const { return 0; }
  virtual absl::Status FillCanvas(int64_t index, int64_t seq, int32_t* start,
                                  absl::Span<int32_t> targets) const {
    return absl::FailedPreconditionError(
        "FillCanvas: this source has no DiffusionGemma canvas");
  }
  // Whether every row of `seq` positions can be filled, checked once
  // before training (a source of examples: none longer than seq + 1).
  // Errors: INVALID_ARGUMENT naming what does not fit.
  virtual absl::Status CheckSequenceLength(int64_t seq) const {
    return absl::OkStatus();
  }

  // Stable across processes and machines; changes whenever the sequences
  // would. Lets a checkpoint detect a resume onto different data.
  virtual uint64_t Fingerprint() const = 0;

  // One line for logs, e.g. "markov(vocab=256, branching=4, seed=1)".
  virtual std::string Describe() const = 0;

  // The least mean next-token cross-entropy (nats) any model can reach on
  // sequences of seq_len + 1 tokens (seq_len targets), when the source
  // knows it exactly; 0 otherwise (token files).
  virtual double BestLoss(int64_t seq_len) const { return 0.0; }
  // The same for a model that sees only the previous token (an
  // attention-free one): the conditional entropy given one token; 0 when
  // unknown.
  virtual double OneTokenLoss(int64_t seq_len) const { return 0.0; }
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_SEQUENCE_SOURCE_H_
