#ifndef SHARDD_WORKER_DATA_RNG_H_
#define SHARDD_WORKER_DATA_RNG_H_

// Small, fully specified PRNG for the data pipeline. std::mt19937 engines
// are portable but the standard distributions are not, so every draw here
// is defined bit for bit: the same (seed, index) gives the same tokens on
// every machine, build and rank.

#include <cstdint>

namespace shardd {
namespace data {

// SplitMix64 output function (Steele, Lea, Flood 2014; Vigna's constants).
// A bijection on 64-bit values with good avalanche.
inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Domain tags for StreamSeed; each use of randomness gets its own.
enum StreamDomain : uint64_t {
  kChainDomain = 1,        // Markov chain construction, index = row.
  kSequenceDomain = 2,     // Markov sequences, index = sequence number.
  kTokenOffsetDomain = 3,  // Token-file window offsets, index = sequence.
  kOrderKPermutation = 4,  // Order-k source's permutation, index 0.
  kOrderKSequence = 5,     // Order-k sequences, index = sequence number.
  kSftEpoch = 6,           // SFT example order, index = epoch.
};

// Seed of an independent stream, keyed by the user seed, a domain tag (so
// chain construction, sequence starts and file offsets never share a
// stream) and an index (sequence number, chain row, ...). Two different
// keys collide with probability about 2^-64.
inline uint64_t StreamSeed(uint64_t seed, uint64_t domain, uint64_t index) {
  uint64_t h = Mix64(seed + 0x9e3779b97f4a7c15ULL * (domain + 1));
  return Mix64(h ^ Mix64(index + 0xd1b54a32d192ed03ULL));
}

// SplitMix64 generator: state advances by the golden gamma, output is
// Mix64(state). Streams seeded with StreamSeed start at unrelated points of
// the 2^64 cycle; two streams of n draws overlap with probability about
// n^2 * streams^2 / 2^64, negligible for training data.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    return Mix64(state_);
  }

  // Uniform double in [0, 1) with 53 random bits.
  double NextDouble() {
    return static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0);
  }

  // Value in [0, n) for n >= 1 by the multiply-high map (Lemire). The bias
  // is below n / 2^64, far below anything a training run can see, and the
  // map needs exactly one draw, which keeps streams easy to reason about.
  uint64_t NextBelow(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(Next()) * n) >>
                                 64);
  }

 private:
  uint64_t state_;
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_RNG_H_
