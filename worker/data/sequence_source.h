#ifndef SHARDD_WORKER_DATA_SEQUENCE_SOURCE_H_
#define SHARDD_WORKER_DATA_SEQUENCE_SOURCE_H_

// A random-access source of token sequences. Sequence k depends only on the
// source's configuration (seed included) and k, never on which sequences
// were read before, so every rank can produce exactly its slice of a global
// batch with no communication and an unsharded process can reproduce the
// whole batch.

#include <cstdint>
#include <string>

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
