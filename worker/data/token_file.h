#ifndef SHARDD_WORKER_DATA_TOKEN_FILE_H_
#define SHARDD_WORKER_DATA_TOKEN_FILE_H_

// Real training data from token files.
//
// Formats (TokenFormat):
//   kUint16 / kUint32: a flat array of little-endian token ids, no header
//     (the nanoGPT train.bin / Megatron convention).
//   kBytes: any file, each byte one token (plain text; vocab 256).
//   kAuto: inferred from the name: ".u16" -> kUint16, ".u32" -> kUint32,
//     ".bin" -> kUint16 (nanoGPT writes uint16 .bin files; name a uint32
//     file .u32 or pass the format), ".txt" / ".text" -> kBytes; any other
//     name is INVALID_ARGUMENT asking for an explicit format.
// The file is memory-mapped read-only and unmapped when the TokenFile goes.
//
// Vocabulary check (VocabCheck): every id must be < vocab_size.
//   kUpfront: Open scans the whole file and fails on the first bad id.
//   kLazy: each Read checks the ids it copies (errors surface per sample).
//   kAuto: kUpfront for files of at most kUpfrontCheckMaxTokens tokens
//     (about 0.1 s of scanning), kLazy above.
// A bad id is INVALID_ARGUMENT naming the path, the token offset, the byte
// offset and the value.
//
// Sequences (TokenFileSource): sequence k of length L is the window
// [off_k, off_k + L) with
//   kRandom (default): off_k uniform in [0, N - L], drawn from the stream
//     SplitMix64(StreamSeed(seed, kTokenOffsetDomain, k)) with one
//     multiply-high draw. Windows may overlap; sampling is with replacement.
//   kStrided: stride = L - 1 (the last target of window k is the first
//     input of window k + 1), W = (N - L) / stride + 1 windows, and
//     off_k = (k mod W) * stride: epochs walk the file in order.
// Both are pure functions of (seed, k, L): random access, no state.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/data/mapped_file.h"
#include "worker/data/sequence_source.h"

namespace shardd {
namespace data {

enum class TokenFormat { kAuto, kUint16, kUint32, kBytes };
enum class VocabCheck { kAuto, kUpfront, kLazy };
enum class OffsetMode { kRandom, kStrided };

// "auto", "u16"/"uint16", "u32"/"uint32", "bytes"/"text". Errors:
// INVALID_ARGUMENT naming the allowed values.
absl::StatusOr<TokenFormat> ParseTokenFormat(absl::string_view name);
// Format from the file name (see above). Errors: INVALID_ARGUMENT naming
// the path and the recognised suffixes.
absl::StatusOr<TokenFormat> InferTokenFormat(absl::string_view path);
// "auto", "uint16", "uint32", "bytes".
const char* TokenFormatName(TokenFormat format);
// Bytes per token: 2, 4, 1; 0 for kAuto.
int TokenWidth(TokenFormat format);

struct TokenFileOptions {
  TokenFormat format = TokenFormat::kAuto;
  // The model's vocabulary; ids must be below it. 0 means the format's own
  // bound: 256 for kBytes, 65536 for kUint16; a kUint32 file needs it set.
  int64_t vocab_size = 0;
  VocabCheck vocab_check = VocabCheck::kAuto;
};

class TokenFile {
 public:
  static constexpr int64_t kUpfrontCheckMaxTokens = int64_t{1} << 26;

  // Maps `path`. Errors: INVALID_ARGUMENT for a format that cannot be
  // inferred, vocab_size < 0 or > 2^31 - 1 (or 0 with kUint32), an empty
  // file, a size that is not a multiple of the token width (naming the
  // path), or (upfront check) an id >= vocab_size; NOT_FOUND /
  // PERMISSION_DENIED / other errno codes when the file cannot be opened or
  // mapped.
  static absl::StatusOr<std::unique_ptr<TokenFile>> Open(
      const std::string& path, const TokenFileOptions& options);

  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  TokenFormat format() const { return format_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t vocab_size() const { return vocab_size_; }
  // True when Open verified every id, so Read skips the check.
  bool checked_upfront() const { return checked_upfront_; }
  // Stable content fingerprint: format, size, vocab_size and the first and
  // last 4 KiB (hashing a multi-GB file would cost seconds per open).
  uint64_t fingerprint() const { return fingerprint_; }

  // Token `index` in [0, num_tokens()), unchecked against the vocabulary.
  uint32_t Token(int64_t index) const;

  // Copies tokens [offset, offset + out.size()) into `out`. Errors:
  // OUT_OF_RANGE when the window leaves the file; INVALID_ARGUMENT naming
  // the offset and value of an id >= vocab_size (lazy check).
  absl::Status Read(int64_t offset, absl::Span<int32_t> out) const;

 private:
  TokenFile() = default;
  // First id >= vocab_size_ in [begin, end) as an error, or OK.
  absl::Status CheckRange(int64_t begin, int64_t end) const;

  std::string path_;
  TokenFormat format_ = TokenFormat::kAuto;
  int width_ = 0;
  std::unique_ptr<MappedFile> mapped_;
  const unsigned char* data_ = nullptr;
  size_t mapped_bytes_ = 0;
  int64_t num_tokens_ = 0;
  int64_t vocab_size_ = 0;
  bool checked_upfront_ = false;
  uint64_t fingerprint_ = 0;
};

struct TokenSourceOptions {
  uint64_t seed = 0;
  OffsetMode offsets = OffsetMode::kRandom;
};

class TokenFileSource : public SequenceSource {
 public:
  // Opens the file (errors: as TokenFile::Open) and wraps it.
  static absl::StatusOr<std::unique_ptr<TokenFileSource>> Open(
      const std::string& path, const TokenFileOptions& file_options,
      const TokenSourceOptions& source_options);

  TokenFileSource(std::shared_ptr<const TokenFile> file,
                  const TokenSourceOptions& options);

  const TokenFile& file() const { return *file_; }

  // Window start of sequence `index` for sequences of `length` tokens.
  // Errors: INVALID_ARGUMENT for index < 0, length < 1, or a length above
  // the file's token count (naming the path).
  absl::StatusOr<int64_t> Offset(int64_t index, int64_t length) const;

  int64_t vocab_size() const override { return file_->vocab_size(); }
  // Errors: as Offset and TokenFile::Read.
  absl::Status Fill(int64_t index, absl::Span<int32_t> out) const override;
  uint64_t Fingerprint() const override;
  std::string Describe() const override;

 private:
  std::shared_ptr<const TokenFile> file_;
  TokenSourceOptions options_;
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_TOKEN_FILE_H_
