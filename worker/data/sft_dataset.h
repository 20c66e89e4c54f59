#ifndef SHARDD_WORKER_DATA_SFT_DATASET_H_
#define SHARDD_WORKER_DATA_SFT_DATASET_H_

// A prepared SFT dataset (tools/prepare_sft.py; docs/sft_data.md): a
// directory of
//   shardd_sft.json              the manifest: format "shardd-sft", version
//                                1, counts, and each file's size and XXH64
//                                of every chunk_bytes piece
//   tokens.bin / tokens.idx      Megatron indexed dataset, int32: one
//                                sequence (and document) per example
//   loss_mask.bin / .idx         the same layout, uint8: 1 where the token
//                                counts in the loss (the assistant turns)
//   source_lines.bin             int64 per example: its line in the JSONL
//
// Open verifies every file against the manifest (sizes, then checksums
// chunk by chunk) before anything is read: corruption is DATA_LOSS naming
// the file and the offset of the first bad chunk or field; the token ids
// are checked against the model's vocabulary.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/data/indexed_dataset.h"

namespace shardd {
namespace data {

class SftDataset {
 public:
  static constexpr char kManifest[] = "shardd_sft.json";

  // Whether `path` is a directory holding a manifest.
  static bool IsDataset(const std::string& path);

  // Opens the dataset in `dir` for a model of `model_vocab` ids. Errors:
  // NOT_FOUND (no manifest, or a file it lists is missing), DATA_LOSS (an
  // unreadable manifest, a size or checksum that differs from it, a broken
  // index, a mask value other than 0 or 1, lengths that differ between
  // tokens and mask), FAILED_PRECONDITION (another format or version),
  // INVALID_ARGUMENT (a token id outside [0, model_vocab), naming the
  // example, its JSONL line and the id).
  static absl::StatusOr<std::unique_ptr<SftDataset>> Open(
      const std::string& dir, int64_t model_vocab);

  const std::string& dir() const { return dir_; }
  int64_t examples() const { return tokens_->sequences(); }
  int64_t length(int64_t e) const { return tokens_->length(e); }
  int32_t Token(int64_t e, int64_t j) const {
    return static_cast<int32_t>(tokens_->Item(e, j));
  }
  bool Counted(int64_t e, int64_t j) const { return mask_->Item(e, j) != 0; }
  // The JSONL line (1-based) example e came from.
  int64_t SourceLine(int64_t e) const { return lines_[e]; }
  int64_t max_length() const { return max_length_; }
  int32_t pad_id() const { return pad_id_; }
  // The manifest's optional eos_id; -1 without one.
  int32_t eos_id() const { return eos_id_; }
  int64_t vocab_size() const { return vocab_size_; }
  // From the manifest's checksums: changes with any byte of the data.
  uint64_t fingerprint() const { return fingerprint_; }

 private:
  SftDataset() = default;

  std::string dir_;
  std::unique_ptr<IndexedDataset> tokens_, mask_;
  std::vector<int64_t> lines_;
  int64_t max_length_ = 0;
  int32_t pad_id_ = 0;
  int32_t eos_id_ = -1;
  int64_t vocab_size_ = 0;
  uint64_t fingerprint_ = 0;
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_SFT_DATASET_H_
