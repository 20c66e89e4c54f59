#include "checkpoint/checkpoint_index.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "checkpoint/file_util.h"
#include "checkpoint/json_text.h"
#include "checkpoint/safetensors.h"

namespace shardd {
namespace checkpoint {
namespace {

using nlohmann::json;

std::string ChunkText(const ChunkRecord& c) {
  return absl::StrCat("chunk [", c.begin, ", ", c.end, ") in \"", c.file, "\"");
}

// Field access on a parsed object: every error names the JSON path.
class Fields {
 public:
  Fields(const json& object, std::string path)
      : object_(object), path_(std::move(path)) {}

  // DATA_LOSS unless the value is an object whose keys are all in `allowed`.
  absl::Status CheckObject(std::initializer_list<const char*> allowed) const {
    if (!object_.is_object()) {
      return absl::DataLossError(absl::StrCat(
          path_, ": must be an object, got ", DescribeJsonValue(object_)));
    }
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      bool known = false;
      for (const char* a : allowed) known = known || it.key() == a;
      if (!known) {
        return absl::DataLossError(
            absl::StrCat(path_, ": unknown field \"", it.key(),
                         "\"; allowed: ", absl::StrJoin(allowed, ", ")));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<const json*> Get(const char* key) const {
    auto it = object_.find(key);
    if (it == object_.end()) {
      return absl::DataLossError(absl::StrCat(Path(key), ": missing"));
    }
    return &*it;
  }

  absl::StatusOr<int64_t> Int(const char* key) const {
    SHARDD_ASSIGN_OR_RETURN(const json* v, Get(key));
    int64_t out;
    if (!GetNonNegativeInt(*v, &out)) {
      return absl::DataLossError(
          absl::StrCat(Path(key), ": must be a non-negative integer, got ",
                       DescribeJsonValue(*v)));
    }
    return out;
  }

  absl::StatusOr<std::string> String(const char* key) const {
    SHARDD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_string()) {
      return absl::DataLossError(absl::StrCat(
          Path(key), ": must be a string, got ", DescribeJsonValue(*v)));
    }
    return v->get<std::string>();
  }

  absl::StatusOr<std::map<std::string, int64_t>> IntMap(const char* key) const {
    SHARDD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_object()) {
      return absl::DataLossError(
          absl::StrCat(Path(key), ": must be an object of integers, got ",
                       DescribeJsonValue(*v)));
    }
    std::map<std::string, int64_t> out;
    for (auto it = v->begin(); it != v->end(); ++it) {
      // Values are opaque but integral; negative ones are allowed.
      if (!it.value().is_number_integer()) {
        return absl::DataLossError(absl::StrCat(Path(key), "[\"", it.key(),
                                                "\"]: must be an integer, got ",
                                                DescribeJsonValue(it.value())));
      }
      if (it.value().is_number_unsigned() &&
          it.value().get<uint64_t>() > uint64_t{INT64_MAX}) {
        return absl::DataLossError(absl::StrCat(Path(key), "[\"", it.key(),
                                                "\"]: does not fit int64"));
      }
      out[it.key()] = it.value().get<int64_t>();
    }
    return out;
  }

  absl::StatusOr<const json*> Array(const char* key) const {
    SHARDD_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_array()) {
      return absl::DataLossError(absl::StrCat(
          Path(key), ": must be an array, got ", DescribeJsonValue(*v)));
    }
    return v;
  }

  std::string Path(const char* key) const {
    return absl::StrCat(path_, ".", key);
  }

 private:
  const json& object_;
  const std::string path_;
};

absl::StatusOr<CheckpointIndex> FromJson(const json& doc) {
  Fields top(doc, "index.json");
  SHARDD_RETURN_IF_ERROR(
      top.CheckObject({"format", "format_version", "step", "data_position",
                       "saved_by", "model", "train", "files", "tensors"}));
  SHARDD_ASSIGN_OR_RETURN(std::string format, top.String("format"));
  if (format != kIndexFormat) {
    return absl::DataLossError(absl::StrCat("index.json.format: \"", format,
                                            "\", expected \"", kIndexFormat,
                                            "\""));
  }
  CheckpointIndex index;
  SHARDD_ASSIGN_OR_RETURN(int64_t version, top.Int("format_version"));
  if (version > kIndexFormatVersion) {
    return absl::UnimplementedError(absl::StrCat(
        "index.json.format_version: ", version,
        " is newer than this build reads (", kIndexFormatVersion, ")"));
  }
  index.format_version = static_cast<int>(version);
  SHARDD_ASSIGN_OR_RETURN(index.step, top.Int("step"));
  SHARDD_ASSIGN_OR_RETURN(index.data_position, top.IntMap("data_position"));

  SHARDD_ASSIGN_OR_RETURN(const json* saved_by, top.Get("saved_by"));
  Fields saved(*saved_by, top.Path("saved_by"));
  SHARDD_RETURN_IF_ERROR(saved.CheckObject({"strategy", "world_size", "mesh"}));
  SHARDD_ASSIGN_OR_RETURN(index.saved_by.strategy, saved.String("strategy"));
  SHARDD_ASSIGN_OR_RETURN(index.saved_by.world_size, saved.Int("world_size"));
  SHARDD_ASSIGN_OR_RETURN(index.saved_by.mesh, saved.IntMap("mesh"));

  if (auto model = doc.find("model"); model != doc.end()) {
    if (!model->is_object()) {
      return absl::DataLossError(
          absl::StrCat("index.json.model: must be an object, got ",
                       DescribeJsonValue(*model)));
    }
    SHARDD_ASSIGN_OR_RETURN(index.model_spec_json, DumpJson(*model, -1));
  }
  if (auto train = doc.find("train"); train != doc.end()) {
    if (!train->is_object()) {
      return absl::DataLossError(
          absl::StrCat("index.json.train: must be an object, got ",
                       DescribeJsonValue(*train)));
    }
    SHARDD_ASSIGN_OR_RETURN(index.train_config_json, DumpJson(*train, -1));
  }

  SHARDD_ASSIGN_OR_RETURN(const json* files, top.Array("files"));
  for (size_t i = 0; i < files->size(); ++i) {
    Fields f((*files)[i], absl::StrCat("index.json.files[", i, "]"));
    SHARDD_RETURN_IF_ERROR(f.CheckObject({"name", "size", "xxh64"}));
    FileRecord& file = index.files.emplace_back();
    SHARDD_ASSIGN_OR_RETURN(file.name, f.String("name"));
    SHARDD_ASSIGN_OR_RETURN(file.size_bytes, f.Int("size"));
    SHARDD_ASSIGN_OR_RETURN(std::string hash, f.String("xxh64"));
    if (!ParseXxh64Hex(hash, &file.xxh64)) {
      return absl::DataLossError(absl::StrCat(f.Path("xxh64"), ": \"", hash,
                                              "\" is not 16 hex digits"));
    }
  }

  SHARDD_ASSIGN_OR_RETURN(const json* tensors, top.Get("tensors"));
  if (!tensors->is_object()) {
    return absl::DataLossError(
        absl::StrCat("index.json.tensors: must be an object, got ",
                     DescribeJsonValue(*tensors)));
  }
  for (auto it = tensors->begin(); it != tensors->end(); ++it) {
    Fields t(it.value(),
             absl::StrCat("index.json.tensors[\"", it.key(), "\"]"));
    SHARDD_RETURN_IF_ERROR(t.CheckObject({"dtype", "shape", "chunks"}));
    TensorRecord& tensor = index.tensors[it.key()];
    SHARDD_ASSIGN_OR_RETURN(tensor.dtype, t.String("dtype"));
    SHARDD_ASSIGN_OR_RETURN(const json* shape, t.Array("shape"));
    for (size_t d = 0; d < shape->size(); ++d) {
      int64_t dim;
      if (!GetNonNegativeInt((*shape)[d], &dim)) {
        return absl::DataLossError(absl::StrCat(
            t.Path("shape"), "[", d, "]: must be a non-negative integer, got ",
            DescribeJsonValue((*shape)[d])));
      }
      tensor.shape.push_back(dim);
    }
    SHARDD_ASSIGN_OR_RETURN(const json* chunks, t.Array("chunks"));
    for (size_t c = 0; c < chunks->size(); ++c) {
      Fields ch((*chunks)[c], absl::StrCat(t.Path("chunks"), "[", c, "]"));
      SHARDD_RETURN_IF_ERROR(
          ch.CheckObject({"file", "tensor", "begin", "end"}));
      ChunkRecord& chunk = tensor.chunks.emplace_back();
      SHARDD_ASSIGN_OR_RETURN(chunk.file, ch.String("file"));
      SHARDD_ASSIGN_OR_RETURN(chunk.tensor, ch.String("tensor"));
      SHARDD_ASSIGN_OR_RETURN(chunk.begin, ch.Int("begin"));
      SHARDD_ASSIGN_OR_RETURN(chunk.end, ch.Int("end"));
    }
  }
  return index;
}

}  // namespace

absl::Status ValidateIndex(CheckpointIndex* index) {
  if (index->format_version < 1 ||
      index->format_version > kIndexFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "format_version ", index->format_version,
        " unsupported; this build writes and reads 1..", kIndexFormatVersion));
  }
  if (index->step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", index->step, " must be >= 0"));
  }
  std::set<std::string> files;
  for (const FileRecord& f : index->files) {
    if (!IsPlainName(f.name) || f.name == kIndexFileName) {
      return absl::InvalidArgumentError(absl::StrCat(
          "file \"", f.name,
          "\": must be a plain file name (no \"/\" or \"..\", not ",
          kIndexFileName, ")"));
    }
    if (!files.insert(f.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("file \"", f.name, "\": listed twice"));
    }
    if (f.size_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "file \"", f.name, "\": size ", f.size_bytes, " must be >= 0"));
    }
  }
  for (auto& [name, t] : index->tensors) {
    const std::string where = absl::StrCat("tensor \"", name, "\"");
    if (name.empty()) {
      return absl::InvalidArgumentError("tensor with an empty name");
    }
    if (SafetensorsDTypeBytes(t.dtype) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": dtype \"", t.dtype,
                       "\" is not a safetensors dtype (F32, BF16, ...)"));
    }
    absl::StatusOr<int64_t> numel =
        ShapeNumel(t.shape, SafetensorsDTypeBytes(t.dtype));
    if (!numel.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", numel.status().message()));
    }
    for (const ChunkRecord& c : t.chunks) {
      if (files.count(c.file) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", ChunkText(c), ": file not in the index's files"));
      }
      if (c.tensor.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", ChunkText(c), ": empty in-file tensor name"));
      }
      if (c.begin < 0 || c.begin >= c.end || c.end > *numel) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", ChunkText(c),
            ": range must satisfy 0 <= begin < end <= numel (", *numel, ")"));
      }
    }
    std::sort(t.chunks.begin(), t.chunks.end(),
              [](const ChunkRecord& a, const ChunkRecord& b) {
                return a.begin < b.begin ||
                       (a.begin == b.begin && a.end < b.end);
              });
    int64_t covered = 0;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const ChunkRecord& c = t.chunks[i];
      if (c.begin < covered) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": ", ChunkText(c), " overlaps ",
                         ChunkText(t.chunks[i - 1])));
      }
      if (c.begin > covered) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": elements [",
                                                       covered, ", ", c.begin,
                                                       ") are in no chunk"));
      }
      covered = c.end;
    }
    if (covered != *numel) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": elements [", covered, ", ", *numel, ") are in no chunk"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SerializeIndex(CheckpointIndex index) {
  SHARDD_RETURN_IF_ERROR(ValidateIndex(&index));
  json files = json::array();
  for (const FileRecord& f : index.files) {
    files.push_back({{"name", f.name},
                     {"size", f.size_bytes},
                     {"xxh64", Xxh64Hex(f.xxh64)}});
  }
  json tensors = json::object();
  for (const auto& [name, t] : index.tensors) {
    json chunks = json::array();
    for (const ChunkRecord& c : t.chunks) {
      chunks.push_back({{"file", c.file},
                        {"tensor", c.tensor},
                        {"begin", c.begin},
                        {"end", c.end}});
    }
    tensors[name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"chunks", chunks}};
  }
  json doc = {
      {"format", kIndexFormat},
      {"format_version", index.format_version},
      {"step", index.step},
      {"data_position", index.data_position},
      {"saved_by",
       {{"strategy", index.saved_by.strategy},
        {"world_size", index.saved_by.world_size},
        {"mesh", index.saved_by.mesh}}},
      {"files", files},
      {"tensors", tensors},
  };
  if (!index.model_spec_json.empty()) {
    SHARDD_ASSIGN_OR_RETURN(
        doc["model"], ParseJsonStrict(index.model_spec_json, "model_spec_json",
                                      absl::StatusCode::kInvalidArgument));
    if (!doc["model"].is_object()) {
      return absl::InvalidArgumentError(
          "model_spec_json: must be one JSON object");
    }
  }
  if (!index.train_config_json.empty()) {
    SHARDD_ASSIGN_OR_RETURN(
        doc["train"],
        ParseJsonStrict(index.train_config_json, "train_config_json",
                        absl::StatusCode::kInvalidArgument));
    if (!doc["train"].is_object()) {
      return absl::InvalidArgumentError(
          "train_config_json: must be one JSON object");
    }
  }
  SHARDD_ASSIGN_OR_RETURN(std::string text, DumpJson(doc, 1));
  text.push_back('\n');
  return text;
}

absl::StatusOr<CheckpointIndex> ParseIndex(absl::string_view text) {
  SHARDD_ASSIGN_OR_RETURN(
      json doc,
      ParseJsonStrict(text, "index.json", absl::StatusCode::kDataLoss));
  SHARDD_ASSIGN_OR_RETURN(CheckpointIndex index, FromJson(doc));
  absl::Status valid = ValidateIndex(&index);
  if (!valid.ok()) {
    return absl::DataLossError(absl::StrCat("index.json: ", valid.message()));
  }
  return index;
}

absl::StatusOr<ElementRange> RowsToElements(const std::vector<int64_t>& shape,
                                            int64_t row_begin,
                                            int64_t row_end) {
  if (shape.empty()) {
    return absl::InvalidArgumentError("shape: a scalar has no rows");
  }
  if (row_begin < 0 || row_begin > row_end || row_end > shape[0]) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows [", row_begin, ", ", row_end,
                     ") must lie within [0, ", shape[0], "]"));
  }
  SHARDD_ASSIGN_OR_RETURN(
      int64_t row_numel,
      ShapeNumel(std::vector<int64_t>(shape.begin() + 1, shape.end())));
  ElementRange range;
  if (__builtin_mul_overflow(row_begin, row_numel, &range.begin) ||
      __builtin_mul_overflow(row_end, row_numel, &range.end)) {
    return absl::InvalidArgumentError("rows: element offset overflows int64");
  }
  return range;
}

}  // namespace checkpoint
}  // namespace shardd
