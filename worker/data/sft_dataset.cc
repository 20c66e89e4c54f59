#include "worker/data/sft_dataset.h"

#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/data/mapped_file.h"
#include "xxhash.h"

namespace shardd {
namespace data {

namespace {

constexpr char kFormat[] = "shardd-sft";
constexpr int kVersion = 1;

std::string Join(const std::string& dir, const std::string& name) {
  return dir + "/" + name;
}

// The file's size and the XXH64 of each chunk against the manifest entry.
absl::Status VerifyFile(const std::string& path, const nlohmann::json& entry,
                        int64_t chunk_bytes, XXH64_state_t* digest) {
  if (!entry.is_object() || !entry.contains("bytes") ||
      !entry["bytes"].is_number_integer() || !entry.contains("xxh64") ||
      !entry["xxh64"].is_array()) {
    return absl::DataLossError(absl::StrCat(
        path, ": its manifest entry lacks \"bytes\" or \"xxh64\""));
  }
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file,
                          MappedFile::Open(path));
  const int64_t bytes = entry["bytes"].get<int64_t>();
  if (file->size() != bytes) {
    return absl::DataLossError(absl::StrCat(
        path, ": byte ", std::min(bytes, file->size()), ": the file has ",
        file->size(), " bytes, the manifest says ", bytes));
  }
  const nlohmann::json& sums = entry["xxh64"];
  const int64_t chunks = (bytes + chunk_bytes - 1) / chunk_bytes;
  if (static_cast<int64_t>(sums.size()) != chunks) {
    return absl::DataLossError(absl::StrCat(
        path, ": the manifest has ", sums.size(), " checksums for ", chunks,
        " chunks of ", chunk_bytes, " bytes"));
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * chunk_bytes;
    const int64_t n = std::min(chunk_bytes, bytes - begin);
    const uint64_t got = XXH64(file->data() + begin, static_cast<size_t>(n), 0);
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx",
                  static_cast<unsigned long long>(got));
    if (!sums[c].is_string() || sums[c].get<std::string>() != hex) {
      return absl::DataLossError(absl::StrCat(
          path, ": byte ", begin, ": the checksum of bytes [", begin, ", ",
          begin + n, ") is ", hex, ", the manifest says ",
          sums[c].is_string() ? sums[c].get<std::string>() : sums[c].dump()));
    }
    XXH64_update(digest, hex, 16);
  }
  return absl::OkStatus();
}

}  // namespace

bool SftDataset::IsDataset(const std::string& path) {
  struct stat st;
  return ::stat(Join(path, kManifest).c_str(), &st) == 0 &&
         S_ISREG(st.st_mode);
}

absl::StatusOr<std::unique_ptr<SftDataset>> SftDataset::Open(
    const std::string& dir, int64_t model_vocab) {
  const std::string manifest_path = Join(dir, kManifest);
  std::ifstream in(manifest_path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("no SFT dataset manifest ", manifest_path));
  }
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json m =
      nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded() || !m.is_object()) {
    return absl::DataLossError(
        absl::StrCat(manifest_path, ": not a JSON object"));
  }
  auto integer = [&](const char* key) -> absl::StatusOr<int64_t> {
    if (!m.contains(key) || !m[key].is_number_integer()) {
      return absl::DataLossError(absl::StrCat(
          manifest_path, ": \"", key, "\" is missing or not an integer"));
    }
    return m[key].get<int64_t>();
  };
  if (!m.contains("format") || m["format"] != kFormat) {
    return absl::FailedPreconditionError(absl::StrCat(
        manifest_path, ": format is not \"", kFormat, "\""));
  }
  SHARDD_ASSIGN_OR_RETURN(const int64_t version, integer("version"));
  if (version != kVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(manifest_path, ": version ", version,
                     "; this shardd reads version ", kVersion));
  }
  SHARDD_ASSIGN_OR_RETURN(const int64_t chunk_bytes, integer("chunk_bytes"));
  SHARDD_ASSIGN_OR_RETURN(const int64_t examples, integer("examples"));
  SHARDD_ASSIGN_OR_RETURN(const int64_t pad_id, integer("pad_id"));
  SHARDD_ASSIGN_OR_RETURN(const int64_t vocab, integer("vocab_size"));
  if (chunk_bytes < 1 || examples < 1 || vocab < 1 || pad_id < 0 ||
      pad_id >= vocab) {
    return absl::DataLossError(absl::StrCat(
        manifest_path, ": chunk_bytes ", chunk_bytes, ", examples ", examples,
        ", vocab_size ", vocab, " or pad_id ", pad_id, " out of range"));
  }
  // The tokenizer's EOS (DiffusionGemma pads responses with it); optional.
  int64_t eos_id = -1;
  if (m.contains("eos_id") && !m["eos_id"].is_null()) {
    SHARDD_ASSIGN_OR_RETURN(eos_id, integer("eos_id"));
    if (eos_id < 0 || eos_id >= vocab) {
      return absl::DataLossError(absl::StrCat(
          manifest_path, ": eos_id ", eos_id, " outside [0, ", vocab, ")"));
    }
  }
  if (!m.contains("files") || !m["files"].is_object()) {
    return absl::DataLossError(
        absl::StrCat(manifest_path, ": \"files\" is missing"));
  }
  std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t*)> digest(
      XXH64_createState(), XXH64_freeState);
  XXH64_reset(digest.get(), 0);
  for (const char* name :
       {"tokens.bin", "tokens.idx", "loss_mask.bin", "loss_mask.idx",
        "source_lines.bin"}) {
    if (!m["files"].contains(name)) {
      return absl::DataLossError(
          absl::StrCat(manifest_path, ": lists no ", name));
    }
    SHARDD_RETURN_IF_ERROR(VerifyFile(Join(dir, name), m["files"][name],
                                      chunk_bytes, digest.get()));
  }
  std::unique_ptr<SftDataset> d(new SftDataset());
  d->fingerprint_ = XXH64_digest(digest.get());
  d->dir_ = dir;
  d->pad_id_ = static_cast<int32_t>(pad_id);
  d->eos_id_ = static_cast<int32_t>(eos_id);
  d->vocab_size_ = vocab;
  SHARDD_ASSIGN_OR_RETURN(d->tokens_,
                          IndexedDataset::Open(Join(dir, "tokens")));
  SHARDD_ASSIGN_OR_RETURN(d->mask_,
                          IndexedDataset::Open(Join(dir, "loss_mask")));
  const std::string tokens_idx = Join(dir, "tokens.idx");
  const std::string mask_idx = Join(dir, "loss_mask.idx");
  if (d->tokens_->dtype() != IndexedDataset::DType::kInt32 ||
      d->mask_->dtype() != IndexedDataset::DType::kUint8) {
    return absl::DataLossError(absl::StrCat(
        dir, ": tokens must be int32 (dtype 4) and the loss mask uint8 "
             "(dtype 1)"));
  }
  if (d->tokens_->sequences() != examples ||
      d->mask_->sequences() != examples) {
    return absl::DataLossError(absl::StrCat(
        tokens_idx, ": ", d->tokens_->sequences(), " sequences (", mask_idx,
        ": ", d->mask_->sequences(), "), the manifest says ", examples));
  }
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> lines,
                          MappedFile::Open(Join(dir, "source_lines.bin")));
  if (lines->size() != 8 * examples) {
    return absl::DataLossError(
        absl::StrCat(lines->path(), ": ", lines->size(), " bytes for ",
                     examples, " examples of 8"));
  }
  d->lines_.resize(examples);
  std::memcpy(d->lines_.data(), lines->data(), 8 * examples);
  for (int64_t e = 0; e < examples; ++e) {
    const int64_t n = d->tokens_->length(e);
    if (d->mask_->length(e) != n) {
      return absl::DataLossError(absl::StrCat(
          mask_idx, ": example ", e, " (line ", d->lines_[e], ") has ",
          d->mask_->length(e), " mask values for ", n, " tokens"));
    }
    d->max_length_ = std::max(d->max_length_, n);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t id = d->tokens_->Item(e, j);
      if (id < 0 || id >= model_vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            dir, ": example ", e, " (line ", d->lines_[e], "), token ", j,
            ": id ", id, " outside the model's vocabulary [0, ",
            model_vocab, ")"));
      }
      const int64_t mask = d->mask_->Item(e, j);
      if (mask != 0 && mask != 1) {
        return absl::DataLossError(absl::StrCat(
            Join(dir, "loss_mask.bin"), ": example ", e, ", token ", j,
            ": mask value ", mask, " (0 or 1)"));
      }
    }
  }
  if (d->pad_id_ >= model_vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        manifest_path, ": pad_id ", d->pad_id_,
        " outside the model's vocabulary [0, ", model_vocab, ")"));
  }
  if (d->eos_id_ >= model_vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        manifest_path, ": eos_id ", d->eos_id_,
        " outside the model's vocabulary [0, ", model_vocab, ")"));
  }
  return d;
}

}  // namespace data
}  // namespace shardd
