#include "checkpoint/checkpoint_writer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "checkpoint/file_util.h"
#include "checkpoint/safetensors.h"

namespace shardd {
namespace checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr char kTmpPrefix[] = ".tmp-";
constexpr char kStepPrefix[] = "step-";

std::string StripTrailingSlashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

absl::Status FsError(const std::error_code& ec, absl::string_view what,
                     const std::string& path) {
  return ErrnoStatus(ec.value(), what, path);
}

// Step of a "step-N" directory name; false for anything else.
bool ParseStepName(const std::string& name, int64_t* step) {
  if (!absl::StartsWith(name, kStepPrefix)) return false;
  const std::string digits = name.substr(sizeof(kStepPrefix) - 1);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) {
        return c >= '0' && c <= '9';
      })) {
    return false;
  }
  return absl::SimpleAtoi(digits, step);
}

}  // namespace

std::string RankFileName(int rank) {
  return absl::StrFormat("rank-%05d.safetensors", rank);
}

std::string CheckpointDirName(int64_t step) {
  return absl::StrFormat("%s%08d", kStepPrefix, step);
}

absl::StatusOr<RankFile> WriteRankFile(const std::string& tmp_dir, int rank,
                                       absl::Span<const RankTensor> tensors) {
  if (rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " must be >= 0"));
  }
  // Pieces per tensor, to name repeated ones and reject overlaps.
  std::map<std::string, std::vector<const RankTensor*>> by_tensor;
  for (const RankTensor& t : tensors) {
    const std::string where =
        absl::StrCat("tensor \"", t.name, "\" [", t.begin, ", ", t.end, ")");
    if (t.name.empty()) {
      return absl::InvalidArgumentError("tensor with an empty name");
    }
    const int64_t esize = SafetensorsDTypeBytes(t.dtype);
    if (esize == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": dtype \"", t.dtype, "\" is not a safetensors dtype"));
    }
    absl::StatusOr<int64_t> numel = ShapeNumel(t.global_shape, esize);
    if (!numel.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": global_shape: ", numel.status().message()));
    }
    if (t.begin < 0 || t.begin > t.end || t.end > *numel) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": range must lie within [0, ", *numel, "] (the numel)"));
    }
    if (static_cast<int64_t>(t.bytes.size()) != (t.end - t.begin) * esize) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", t.bytes.size(), " bytes given, the range ",
                       "of ", t.dtype, " needs ", (t.end - t.begin) * esize));
    }
    if (t.begin == t.end) continue;
    std::vector<const RankTensor*>& pieces = by_tensor[t.name];
    for (const RankTensor* other : pieces) {
      if (other->dtype != t.dtype || other->global_shape != t.global_shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": dtype or global_shape differs from another piece"));
      }
      if (t.begin < other->end && other->begin < t.end) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": overlaps piece [", other->begin, ", ", other->end, ")"));
      }
    }
    pieces.push_back(&t);
  }

  RankFile out;
  out.file.name = RankFileName(rank);
  std::vector<TensorView> views;
  for (const RankTensor& t : tensors) {
    if (t.begin == t.end) continue;
    TensorView& v = views.emplace_back();
    v.name = by_tensor[t.name].size() == 1 ? t.name
                                           : absl::StrCat(t.name, "@", t.begin);
    v.dtype = t.dtype;
    v.bytes = t.bytes;
    // Whole rows keep the row shape, which makes the file self-describing.
    int64_t row_numel = 0;
    if (!t.global_shape.empty() && t.global_shape[0] > 0) {
      row_numel = *ShapeNumel(t.global_shape, 1) / t.global_shape[0];
    }
    if (row_numel > 0 && t.begin % row_numel == 0 && t.end % row_numel == 0) {
      v.shape = t.global_shape;
      v.shape[0] = (t.end - t.begin) / row_numel;
    } else {
      v.shape = {t.end - t.begin};
    }
    out.chunks.push_back({t.name,
                          t.dtype,
                          t.global_shape,
                          {out.file.name, v.name, t.begin, t.end}});
  }
  const std::string path = absl::StrCat(tmp_dir, "/", out.file.name);
  SHARDD_ASSIGN_OR_RETURN(FileDigest digest,
                          WriteSafetensors(path, views,
                                           {{"format", "shardd-rank-file"},
                                            {"rank", absl::StrCat(rank)}}));
  out.file.size_bytes = digest.size_bytes;
  out.file.xxh64 = digest.xxh64;
  return out;
}

absl::Status AddRankFile(const RankFile& rank_file, CheckpointIndex* index) {
  for (const FileRecord& f : index->files) {
    if (f.name == rank_file.file.name) {
      return absl::InvalidArgumentError(absl::StrCat(
          "file \"", f.name, "\" is already in the index (rank added twice?)"));
    }
  }
  // Check every chunk before changing anything.
  for (const TensorChunk& c : rank_file.chunks) {
    auto it = index->tensors.find(c.tensor);
    if (it != index->tensors.end() &&
        (it->second.dtype != c.dtype || it->second.shape != c.global_shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", c.tensor, "\": ", rank_file.file.name, " has ", c.dtype,
          " [", absl::StrJoin(c.global_shape, ", "), "], an earlier file ",
          it->second.dtype, " [", absl::StrJoin(it->second.shape, ", "), "]"));
    }
  }
  index->files.push_back(rank_file.file);
  for (const TensorChunk& c : rank_file.chunks) {
    TensorRecord& t = index->tensors[c.tensor];
    t.dtype = c.dtype;
    t.shape = c.global_shape;
    t.chunks.push_back(c.chunk);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> BeginCheckpoint(const std::string& root,
                                            int64_t step) {
  if (root.empty()) return absl::InvalidArgumentError("root: empty path");
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", step, " must be >= 0"));
  }
  const std::string dir = StripTrailingSlashes(root);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return FsError(ec, "cannot create directory", dir);
  std::string tmp =
      absl::StrCat(dir, "/", kTmpPrefix, "step-", step, "-XXXXXX");
  if (::mkdtemp(tmp.data()) == nullptr) {
    return ErrnoStatus(errno, "cannot create directory", tmp);
  }
  return tmp;
}

absl::StatusOr<std::string> CommitCheckpoint(const std::string& root,
                                             const std::string& tmp_dir,
                                             const CheckpointIndex& index) {
  const std::string dir = StripTrailingSlashes(root);
  const std::string tmp = StripTrailingSlashes(tmp_dir);
  const std::string tmp_name =
      absl::StartsWith(tmp, dir + "/") ? tmp.substr(dir.size() + 1) : "";
  if (!IsPlainName(tmp_name) || !absl::StartsWith(tmp_name, kTmpPrefix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tmp_dir \"", tmp_dir, "\" must be a ", kTmpPrefix,
                     "* directory directly under root \"", root,
                     "\" (from BeginCheckpoint)"));
  }
  SHARDD_ASSIGN_OR_RETURN(std::string text, SerializeIndex(index));
  for (const FileRecord& f : index.files) {
    const std::string path = absl::StrCat(tmp, "/", f.name);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "file ", path, " listed in the index is missing: ", strerror(errno)));
    }
    if (st.st_size != f.size_bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("file ", path, " is ", st.st_size,
                       " bytes, the index records ", f.size_bytes));
    }
  }
  const std::string final_path =
      absl::StrCat(dir, "/", CheckpointDirName(index.step));
  struct stat st;
  if (::lstat(final_path.c_str(), &st) == 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("checkpoint ", final_path, " already exists"));
  }
  const std::string index_path = absl::StrCat(tmp, "/", kIndexFileName);
  SHARDD_RETURN_IF_ERROR(WriteStringToFile(index_path, text));
  SHARDD_RETURN_IF_ERROR(SyncDir(tmp));
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("cannot rename ", tmp, " to"),
                       final_path);
  }
  SHARDD_RETURN_IF_ERROR(SyncDir(dir));
  return final_path;
}

absl::StatusOr<std::vector<CheckpointInfo>> ListCheckpoints(
    const std::string& root) {
  const std::string dir = StripTrailingSlashes(root);
  std::vector<CheckpointInfo> out;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return out;
  fs::directory_iterator it(dir, ec);
  if (ec) return FsError(ec, "cannot list", dir);
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return FsError(ec, "cannot list", dir);
    const std::string name = it->path().filename().string();
    int64_t step;
    if (!ParseStepName(name, &step) || !it->is_directory(ec)) continue;
    const std::string path = absl::StrCat(dir, "/", name);
    absl::StatusOr<std::string> text = ReadFileToString(
        absl::StrCat(path, "/", kIndexFileName), kMaxIndexBytes);
    if (!text.ok()) continue;
    absl::StatusOr<CheckpointIndex> index = ParseIndex(*text);
    if (!index.ok() || index->step != step) continue;
    out.push_back({name, path, step});
  }
  if (ec) return FsError(ec, "cannot list", dir);
  std::sort(out.begin(), out.end(),
            [](const CheckpointInfo& a, const CheckpointInfo& b) {
              return a.step > b.step || (a.step == b.step && a.name > b.name);
            });
  return out;
}

absl::StatusOr<int> RemoveStaleTemporaries(const std::string& root) {
  const std::string dir = StripTrailingSlashes(root);
  std::error_code ec;
  if (!fs::exists(dir, ec)) return 0;
  std::vector<std::string> stale;
  fs::directory_iterator it(dir, ec);
  if (ec) return FsError(ec, "cannot list", dir);
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return FsError(ec, "cannot list", dir);
    const std::string name = it->path().filename().string();
    if (absl::StartsWith(name, kTmpPrefix)) stale.push_back(name);
  }
  if (ec) return FsError(ec, "cannot list", dir);
  for (const std::string& name : stale) {
    const std::string path = absl::StrCat(dir, "/", name);
    fs::remove_all(path, ec);
    if (ec) return FsError(ec, "cannot remove", path);
  }
  if (!stale.empty()) SHARDD_RETURN_IF_ERROR(SyncDir(dir));
  return static_cast<int>(stale.size());
}

}  // namespace checkpoint
}  // namespace shardd
