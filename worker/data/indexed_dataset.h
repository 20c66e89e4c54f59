#ifndef SHARDD_WORKER_DATA_INDEXED_DATASET_H_
#define SHARDD_WORKER_DATA_INDEXED_DATASET_H_

// Megatron-LM's indexed dataset, version 1 (docs/sft_data.md): PREFIX.idx
// holds the magic "MMIDIDX\0\0", the version (uint64 1), the item dtype
// (uint8 code), the sequence and document counts (uint64), then the
// sequence lengths (int32, items), the sequences' byte offsets into
// PREFIX.bin (int64) and the document boundaries (int64, sequence indices
// from 0 up to the sequence count); PREFIX.bin the items, little-endian,
// sequences back to back. Both files are memory-mapped read-only.
//
// Everything is checked on open, so reads need no checks: a bad magic,
// version or dtype, counts that overrun the index, a negative length, an
// offset that is not where the previous sequence ends, a .bin of another
// size, or document boundaries that do not rise from 0 to the sequence
// count are DATA_LOSS naming the file and the byte offset of the bad
// field.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/data/mapped_file.h"

namespace shardd {
namespace data {

class IndexedDataset {
 public:
  // Megatron's DType codes.
  enum class DType : uint8_t {
    kUint8 = 1,
    kInt8 = 2,
    kInt16 = 3,
    kInt32 = 4,
    kInt64 = 5,
    kFloat64 = 6,
    kFloat32 = 7,
    kUint16 = 8,
  };

  // Opens PREFIX.idx and PREFIX.bin. Errors: as MappedFile::Open; DATA_LOSS
  // (above).
  static absl::StatusOr<std::unique_ptr<IndexedDataset>> Open(
      const std::string& prefix);

  const std::string& prefix() const { return prefix_; }
  DType dtype() const { return dtype_; }
  // Bytes per item.
  int item_bytes() const { return item_bytes_; }
  bool integral() const {
    return dtype_ != DType::kFloat32 && dtype_ != DType::kFloat64;
  }
  int64_t sequences() const { return sequences_; }
  int64_t documents() const { return documents_; }
  // Items of sequence i in [0, sequences()).
  int64_t length(int64_t i) const;
  // Item j of sequence i as int64 (integral dtypes).
  int64_t Item(int64_t i, int64_t j) const;
  // The document boundary d in [0, documents()].
  int64_t DocumentStart(int64_t d) const;

 private:
  IndexedDataset() = default;
  absl::Status Parse();

  std::string prefix_;
  std::unique_ptr<MappedFile> idx_, bin_;
  DType dtype_ = DType::kUint8;
  int item_bytes_ = 1;
  int64_t sequences_ = 0;
  int64_t documents_ = 0;  // Boundaries: documents_ + 1 of them.
  const unsigned char* lengths_ = nullptr;
  const unsigned char* pointers_ = nullptr;
  const unsigned char* doc_index_ = nullptr;
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_INDEXED_DATASET_H_
