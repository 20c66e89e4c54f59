#include "worker/data/sft_source.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data/rng.h"

namespace shardd {
namespace data {

SftSource::SftSource(std::shared_ptr<const SftDataset> data, uint64_t seed)
    : data_(std::move(data)), seed_(seed) {}

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

absl::Status SftSource::FillRow(int64_t index, absl::Span<int32_t> inputs,
                                absl::Span<int32_t> targets) const {
  if (index < 0 || inputs.empty() || inputs.size() != targets.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SFT row ", index, ": needs index >= 0 and equal, non-empty inputs "
        "and targets"));
  }
  const int64_t s = static_cast<int64_t>(inputs.size());
  const int64_t e = Example(index);
  const int64_t n = data_->length(e);
  if (n > s + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        data_->dir(), ": example ", e, " (line ", data_->SourceLine(e),
        ") has ", n, " tokens; a sequence of ", s,
        " holds at most ", s + 1, " (raise --seq, or drop or split the "
        "example)"));
  }
  for (int64_t j = 0; j < s; ++j) {
    const bool real = j + 1 < n;
    inputs[j] = j < n ? data_->Token(e, j) : data_->pad_id();
    targets[j] = real && data_->Counted(e, j + 1) ? data_->Token(e, j + 1) : -1;
  }
  return absl::OkStatus();
}

absl::Status SftSource::Fill(int64_t index, absl::Span<int32_t> out) const {
  if (out.size() < 2) {
    return absl::InvalidArgumentError("SFT sequence: needs at least 2 tokens");
  }
  std::vector<int32_t> targets(out.size() - 1);
  SHARDD_RETURN_IF_ERROR(FillRow(index, out.subspan(0, out.size() - 1),
                                 absl::MakeSpan(targets)));
  const int64_t e = Example(index);
  const int64_t last = static_cast<int64_t>(out.size()) - 1;
  out[last] = last < data_->length(e) ? data_->Token(e, last) : data_->pad_id();
  return absl::OkStatus();
}

uint64_t SftSource::Fingerprint() const {
  return Mix64(data_->fingerprint() ^ Mix64(seed_ + 0x5f7ull));
}

std::string SftSource::Describe() const {
  return absl::StrCat("sft(", data_->dir(), ", ", data_->examples(),
                      " examples, padded, seed=", seed_, ")");
}

}  // namespace data
}  // namespace shardd
