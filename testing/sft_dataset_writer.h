#ifndef SHARDD_TESTING_SFT_DATASET_WRITER_H_
#define SHARDD_TESTING_SFT_DATASET_WRITER_H_

// Writes a shardd SFT dataset (docs/sft_data.md) the way
// tools/prepare_sft.py does, for C++ tests (test-only target).

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"
#include "xxhash.h"

namespace shardd {
namespace testing_util {

struct SftExample {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;  // 1: the token counts in the loss.
  int64_t line = 0;           // Its JSONL line.
};

namespace sft_internal {

template <typename T>
void Append(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// Megatron MMIDIDX v1 of `lengths` sequences of `width`-byte items.
inline std::string Index(uint8_t dtype, int width,
                         const std::vector<int>& lengths) {
  std::string idx("MMIDIDX\0\0", 9);
  Append<uint64_t>(&idx, 1);
  Append<uint8_t>(&idx, dtype);
  Append<uint64_t>(&idx, lengths.size());
  Append<uint64_t>(&idx, lengths.size() + 1);
  for (int n : lengths) Append<int32_t>(&idx, n);
  int64_t at = 0;
  for (int n : lengths) {
    Append<int64_t>(&idx, at);
    at += int64_t{n} * width;
  }
  for (size_t d = 0; d <= lengths.size(); ++d) Append<int64_t>(&idx, d);
  return idx;
}

inline std::string Hex(const std::string& bytes, size_t begin, size_t n) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(
                    XXH64(bytes.data() + begin, n, 0)));
  return hex;
}

}  // namespace sft_internal

// Writes `examples` into the existing directory `dir`, checksummed over
// chunks of `chunk` bytes; `version` goes into the manifest, and `eos_id`
// when >= 0.
inline void WriteSftDataset(const std::string& dir,
                            const std::vector<SftExample>& examples,
                            int64_t vocab, int64_t chunk = 1 << 20,
                            int version = 1, int64_t eos_id = -1) {
  using sft_internal::Append;
  std::string tokens, mask, lines;
  std::vector<int> lengths;
  for (const SftExample& e : examples) {
    for (int32_t t : e.tokens) Append<int32_t>(&tokens, t);
    for (uint8_t m : e.mask) Append<uint8_t>(&mask, m);
    Append<int64_t>(&lines, e.line);
    lengths.push_back(static_cast<int>(e.tokens.size()));
  }
  const std::vector<std::pair<std::string, std::string>> files = {
      {"tokens.bin", tokens},
      {"tokens.idx", sft_internal::Index(4, 4, lengths)},
      {"loss_mask.bin", mask},
      {"loss_mask.idx", sft_internal::Index(1, 1, lengths)},
      {"source_lines.bin", lines}};
  nlohmann::json m;
  m["format"] = "shardd-sft";
  m["version"] = version;
  m["vocab_size"] = vocab;
  m["pad_id"] = 0;
  if (eos_id >= 0) m["eos_id"] = eos_id;
  m["examples"] = examples.size();
  m["chunk_bytes"] = chunk;
  for (const auto& [name, bytes] : files) {
    std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
    std::vector<std::string> sums;
    for (size_t b = 0; b < bytes.size(); b += chunk) {
      sums.push_back(sft_internal::Hex(
          bytes, b, std::min<size_t>(chunk, bytes.size() - b)));
    }
    m["files"][name] = {{"bytes", bytes.size()}, {"xxh64", sums}};
  }
  std::ofstream(dir + "/shardd_sft.json") << m.dump();
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_SFT_DATASET_WRITER_H_
