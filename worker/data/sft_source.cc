#include "worker/data/sft_source.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data/rng.h"

namespace shardd {
namespace data {

SftSource::SftSource(std::shared_ptr<const SftDataset> data, uint64_t seed,
                     bool packing, DiffusionRows diffusion)
    : data_(std::move(data)),
      seed_(seed),
      packing_(packing && diffusion.canvas == 0),
      diffusion_(diffusion) {}

std::shared_ptr<const std::vector<int64_t>> SftSource::Order(
    int64_t epoch) const {
  absl::MutexLock lock(&mu_);
  if (epoch_ == epoch) return order_;
  auto order = std::make_shared<std::vector<int64_t>>(data_->examples());
  std::iota(order->begin(), order->end(), 0);
  // Fisher-Yates with the epoch's own stream.
  SplitMix64 rng(StreamSeed(seed_, kSftEpoch, static_cast<uint64_t>(epoch)));
  for (int64_t i = static_cast<int64_t>(order->size()) - 1; i > 0; --i) {
    std::swap((*order)[i], (*order)[rng.NextBelow(i + 1)]);
  }
  epoch_ = epoch;
  order_ = std::move(order);
  return order_;
}

int64_t SftSource::Example(int64_t index) const {
  const int64_t n = data_->examples();
  return (*Order(index / n))[index % n];
}

absl::Status SftSource::CheckLength(int64_t e, int64_t seq) const {
  const int64_t n = data_->length(e);
  if (n > seq + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        data_->dir(), ": example ", e, " (line ", data_->SourceLine(e),
        ") has ", n, " tokens; a sequence of ", seq, " holds at most ",
        seq + 1, " (raise --seq, or drop or split the example)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SftSource::Split> SftSource::DiffusionSplit(
    int64_t e, int64_t seq) const {
  if (data_->eos_id() < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        data_->dir(), "/shardd_sft.json has no eos_id; DiffusionGemma pads "
        "each response with EOS to its blocks (prepare the dataset again "
        "with tools/prepare_sft.py)"));
  }
  const int64_t n = data_->length(e);
  Split split;
  while (split.prompt < n && !data_->Counted(e, split.prompt)) ++split.prompt;
  const std::string where = absl::StrCat(data_->dir(), ": example ", e,
                                         " (line ", data_->SourceLine(e), ")");
  if (split.prompt == n) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " counts no token; DiffusionGemma's canvas is the response"));
  }
  const int64_t b = diffusion_.block;
  split.response = (n - split.prompt + b - 1) / b * b;
  if (split.prompt + split.response > seq) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": its prompt (", split.prompt, " tokens) and response (",
        n - split.prompt, ", padded with EOS to blocks of ", b, ": ",
        split.response, ") need ", split.prompt + split.response,
        " positions; a sequence has ", seq, " (raise --seq)"));
  }
  if (split.response > diffusion_.canvas) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": its response needs ", split.response,
        " canvas rows (padded with EOS to blocks of ", b, "); the canvas has ",
        diffusion_.canvas, " (raise --response-length)"));
  }
  return split;
}

absl::Status SftSource::FillDiffusionRow(int64_t e,
                                         absl::Span<int32_t> inputs,
                                         absl::Span<int32_t> targets) const {
  const int64_t s = static_cast<int64_t>(inputs.size());
  SHARDD_ASSIGN_OR_RETURN(const Split split, DiffusionSplit(e, s));
  const int64_t n = data_->length(e);
  const int64_t valid = split.prompt + split.response;
  for (int64_t j = 0; j < s; ++j) {
    inputs[j] = j < n       ? data_->Token(e, j)
                : j < valid ? data_->eos_id()
                            : data_->pad_id();
  }
  for (int64_t j = 0; j < s; ++j) {
    targets[j] = j + 1 < valid ? inputs[j + 1] : -1;
  }
  return absl::OkStatus();
}

absl::Status SftSource::FillCanvas(int64_t index, int64_t seq, int32_t* start,
                                   absl::Span<int32_t> targets) const {
  if (diffusion_.canvas == 0) {
    return SequenceSource::FillCanvas(index, seq, start, targets);
  }
  if (index < 0 ||
      static_cast<int64_t>(targets.size()) != diffusion_.canvas) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SFT canvas ", index, ": needs index >= 0 and ", diffusion_.canvas,
        " targets, got ", targets.size()));
  }
  const int64_t e = Example(index);
  SHARDD_ASSIGN_OR_RETURN(const Split split, DiffusionSplit(e, seq));
  const int64_t n = data_->length(e);
  *start = static_cast<int32_t>(split.prompt);
  for (int64_t j = 0; j < diffusion_.canvas; ++j) {
    const int64_t p = split.prompt + j;
    targets[j] = j >= split.response ? -1
                 : p >= n            ? data_->eos_id()
                 : data_->Counted(e, p) ? data_->Token(e, p)
                                        : -1;
  }
  return absl::OkStatus();
}

absl::Status SftSource::CheckSequenceLength(int64_t seq) const {
  if (diffusion_.canvas > 0) {
    for (int64_t e = 0; e < data_->examples(); ++e) {
      SHARDD_RETURN_IF_ERROR(DiffusionSplit(e, seq).status());
    }
    return absl::OkStatus();
  }
  if (data_->max_length() <= seq + 1) return absl::OkStatus();
  for (int64_t e = 0; e < data_->examples(); ++e) {
    SHARDD_RETURN_IF_ERROR(CheckLength(e, seq));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const std::vector<int64_t>>> SftSource::Rows(
    int64_t epoch, int64_t seq) const {
  {
    absl::MutexLock lock(&mu_);
    if (rows_seq_ == seq && rows_epoch_ == epoch) return rows_;
  }
  const std::shared_ptr<const std::vector<int64_t>> order = Order(epoch);
  const int64_t n = static_cast<int64_t>(order->size());
  auto starts = std::make_shared<std::vector<int64_t>>(1, 0);
  int64_t used = 0;  // Positions taken in the current row.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = (*order)[i];
    SHARDD_RETURN_IF_ERROR(CheckLength(e, seq));
    const int64_t len = data_->length(e);
    if (len == seq + 1) {
      // A row of its own, its last token a target only.
      if (used > 0) starts->push_back(i);
      starts->push_back(i + 1);
      used = 0;
    } else if (used + len > seq) {
      starts->push_back(i);
      used = len;
    } else {
      used += len;
    }
  }
  if (starts->back() != n) starts->push_back(n);
  absl::MutexLock lock(&mu_);
  if (rows_seq_ != seq) {
    rows_seq_ = seq;
    rows_through_.clear();
  }
  rows_epoch_ = epoch;
  rows_ = std::move(starts);
  return rows_;
}

absl::StatusOr<std::vector<int64_t>> SftSource::Pack(int64_t index,
                                                     int64_t seq) const {
  int64_t epoch = 0, before = 0;
  {
    absl::MutexLock lock(&mu_);
    if (rows_seq_ == seq && !rows_through_.empty()) {
      const auto it = std::upper_bound(rows_through_.begin(),
                                       rows_through_.end(), index);
      epoch = it - rows_through_.begin();
      before = epoch == 0 ? 0 : rows_through_[epoch - 1];
    }
  }
  for (;; ++epoch) {
    SHARDD_ASSIGN_OR_RETURN(const std::shared_ptr<const std::vector<int64_t>> rows,
                            Rows(epoch, seq));
    const int64_t count = static_cast<int64_t>(rows->size()) - 1;
    {
      absl::MutexLock lock(&mu_);
      if (rows_seq_ == seq &&
          static_cast<int64_t>(rows_through_.size()) == epoch) {
        rows_through_.push_back(before + count);
      }
    }
    if (index < before + count) {
      const std::shared_ptr<const std::vector<int64_t>> order = Order(epoch);
      const int64_t r = index - before;
      return std::vector<int64_t>(order->begin() + (*rows)[r],
                                  order->begin() + (*rows)[r + 1]);
    }
    before += count;
  }
}

absl::Status SftSource::FillRow(int64_t index, absl::Span<int32_t> inputs,
                                absl::Span<int32_t> targets,
                                absl::Span<int32_t> segment_starts) const {
  if (index < 0 || inputs.empty() || inputs.size() != targets.size() ||
      segment_starts.size() != (packing_ ? inputs.size() : 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SFT row ", index, ": needs index >= 0, equal non-empty inputs and "
        "targets, and segment_starts ", packing_ ? "as long" : "empty"));
  }
  const int64_t s = static_cast<int64_t>(inputs.size());
  if (diffusion_.canvas > 0) {
    return FillDiffusionRow(Example(index), inputs, targets);
  }
  std::vector<int64_t> examples;
  if (packing_) {
    SHARDD_ASSIGN_OR_RETURN(examples, Pack(index, s));
  } else {
    examples.push_back(Example(index));
    SHARDD_RETURN_IF_ERROR(CheckLength(examples[0], s));
  }
  int64_t pos = 0;
  for (const int64_t e : examples) {
    const int64_t n = data_->length(e);
    const int64_t take = std::min(n, s);
    for (int64_t j = 0; j < take; ++j) {
      inputs[pos + j] = data_->Token(e, j);
      targets[pos + j] =
          j + 1 < n && data_->Counted(e, j + 1) ? data_->Token(e, j + 1) : -1;
      if (packing_) segment_starts[pos + j] = static_cast<int32_t>(pos);
    }
    pos += take;
  }
  const int64_t pad_start = pos;
  for (; pos < s; ++pos) {
    inputs[pos] = data_->pad_id();
    targets[pos] = -1;
    if (packing_) segment_starts[pos] = static_cast<int32_t>(pad_start);
  }
  return absl::OkStatus();
}

absl::Status SftSource::Fill(int64_t index, absl::Span<int32_t> out) const {
  if (out.size() < 2) {
    return absl::InvalidArgumentError("SFT sequence: needs at least 2 tokens");
  }
  const size_t s = out.size() - 1;
  std::vector<int32_t> targets(s), starts(packing_ ? s : 0);
  SHARDD_RETURN_IF_ERROR(FillRow(index, out.subspan(0, s),
                                 absl::MakeSpan(targets),
                                 absl::MakeSpan(starts)));
  // The row's last target, where there is one, else a pad id.
  out[s] = targets[s - 1] >= 0 ? targets[s - 1] : data_->pad_id();
  return absl::OkStatus();
}

uint64_t SftSource::Fingerprint() const {
  uint64_t fp = Mix64(data_->fingerprint() ^ Mix64(seed_ + 0x5f7ull) ^
                      (packing_ ? 0x9acce5ull : 0));
  if (diffusion_.canvas > 0) {
    fp = Mix64(fp ^ Mix64(static_cast<uint64_t>(diffusion_.canvas) * 0x1f3ull +
                          static_cast<uint64_t>(diffusion_.block)));
  }
  return fp;
}

std::string SftSource::Describe() const {
  return absl::StrCat("sft(", data_->dir(), ", ", data_->examples(),
                      " examples, ",
                      diffusion_.canvas > 0
                          ? absl::StrCat("prompt + canvas of ",
                                         diffusion_.canvas)
                      : packing_ ? "packed"
                                 : "padded",
                      ", seed=", seed_, ")");
}

}  // namespace data
}  // namespace shardd
