#include "checkpoint/retention.h"

#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "checkpoint/file_util.h"

namespace shardd {
namespace checkpoint {
namespace fs = std::filesystem;

absl::Status PinCheckpoint(const std::string& tmp_dir) {
  const std::string path = absl::StrCat(tmp_dir, "/", kPinnedMarker);
  {
    std::ofstream out(path, std::ios::trunc);
    out << "saved on demand: retention keeps this checkpoint\n";
    if (!out) {
      return absl::InternalError(absl::StrCat("cannot write ", path));
    }
  }
  return SyncDir(tmp_dir);
}

bool IsPinned(const std::string& checkpoint_path) {
  std::error_code ec;
  return fs::exists(absl::StrCat(checkpoint_path, "/", kPinnedMarker), ec);
}

std::vector<CheckpointInfo> RetentionVictims(
    const std::vector<CheckpointInfo>& committed,
    const RetentionPolicy& policy) {
  std::vector<CheckpointInfo> victims;
  if (policy.keep_last <= 0) return victims;
  for (size_t i = static_cast<size_t>(policy.keep_last); i < committed.size();
       ++i) {
    const CheckpointInfo& c = committed[i];
    if (policy.protect.count(c.name) > 0 || IsPinned(c.path)) continue;
    if (policy.keep_every > 0 && c.step % policy.keep_every == 0) continue;
    victims.push_back(c);
  }
  // Oldest first: a deletion that stops halfway keeps the newer ones.
  std::reverse(victims.begin(), victims.end());
  return victims;
}

absl::Status DeleteCheckpoint(const std::string& root,
                              const CheckpointInfo& info) {
  if (!absl::StartsWith(info.name, "step-") ||
      info.name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeleteCheckpoint: \"", info.name,
                     "\" is not a checkpoint directory name"));
  }
  std::string dir = root;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string from = absl::StrCat(dir, "/", info.name);
  // A unique .tmp- name: unlisted from the rename on.
  std::string pattern =
      absl::StrCat(dir, "/.tmp-deleted-", info.name, "-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create ", pattern));
  }
  std::error_code ec;
  fs::remove(pattern, ec);  // Only its unique name is wanted.
  fs::rename(from, pattern, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot rename ", from, " to ",
                                            pattern, ": ", ec.message()));
  }
  SHARDD_RETURN_IF_ERROR(SyncDir(dir));
  fs::remove_all(pattern, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat(
        "checkpoint ", info.name, " unlisted but not removed (", pattern,
        "): ", ec.message()));
  }
  return SyncDir(dir);
}

}  // namespace checkpoint
}  // namespace shardd
