#ifndef SHARDD_COMMON_FINGERPRINT_H_
#define SHARDD_COMMON_FINGERPRINT_H_

// 64-bit FNV-1a over bytes the caller feeds in a fixed order. Unlike
// absl::Hash (seeded per process) the value is stable across processes,
// builds and machines, so it can name plans and models on the wire.

#include <cstdint>

#include "absl/strings/string_view.h"

namespace shardd {

class Fingerprint64 {
 public:
  static constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ULL;
  static constexpr uint64_t kPrime = 0x100000001b3ULL;

  // Raw bytes, no length prefix.
  void AddBytes(absl::string_view bytes) {
    for (unsigned char c : bytes) {
      hash_ ^= c;
      hash_ *= kPrime;
    }
  }
  // Little-endian 8 bytes.
  void AddInt(int64_t value) {
    uint64_t v = static_cast<uint64_t>(value);
    for (int i = 0; i < 8; ++i) {
      hash_ ^= (v & 0xff);
      hash_ *= kPrime;
      v >>= 8;
    }
  }
  // Length-prefixed, so consecutive strings cannot run into each other.
  void AddString(absl::string_view s) {
    AddInt(static_cast<int64_t>(s.size()));
    AddBytes(s);
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = kOffsetBasis;
};

}  // namespace shardd

#endif  // SHARDD_COMMON_FINGERPRINT_H_
