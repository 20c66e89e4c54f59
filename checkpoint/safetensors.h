#ifndef SHARDD_CHECKPOINT_SAFETENSORS_H_
#define SHARDD_CHECKPOINT_SAFETENSORS_H_

// The safetensors file format (https://github.com/huggingface/safetensors):
//
//   [8 bytes: N, little-endian uint64][N bytes: JSON header][data section]
//
// The header is one JSON object mapping each tensor name to
// {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} (byte
// offsets into the data section), plus an optional "__metadata__" object of
// string values. The header is padded with spaces to a multiple of 8 bytes so
// the data section starts aligned. Tensors are stored row-major, little
// endian, back to back: sorted by begin they cover the data section exactly.
//
// The reader validates all of that strictly and reads byte ranges of single
// tensors with pread, so a rank restoring its shard touches only the bytes
// it needs, never the whole file.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/model.pb.h"
#include "checkpoint/file_util.h"

namespace shardd {
namespace checkpoint {

// Bytes per element of a safetensors dtype tag: BOOL, U8, I8, F8_E4M3,
// F8_E5M2 (1), I16, U16, F16, BF16 (2), I32, U32, F32 (4), I64, U64, F64
// (8); 0 for anything else.
int64_t SafetensorsDTypeBytes(absl::string_view dtype);

// The tag of a shardd dtype (FLOAT32 -> "F32", BFLOAT16 -> "BF16", FLOAT16 ->
// "F16", FLOAT8_E4M3 -> "F8_E4M3", INT32 -> "I32", INT64 -> "I64") and back.
// Errors: INVALID_ARGUMENT for DTYPE_UNSPECIFIED or a tag shardd has no
// dtype for.
absl::StatusOr<std::string> SafetensorsDTypeOf(v1::DType dtype);
absl::StatusOr<v1::DType> DTypeFromSafetensors(absl::string_view dtype);

// Elements of `shape` (1 for a scalar). Errors: INVALID_ARGUMENT for a
// negative dimension or a count (times `element_bytes`, when given)
// overflowing int64.
absl::StatusOr<int64_t> ShapeNumel(absl::Span<const int64_t> shape,
                                   int64_t element_bytes = 1);

// Whether SafetensorsToFloat reads `dtype`: F32, BF16 or F16.
bool SafetensorsFloatDType(absl::string_view dtype);

// `n` elements of `dtype` (F32, BF16 or F16) at `src`, little endian, as
// fp32: exact, as every value of the three is an fp32 value.
void SafetensorsToFloat(absl::string_view dtype, const uint8_t* src, int64_t n,
                        float* out);

// One tensor to write: `bytes` is its row-major data, numel * element size
// bytes long; the caller keeps it alive during the write.
struct TensorView {
  std::string name;
  std::string dtype;  // Safetensors tag.
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> bytes;
};

// What a written file is: its size and XXH64 (seed 0) over all its bytes.
struct FileDigest {
  int64_t size_bytes = 0;
  uint64_t xxh64 = 0;
};

// The header a write would produce (the JSON padded with spaces to a
// multiple of 8, without the length prefix). Data is laid out in the order
// given. Errors: INVALID_ARGUMENT naming the tensor and field: an empty or
// repeated name, "__metadata__" as a name, an unknown dtype, a negative
// dimension, bytes not numel * element size long, a name or metadata string
// that is not UTF-8.
absl::StatusOr<std::string> BuildSafetensorsHeader(
    absl::Span<const TensorView> tensors,
    const std::map<std::string, std::string>& metadata);

// Writes `tensors` to `path` (created or truncated), hashing while writing,
// and fsyncs the file (not its directory). Errors: those of
// BuildSafetensorsHeader; NOT_FOUND / PERMISSION_DENIED / INTERNAL from the
// file system, naming the path.
absl::StatusOr<FileDigest> WriteSafetensors(
    const std::string& path, absl::Span<const TensorView> tensors,
    const std::map<std::string, std::string>& metadata = {});

// One tensor of a parsed header.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  // Byte range [data_begin, data_end) within the data section.
  int64_t data_begin = 0;
  int64_t data_end = 0;
  int64_t byte_size() const { return data_end - data_begin; }
};

// A parsed, validated header.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;  // Sorted by data_begin.
  std::map<std::string, std::string> metadata;
  // Bytes before the data section: 8 + the header length.
  int64_t data_start = 0;
};

// Largest header accepted (the reference implementation's limit).
inline constexpr int64_t kMaxSafetensorsHeaderBytes = 100 << 20;

// Parses and validates the JSON header of a file whose data section is
// `data_size` bytes. Errors: DATA_LOSS naming the tensor and field that is
// wrong: malformed JSON or a repeated key, a top level that is not an object,
// an entry that is not {"dtype", "shape", "data_offsets"} (missing or extra
// fields), an unknown dtype, a shape that is not an array of non-negative
// integers, data_offsets that are not two integers begin <= end,
// end - begin != numel * element size, offsets past the data section,
// overlapping tensors, gaps (bytes no tensor owns), "__metadata__" not an
// object of strings.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    absl::string_view header_json, int64_t data_size);

// An open safetensors file. Opening reads only the 8-byte prefix and the
// header; tensor data is read on demand. Thread-safe.
class SafetensorsReader {
 public:
  // Errors: NOT_FOUND / PERMISSION_DENIED / INTERNAL opening the file;
  // DATA_LOSS when the file is shorter than 8 bytes, the header length is 0,
  // over kMaxSafetensorsHeaderBytes or past the end of the file, or the
  // header is invalid (ParseSafetensorsHeader). Messages start with the path.
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(
      const std::string& path);

  const std::string& path() const { return path_; }
  int64_t file_size() const { return file_size_; }
  const SafetensorsHeader& header() const { return header_; }
  const std::vector<SafetensorsEntry>& tensors() const {
    return header_.tensors;
  }
  const std::map<std::string, std::string>& metadata() const {
    return header_.metadata;
  }
  // Null when the file has no tensor `name`.
  const SafetensorsEntry* Find(absl::string_view name) const;

  // Copies bytes [offset, offset + size) of `entry`'s data (offset relative
  // to the tensor's first byte) into `out` with pread. `entry` must be one
  // of tensors(). Errors: OUT_OF_RANGE when the range is not inside the
  // tensor; DATA_LOSS when the file is shorter now than when it was opened;
  // INTERNAL on an I/O error.
  absl::Status ReadBytes(const SafetensorsEntry& entry, int64_t offset,
                         int64_t size, void* out) const;

  // The whole tensor. Errors: as ReadBytes.
  absl::StatusOr<std::vector<uint8_t>> ReadTensor(
      const SafetensorsEntry& entry) const;

  // Tensor data bytes read so far through ReadBytes / ReadTensor (the header
  // is not counted).
  int64_t data_bytes_read() const { return data_bytes_read_.load(); }

 private:
  SafetensorsReader(std::string path, ScopedFd fd, int64_t file_size,
                    SafetensorsHeader header);

  const std::string path_;
  const ScopedFd fd_;
  const int64_t file_size_;
  const SafetensorsHeader header_;
  absl::flat_hash_map<std::string, int> by_name_;  // Index into tensors().
  mutable std::atomic<int64_t> data_bytes_read_{0};
};

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_SAFETENSORS_H_
