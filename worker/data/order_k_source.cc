#include "worker/data/order_k_source.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/fingerprint.h"
#include "common/status_macros.h"
#include "worker/data/rng.h"

namespace shardd {
namespace data {
namespace {

double XLogX(double x) { return x > 0 ? x * std::log(x) : 0.0; }

}  // namespace

absl::StatusOr<std::unique_ptr<OrderKSource>> OrderKSource::Create(
    const OrderKOptions& options) {
  if (options.order < 2 || options.order > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("order: must be in [2, 64], got ", options.order));
  }
  if (options.markov_vocab < 2 || options.markov_vocab > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "markov_vocab: must be in [2, 256], got ", options.markov_vocab));
  }
  if (options.lag_vocab < 2 || options.lag_vocab > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lag_vocab: must be in [2, 256], got ", options.lag_vocab));
  }
  if (!(options.keep >= 0.0 && options.keep <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep: must be in [0, 1], got ", options.keep));
  }
  auto source = absl::WrapUnique(new OrderKSource());
  source->options_ = options;
  MarkovOptions markov;
  markov.vocab_size = options.markov_vocab;
  markov.branching = options.markov_branching;
  markov.seed = options.seed;
  SHARDD_ASSIGN_OR_RETURN(MarkovChain chain, MarkovChain::Generate(markov));
  source->chain_ = std::make_shared<const MarkovChain>(std::move(chain));
  // Fisher-Yates with one draw per swap.
  const int64_t vb = options.lag_vocab;
  source->sigma_.resize(vb);
  for (int64_t i = 0; i < vb; ++i) source->sigma_[i] = static_cast<int32_t>(i);
  SplitMix64 rng(StreamSeed(options.seed, kOrderKPermutation, 0));
  for (int64_t i = vb - 1; i > 0; --i) {
    std::swap(source->sigma_[i],
              source->sigma_[rng.NextBelow(static_cast<uint64_t>(i + 1))]);
  }
  const double rest = (1.0 - options.keep) / static_cast<double>(vb - 1);
  source->lag_entropy_ =
      -XLogX(options.keep) - static_cast<double>(vb - 1) * XLogX(rest);
  source->keep_threshold_ =
      options.keep >= 1.0
          ? std::numeric_limits<uint64_t>::max()
          : static_cast<uint64_t>(std::ldexp(options.keep, 64));
  return source;
}

int64_t OrderKSource::vocab_size() const {
  return options_.markov_vocab * options_.lag_vocab;
}

absl::Status OrderKSource::Fill(int64_t index, absl::Span<int32_t> out) const {
  if (index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence index must be >= 0, got ", index));
  }
  if (out.empty()) {
    return absl::InvalidArgumentError("sequence length must be >= 1, got 0");
  }
  SplitMix64 rng(
      StreamSeed(options_.seed, kOrderKSequence, static_cast<uint64_t>(index)));
  const int64_t k = options_.order, vb = options_.lag_vocab;
  int32_t a = chain_->SampleStationary(rng);
  for (size_t t = 0; t < out.size(); ++t) {
    if (t > 0) a = chain_->SampleNext(a, rng);
    int32_t b;
    if (static_cast<int64_t>(t) < k) {
      b = static_cast<int32_t>(rng.NextBelow(static_cast<uint64_t>(vb)));
    } else {
      // keep == 1 copies always (the threshold's one missing value aside).
      const bool copy = options_.keep >= 1.0 || rng.Next() < keep_threshold_;
      const int64_t shift =
          copy ? 0 : 1 + static_cast<int64_t>(
                             rng.NextBelow(static_cast<uint64_t>(vb - 1)));
      // The lagged symbol is the low part of the token k back.
      b = static_cast<int32_t>((sigma_[out[t - k] % vb] + shift) % vb);
    }
    out[t] = static_cast<int32_t>(a * vb + b);
  }
  return absl::OkStatus();
}

uint64_t OrderKSource::Fingerprint() const {
  Fingerprint64 fp;
  fp.AddString("order_k_source");
  fp.AddInt(options_.order);
  fp.AddInt(options_.lag_vocab);
  fp.AddInt(static_cast<int64_t>(keep_threshold_));
  fp.AddInt(static_cast<int64_t>(chain_->fingerprint()));
  fp.AddInt(static_cast<int64_t>(options_.seed));
  return fp.value();
}

std::string OrderKSource::Describe() const {
  return absl::StrFormat(
      "order_k(order=%d, vocab=%d x %d, keep=%g, entropy_rate=%.6f nats, "
      "seed=%d)",
      options_.order, options_.markov_vocab, options_.lag_vocab, options_.keep,
      entropy_rate(), options_.seed);
}

double OrderKSource::entropy_rate() const {
  return chain_->entropy_rate() + lag_entropy_;
}

double OrderKSource::BestLoss(int64_t seq_len) const {
  if (seq_len < 1) return 0.0;
  const double s = static_cast<double>(seq_len);
  const double uniform = std::min<int64_t>(options_.order - 1, seq_len);
  const double lagged = s - uniform;
  return chain_->entropy_rate() +
         (uniform * std::log(static_cast<double>(options_.lag_vocab)) +
          lagged * lag_entropy_) /
             s;
}

double OrderKSource::OneTokenLoss(int64_t seq_len) const {
  if (seq_len < 1) return 0.0;
  return chain_->entropy_rate() +
         std::log(static_cast<double>(options_.lag_vocab));
}

}  // namespace data
}  // namespace shardd
