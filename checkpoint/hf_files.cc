#include "checkpoint/hf_files.h"

#include <filesystem>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/file_util.h"
#include "checkpoint/json_text.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace checkpoint {
namespace {

using nlohmann::json;

absl::Status OpenSharded(const std::string& index_path,
                         HfCheckpointFiles* out) {
  SHARDD_ASSIGN_OR_RETURN(std::string text,
                          ReadFileToString(index_path, kMaxIndexBytes));
  SHARDD_ASSIGN_OR_RETURN(
      json doc, ParseJsonStrict(text, index_path, absl::StatusCode::kDataLoss));
  const json* map = nullptr;
  if (doc.is_object()) {
    auto it = doc.find("weight_map");
    if (it != doc.end() && it->is_object()) map = &*it;
  }
  if (map == nullptr) {
    return absl::DataLossError(absl::StrCat(
        index_path, ": must be an object with a \"weight_map\" object"));
  }
  std::map<std::string, std::set<std::string>> by_file;
  for (auto it = map->begin(); it != map->end(); ++it) {
    if (!it.value().is_string()) {
      return absl::DataLossError(absl::StrCat(index_path, ": weight_map[\"",
                                              it.key(),
                                              "\"] must be a file name, "
                                              "got ",
                                              DescribeJsonValue(it.value())));
    }
    const std::string file = it.value().get<std::string>();
    if (!IsPlainName(file)) {
      return absl::InvalidArgumentError(absl::StrCat(
          index_path, ": weight_map[\"", it.key(), "\"]: file \"", file,
          "\" must be a plain name in the same directory (no \"/\" or "
          "\"..\")"));
    }
    by_file[file].insert(it.key());
  }
  const std::string dir =
      std::filesystem::path(index_path).parent_path().string();
  for (const auto& [file, names] : by_file) {
    SHARDD_ASSIGN_OR_RETURN(
        std::unique_ptr<SafetensorsReader> reader,
        SafetensorsReader::Open(dir.empty() ? file : dir + "/" + file));
    for (const SafetensorsEntry& e : reader->tensors()) {
      if (names.count(e.name) == 0) {
        return absl::DataLossError(
            absl::StrCat(reader->path(), ": tensor \"", e.name,
                         "\" is not listed for this file in ", index_path));
      }
    }
    for (const std::string& name : names) {
      const SafetensorsEntry* e = reader->Find(name);
      if (e == nullptr) {
        return absl::DataLossError(absl::StrCat(reader->path(),
                                                ": no tensor \"", name,
                                                "\" although the index's "
                                                "weight_map puts it there"));
      }
      out->tensors[name] = HfTensorRef{reader.get(), e};
    }
    out->files.push_back(std::move(reader));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HfCheckpointFiles> OpenHfCheckpoint(const std::string& path) {
  HfCheckpointFiles out;
  out.path = path;
  std::error_code ec;
  std::string single = path;
  if (std::filesystem::is_directory(path, ec)) {
    const std::string index = absl::StrCat(path, "/", kHfIndexFileName);
    single = absl::StrCat(path, "/", kHfSingleFileName);
    if (std::filesystem::exists(index, ec)) {
      SHARDD_RETURN_IF_ERROR(OpenSharded(index, &out));
      return out;
    }
    if (!std::filesystem::exists(single, ec)) {
      return absl::NotFoundError(absl::StrCat(path, ": neither ",
                                              kHfIndexFileName, " nor ",
                                              kHfSingleFileName));
    }
  } else if (absl::EndsWith(path, ".json")) {
    SHARDD_RETURN_IF_ERROR(OpenSharded(path, &out));
    return out;
  }
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> reader,
                          SafetensorsReader::Open(single));
  for (const SafetensorsEntry& e : reader->tensors()) {
    out.tensors[e.name] = HfTensorRef{reader.get(), &e};
  }
  out.files.push_back(std::move(reader));
  return out;
}

}  // namespace checkpoint
}  // namespace shardd
