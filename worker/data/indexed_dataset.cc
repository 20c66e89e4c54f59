#include "worker/data/indexed_dataset.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardd {
namespace data {

namespace {

constexpr char kMagic[] = "MMIDIDX\0\0";
constexpr int64_t kMagicBytes = 9;
// magic, version, dtype, sequence count, document count.
constexpr int64_t kHeaderBytes = kMagicBytes + 8 + 1 + 8 + 8;

template <typename T>
T Load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // Little-endian hosts only (x86, arm64).
  return v;
}

int ItemBytes(uint8_t code) {
  switch (code) {
    case 1:
    case 2:
      return 1;
    case 3:
    case 8:
      return 2;
    case 4:
    case 7:
      return 4;
    case 5:
    case 6:
      return 8;
    default:
      return 0;
  }
}

absl::Status Corrupt(const std::string& path, int64_t offset,
                     const std::string& what) {
  return absl::DataLossError(
      absl::StrCat(path, ": byte ", offset, ": ", what));
}

}  // namespace

absl::StatusOr<std::unique_ptr<IndexedDataset>> IndexedDataset::Open(
    const std::string& prefix) {
  std::unique_ptr<IndexedDataset> d(new IndexedDataset());
  d->prefix_ = prefix;
  SHARDD_ASSIGN_OR_RETURN(d->idx_, MappedFile::Open(prefix + ".idx"));
  SHARDD_ASSIGN_OR_RETURN(d->bin_, MappedFile::Open(prefix + ".bin"));
  SHARDD_RETURN_IF_ERROR(d->Parse());
  return d;
}

absl::Status IndexedDataset::Parse() {
  const std::string& path = idx_->path();
  const unsigned char* p = idx_->data();
  const int64_t size = idx_->size();
  if (size < kHeaderBytes || std::memcmp(p, kMagic, kMagicBytes) != 0) {
    return Corrupt(path, 0,
                   "not a Megatron indexed dataset index (no MMIDIDX header)");
  }
  const uint64_t version = Load<uint64_t>(p + kMagicBytes);
  if (version != 1) {
    return Corrupt(path, kMagicBytes,
                   absl::StrCat("version ", version, ", only 1 is read"));
  }
  const uint8_t code = p[kMagicBytes + 8];
  item_bytes_ = ItemBytes(code);
  if (item_bytes_ == 0) {
    return Corrupt(path, kMagicBytes + 8,
                   absl::StrCat("dtype code ", int{code}, " is not one of 1-8"));
  }
  dtype_ = static_cast<DType>(code);
  const uint64_t sequences = Load<uint64_t>(p + kMagicBytes + 9);
  const uint64_t documents = Load<uint64_t>(p + kMagicBytes + 17);
  // lengths (4) + pointers (8) per sequence, 8 per document boundary.
  const uint64_t room = static_cast<uint64_t>(size - kHeaderBytes);
  if (sequences > room / 12 || documents > room / 8 ||
      sequences * 12 + documents * 8 != room) {
    return Corrupt(path, kMagicBytes + 9,
                   absl::StrCat(sequences, " sequences and ", documents,
                                " document boundaries do not fill the ",
                                size, "-byte index"));
  }
  if (documents < 1) {
    return Corrupt(path, kMagicBytes + 17, "no document boundaries");
  }
  sequences_ = static_cast<int64_t>(sequences);
  documents_ = static_cast<int64_t>(documents) - 1;
  lengths_ = p + kHeaderBytes;
  pointers_ = lengths_ + 4 * sequences_;
  doc_index_ = pointers_ + 8 * sequences_;
  int64_t end = 0;  // Where the next sequence must start in .bin.
  for (int64_t i = 0; i < sequences_; ++i) {
    const int32_t length = Load<int32_t>(lengths_ + 4 * i);
    if (length < 0) {
      return Corrupt(path, lengths_ - p + 4 * i,
                     absl::StrCat("sequence ", i, " has length ", length));
    }
    const int64_t pointer = Load<int64_t>(pointers_ + 8 * i);
    if (pointer != end) {
      return Corrupt(path, pointers_ - p + 8 * i,
                     absl::StrCat("sequence ", i, " starts at byte ", pointer,
                                  " of the data, not at ", end,
                                  " where sequence ", i - 1, " ends"));
    }
    end += int64_t{length} * item_bytes_;
  }
  if (end != bin_->size()) {
    return Corrupt(bin_->path(), std::min(end, bin_->size()),
                   absl::StrCat("the data file has ", bin_->size(),
                                " bytes; the index describes ", end));
  }
  int64_t previous = -1;
  for (int64_t d = 0; d <= documents_; ++d) {
    const int64_t at = Load<int64_t>(doc_index_ + 8 * d);
    const bool bad = d == 0 ? at != 0
                     : d == documents_ ? at != sequences_ || at < previous
                                       : at < previous || at > sequences_;
    if (bad) {
      return Corrupt(path, doc_index_ - p + 8 * d,
                     absl::StrCat("document boundary ", d, " is ", at,
                                  "; boundaries rise from 0 to the ",
                                  sequences_, " sequences"));
    }
    previous = at;
  }
  return absl::OkStatus();
}

int64_t IndexedDataset::length(int64_t i) const {
  return Load<int32_t>(lengths_ + 4 * i);
}

int64_t IndexedDataset::DocumentStart(int64_t d) const {
  return Load<int64_t>(doc_index_ + 8 * d);
}

int64_t IndexedDataset::Item(int64_t i, int64_t j) const {
  const unsigned char* at =
      bin_->data() + Load<int64_t>(pointers_ + 8 * i) + j * item_bytes_;
  switch (dtype_) {
    case DType::kUint8:
      return *at;
    case DType::kInt8:
      return static_cast<int8_t>(*at);
    case DType::kInt16:
      return Load<int16_t>(at);
    case DType::kUint16:
      return Load<uint16_t>(at);
    case DType::kInt32:
      return Load<int32_t>(at);
    case DType::kInt64:
      return Load<int64_t>(at);
    default:
      return 0;  // Floating point: not items shardd reads.
  }
}

}  // namespace data
}  // namespace shardd
