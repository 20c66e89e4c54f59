#include "worker/data/token_file.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/fingerprint.h"
#include "common/status_macros.h"
#include "worker/data/rng.h"

namespace shardd {
namespace data {
namespace {

constexpr size_t kFingerprintSampleBytes = 4096;

// Decodes little-endian ids byte by byte, so the result does not depend on
// the host's byte order (compilers turn this into one load on x86/ARM).
inline uint32_t DecodeToken(const unsigned char* data, int width,
                            int64_t index) {
  const unsigned char* p = data + index * width;
  switch (width) {
    case 1:
      return p[0];
    case 2:
      return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
    default:
      return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
             (static_cast<uint32_t>(p[2]) << 16) |
             (static_cast<uint32_t>(p[3]) << 24);
  }
}

}  // namespace

absl::StatusOr<TokenFormat> ParseTokenFormat(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "auto") return TokenFormat::kAuto;
  if (lower == "u16" || lower == "uint16") return TokenFormat::kUint16;
  if (lower == "u32" || lower == "uint32") return TokenFormat::kUint32;
  if (lower == "bytes" || lower == "text") return TokenFormat::kBytes;
  return absl::InvalidArgumentError(
      absl::StrCat("token format must be one of auto, u16, uint16, u32, "
                   "uint32, bytes, text; got \"",
                   name, "\""));
}

absl::StatusOr<TokenFormat> InferTokenFormat(absl::string_view path) {
  if (absl::EndsWithIgnoreCase(path, ".u16") ||
      absl::EndsWithIgnoreCase(path, ".bin")) {
    return TokenFormat::kUint16;
  }
  if (absl::EndsWithIgnoreCase(path, ".u32")) return TokenFormat::kUint32;
  if (absl::EndsWithIgnoreCase(path, ".txt") ||
      absl::EndsWithIgnoreCase(path, ".text")) {
    return TokenFormat::kBytes;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "token file ", path,
      ": cannot infer the token format from the name (known suffixes: .u16, "
      ".bin = uint16, .u32 = uint32, .txt, .text = bytes); pass the format "
      "explicitly"));
}

const char* TokenFormatName(TokenFormat format) {
  switch (format) {
    case TokenFormat::kAuto:
      return "auto";
    case TokenFormat::kUint16:
      return "uint16";
    case TokenFormat::kUint32:
      return "uint32";
    case TokenFormat::kBytes:
      return "bytes";
  }
  return "unknown";
}

int TokenWidth(TokenFormat format) {
  switch (format) {
    case TokenFormat::kUint16:
      return 2;
    case TokenFormat::kUint32:
      return 4;
    case TokenFormat::kBytes:
      return 1;
    case TokenFormat::kAuto:
      return 0;
  }
  return 0;
}

absl::StatusOr<std::unique_ptr<TokenFile>> TokenFile::Open(
    const std::string& path, const TokenFileOptions& options) {
  TokenFormat format = options.format;
  if (format == TokenFormat::kAuto) {
    absl::StatusOr<TokenFormat> inferred = InferTokenFormat(path);
    if (!inferred.ok()) return inferred.status();
    format = *inferred;
  }
  const int width = TokenWidth(format);
  int64_t vocab_size = options.vocab_size;
  if (vocab_size < 0 || vocab_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be in [1, 2147483647] (or 0 for the "
                     "format's bound), got ",
                     vocab_size));
  }
  if (vocab_size == 0) {
    if (format == TokenFormat::kUint32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token file ", path,
          ": vocab_size is required for uint32 token files (ids must be "
          "checked against the model's vocabulary)"));
    }
    vocab_size = format == TokenFormat::kBytes ? 256 : 65536;
  }

  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> mapped,
                          MappedFile::Open(path, "token file"));
  const int64_t size = mapped->size();
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, " is empty"));
  }
  if (size % width != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, ": size ", size,
                     " bytes is not a multiple of the token width ", width,
                     " (format ", TokenFormatName(format), ")"));
  }

  std::unique_ptr<TokenFile> file(new TokenFile());
  file->path_ = path;
  file->format_ = format;
  file->width_ = width;
  file->data_ = mapped->data();
  file->mapped_bytes_ = static_cast<size_t>(size);
  file->mapped_ = std::move(mapped);
  file->num_tokens_ = size / width;
  file->vocab_size_ = vocab_size;

  const bool upfront = options.vocab_check == VocabCheck::kUpfront ||
                       (options.vocab_check == VocabCheck::kAuto &&
                        file->num_tokens_ <= kUpfrontCheckMaxTokens);
  // The format bound needs no scan: every byte is < 256, every uint16 id
  // is < 65536.
  const int64_t format_bound = int64_t{1} << (8 * width);
  if (vocab_size >= format_bound) {
    file->checked_upfront_ = true;
  } else if (upfront) {
    absl::Status status = file->CheckRange(0, file->num_tokens_);
    if (!status.ok()) return status;
    file->checked_upfront_ = true;
  }

  Fingerprint64 fp;
  fp.AddString("token_file");
  fp.AddString(TokenFormatName(format));
  fp.AddInt(size);
  fp.AddInt(vocab_size);
  const size_t head = std::min(file->mapped_bytes_, kFingerprintSampleBytes);
  fp.AddBytes(
      absl::string_view(reinterpret_cast<const char*>(file->data_), head));
  fp.AddBytes(absl::string_view(
      reinterpret_cast<const char*>(file->data_ + file->mapped_bytes_ - head),
      head));
  file->fingerprint_ = fp.value();
  return file;
}

TokenFile::~TokenFile() = default;

uint32_t TokenFile::Token(int64_t index) const {
  return DecodeToken(data_, width_, index);
}

absl::Status TokenFile::CheckRange(int64_t begin, int64_t end) const {
  const uint32_t bound = static_cast<uint32_t>(vocab_size_);
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t id = DecodeToken(data_, width_, i);
    if (id < bound) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "token file ", path_, ": token id ", id, " at token offset ", i,
        " (byte offset ", i * width_, ") is >= vocab_size ", vocab_size_));
  }
  return absl::OkStatus();
}

absl::Status TokenFile::Read(int64_t offset, absl::Span<int32_t> out) const {
  const int64_t length = static_cast<int64_t>(out.size());
  if (offset < 0 || offset > num_tokens_ || length > num_tokens_ - offset) {
    return absl::OutOfRangeError(absl::StrCat(
        "token file ", path_, ": window [", offset, ", ", offset + length,
        ") is outside the file's ", num_tokens_, " tokens"));
  }
  if (!checked_upfront_) {
    absl::Status status = CheckRange(offset, offset + length);
    if (!status.ok()) return status;
  }
  for (int64_t t = 0; t < length; ++t) {
    out[t] = static_cast<int32_t>(DecodeToken(data_, width_, offset + t));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TokenFileSource>> TokenFileSource::Open(
    const std::string& path, const TokenFileOptions& file_options,
    const TokenSourceOptions& source_options) {
  absl::StatusOr<std::unique_ptr<TokenFile>> file =
      TokenFile::Open(path, file_options);
  if (!file.ok()) return file.status();
  return std::make_unique<TokenFileSource>(
      std::shared_ptr<const TokenFile>(std::move(*file)), source_options);
}

TokenFileSource::TokenFileSource(std::shared_ptr<const TokenFile> file,
                                 const TokenSourceOptions& options)
    : file_(std::move(file)), options_(options) {}

absl::StatusOr<int64_t> TokenFileSource::Offset(int64_t index,
                                                int64_t length) const {
  if (index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence index must be >= 0, got ", index));
  }
  const int64_t n = file_->num_tokens();
  if (length < 1 || length > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", file_->path(), " has ", n,
                     " tokens; sequence length (seq_len + 1) must be in [1, ",
                     n, "], got ", length));
  }
  if (options_.offsets == OffsetMode::kStrided) {
    const int64_t stride = std::max<int64_t>(length - 1, 1);
    const int64_t windows = (n - length) / stride + 1;
    return (index % windows) * stride;
  }
  SplitMix64 rng(StreamSeed(options_.seed, kTokenOffsetDomain,
                            static_cast<uint64_t>(index)));
  return static_cast<int64_t>(
      rng.NextBelow(static_cast<uint64_t>(n - length + 1)));
}

absl::Status TokenFileSource::Fill(int64_t index,
                                   absl::Span<int32_t> out) const {
  absl::StatusOr<int64_t> offset =
      Offset(index, static_cast<int64_t>(out.size()));
  if (!offset.ok()) return offset.status();
  return file_->Read(*offset, out);
}

uint64_t TokenFileSource::Fingerprint() const {
  Fingerprint64 fp;
  fp.AddString("token_file_source");
  fp.AddInt(static_cast<int64_t>(file_->fingerprint()));
  fp.AddInt(static_cast<int64_t>(options_.seed));
  fp.AddInt(options_.offsets == OffsetMode::kStrided ? 1 : 0);
  return fp.value();
}

std::string TokenFileSource::Describe() const {
  return absl::StrCat(
      "token_file(path=", file_->path(),
      ", format=", TokenFormatName(file_->format()),
      ", tokens=", file_->num_tokens(), ", vocab=", file_->vocab_size(),
      ", offsets=",
      options_.offsets == OffsetMode::kStrided ? "strided" : "random",
      ", seed=", options_.seed, ")");
}

}  // namespace data
}  // namespace shardd
