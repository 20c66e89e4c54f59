#include "checkpoint/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/json_text.h"
#include "common/status_macros.h"
#include "model/model_util.h"

namespace shardd {
namespace checkpoint {
namespace {

using nlohmann::json;

constexpr char kMetadataKey[] = "__metadata__";

struct DTypeInfo {
  const char* tag;
  int64_t bytes;
};

constexpr DTypeInfo kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
    {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8},
};

std::string KnownDTypes() {
  std::vector<std::string> tags;
  for (const DTypeInfo& d : kDTypes) tags.push_back(d.tag);
  return absl::StrJoin(tags, ", ");
}

void LittleEndian64(uint64_t v, unsigned char out[8]) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // Inf / NaN.
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal: normalise (every half value is exact in fp32).
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400) == 0);
    bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

int64_t SafetensorsDTypeBytes(absl::string_view dtype) {
  for (const DTypeInfo& d : kDTypes) {
    if (dtype == d.tag) return d.bytes;
  }
  return 0;
}

bool SafetensorsFloatDType(absl::string_view dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16";
}

void SafetensorsToFloat(absl::string_view dtype, const uint8_t* src, int64_t n,
                        float* out) {
  if (dtype == "F32") {
    std::memcpy(out, src, static_cast<size_t>(n) * 4);
    return;
  }
  const bool bf16 = dtype == "BF16";
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    if (bf16) {
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(out + i, &bits, 4);
    } else {
      out[i] = HalfToFloat(h);
    }
  }
}

absl::StatusOr<std::string> SafetensorsDTypeOf(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return std::string("F32");
    case v1::BFLOAT16:
      return std::string("BF16");
    case v1::FLOAT16:
      return std::string("F16");
    case v1::FLOAT8_E4M3:
      return std::string("F8_E4M3");
    case v1::INT32:
      return std::string("I32");
    case v1::INT64:
      return std::string("I64");
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype ", v1::DType_Name(dtype),
          " has no safetensors tag; allowed: FLOAT32, BFLOAT16, FLOAT16, "
          "FLOAT8_E4M3, INT32, INT64"));
  }
}

absl::StatusOr<v1::DType> DTypeFromSafetensors(absl::string_view dtype) {
  if (dtype == "F32") return v1::FLOAT32;
  if (dtype == "BF16") return v1::BFLOAT16;
  if (dtype == "F16") return v1::FLOAT16;
  if (dtype == "F8_E4M3") return v1::FLOAT8_E4M3;
  if (dtype == "I32") return v1::INT32;
  if (dtype == "I64") return v1::INT64;
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors dtype \"", dtype,
                   "\" has no shardd dtype; allowed: F32, BF16, F16, F8_E4M3, "
                   "I32, I64"));
}

absl::StatusOr<int64_t> ShapeNumel(absl::Span<const int64_t> shape,
                                   int64_t element_bytes) {
  int64_t numel = element_bytes;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape ", ShapeText(shape), ": dimension ", i, " is negative"));
    }
    if (__builtin_mul_overflow(numel, shape[i], &numel)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeText(shape), ": size overflows int64"));
    }
  }
  return element_bytes == 0 ? 0 : numel / element_bytes;
}

absl::StatusOr<std::string> BuildSafetensorsHeader(
    absl::Span<const TensorView> tensors,
    const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  int64_t offset = 0;
  for (const TensorView& t : tensors) {
    const std::string where = absl::StrCat("tensor \"", t.name, "\"");
    if (t.name.empty() || t.name == kMetadataKey) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": name must be non-empty and not \"", kMetadataKey, "\""));
    }
    if (header.contains(t.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": name given twice"));
    }
    const int64_t esize = SafetensorsDTypeBytes(t.dtype);
    if (esize == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": dtype \"", t.dtype,
          "\" is not a safetensors dtype; allowed: ", KnownDTypes()));
    }
    absl::StatusOr<int64_t> numel = ShapeNumel(t.shape, esize);
    if (!numel.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", numel.status().message()));
    }
    const int64_t bytes = *numel * esize;  // ShapeNumel checked overflow.
    if (static_cast<int64_t>(t.bytes.size()) != bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": bytes: ", t.bytes.size(), " given, shape ",
                       ShapeText(t.shape), " of ", t.dtype, " needs ", bytes));
    }
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  SHARDD_ASSIGN_OR_RETURN(std::string text, DumpJson(header));
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

absl::StatusOr<FileDigest> WriteSafetensors(
    const std::string& path, absl::Span<const TensorView> tensors,
    const std::map<std::string, std::string>& metadata) {
  SHARDD_ASSIGN_OR_RETURN(std::string header,
                          BuildSafetensorsHeader(tensors, metadata));
  SHARDD_ASSIGN_OR_RETURN(ScopedFd fd, OpenForWrite(path));
  Xxh64Hasher hasher;
  FileDigest digest;
  auto write = [&](const void* data, int64_t size) {
    hasher.Update(data, size);
    digest.size_bytes += size;
    return WriteFully(fd.get(), data, size, path);
  };
  unsigned char prefix[8];
  LittleEndian64(header.size(), prefix);
  SHARDD_RETURN_IF_ERROR(write(prefix, sizeof(prefix)));
  SHARDD_RETURN_IF_ERROR(write(header.data(), header.size()));
  for (const TensorView& t : tensors) {
    SHARDD_RETURN_IF_ERROR(write(t.bytes.data(), t.bytes.size()));
  }
  SHARDD_RETURN_IF_ERROR(SyncFd(fd.get(), path));
  digest.xxh64 = hasher.Digest();
  return digest;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    absl::string_view header_json, int64_t data_size) {
  SHARDD_ASSIGN_OR_RETURN(json doc,
                          ParseJsonStrict(header_json, "safetensors header",
                                          absl::StatusCode::kDataLoss));
  if (!doc.is_object()) {
    return absl::DataLossError(
        absl::StrCat("safetensors header: must be a JSON object, got ",
                     DescribeJsonValue(doc)));
  }
  SafetensorsHeader out;
  out.data_start = 8 + static_cast<int64_t>(header_json.size());
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const json& v = it.value();
    if (it.key() == kMetadataKey) {
      if (!v.is_object()) {
        return absl::DataLossError(absl::StrCat(
            "safetensors header: ", kMetadataKey,
            " must be an object of strings, got ", DescribeJsonValue(v)));
      }
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return absl::DataLossError(absl::StrCat(
              "safetensors header: ", kMetadataKey, "[\"", m.key(),
              "\"] must be a string, got ", DescribeJsonValue(m.value())));
        }
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where =
        absl::StrCat("safetensors header: tensor \"", it.key(), "\"");
    if (it.key().empty()) {
      return absl::DataLossError(absl::StrCat(where, ": empty name"));
    }
    if (!v.is_object()) {
      return absl::DataLossError(absl::StrCat(
          where, ": must be an object {dtype, shape, data_offsets}, got ",
          DescribeJsonValue(v)));
    }
    for (auto f = v.begin(); f != v.end(); ++f) {
      if (f.key() != "dtype" && f.key() != "shape" &&
          f.key() != "data_offsets") {
        return absl::DataLossError(
            absl::StrCat(where, ": unknown field \"", f.key(),
                         "\"; allowed: dtype, shape, data_offsets"));
      }
    }
    SafetensorsEntry e;
    e.name = it.key();
    // dtype.
    auto dtype = v.find("dtype");
    if (dtype == v.end() || !dtype->is_string()) {
      return absl::DataLossError(absl::StrCat(
          where, ": dtype must be a string, got ",
          dtype == v.end() ? "nothing" : DescribeJsonValue(*dtype)));
    }
    e.dtype = dtype->get<std::string>();
    const int64_t esize = SafetensorsDTypeBytes(e.dtype);
    if (esize == 0) {
      return absl::DataLossError(
          absl::StrCat(where, ": dtype \"", e.dtype,
                       "\" unknown; allowed: ", KnownDTypes()));
    }
    // shape.
    auto shape = v.find("shape");
    if (shape == v.end() || !shape->is_array()) {
      return absl::DataLossError(absl::StrCat(
          where, ": shape must be an array of non-negative integers, got ",
          shape == v.end() ? "nothing" : DescribeJsonValue(*shape)));
    }
    for (size_t i = 0; i < shape->size(); ++i) {
      int64_t d;
      if (!GetNonNegativeInt((*shape)[i], &d)) {
        return absl::DataLossError(absl::StrCat(
            where, ": shape[", i, "] must be a non-negative integer, got ",
            DescribeJsonValue((*shape)[i])));
      }
      e.shape.push_back(d);
    }
    absl::StatusOr<int64_t> numel = ShapeNumel(e.shape, esize);
    if (!numel.ok()) {
      return absl::DataLossError(
          absl::StrCat(where, ": ", numel.status().message()));
    }
    e.numel = *numel;
    // data_offsets.
    auto offsets = v.find("data_offsets");
    if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2 ||
        !GetNonNegativeInt((*offsets)[0], &e.data_begin) ||
        !GetNonNegativeInt((*offsets)[1], &e.data_end)) {
      return absl::DataLossError(absl::StrCat(
          where,
          ": data_offsets must be [begin, end] of non-negative "
          "integers, got ",
          offsets == v.end() ? "nothing" : DescribeJsonValue(*offsets)));
    }
    if (e.data_begin > e.data_end) {
      return absl::DataLossError(absl::StrCat(where, ": data_offsets [",
                                              e.data_begin, ", ", e.data_end,
                                              "] end before begin"));
    }
    if (e.data_end > data_size) {
      return absl::DataLossError(absl::StrCat(
          where, ": data_offsets [", e.data_begin, ", ", e.data_end,
          "] past the end of the data section (", data_size, " bytes)"));
    }
    if (e.byte_size() != e.numel * esize) {
      return absl::DataLossError(absl::StrCat(
          where, ": data_offsets [", e.data_begin, ", ", e.data_end, "] hold ",
          e.byte_size(), " bytes, shape ", ShapeText(e.shape), " of ", e.dtype,
          " needs ", e.numel * esize));
    }
    out.tensors.push_back(std::move(e));
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return std::tie(a.data_begin, a.data_end, a.name) <
                     std::tie(b.data_begin, b.data_end, b.name);
            });
  // Sorted by begin, the tensors must tile the data section exactly.
  int64_t expected = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& e : out.tensors) {
    if (e.data_begin < expected) {
      return absl::DataLossError(absl::StrCat(
          "safetensors header: tensor \"", e.name, "\": data_offsets [",
          e.data_begin, ", ", e.data_end, "] overlap tensor \"", previous->name,
          "\" ending at ", expected));
    }
    if (e.data_begin > expected) {
      return absl::DataLossError(absl::StrCat(
          "safetensors header: tensor \"", e.name, "\": data_offsets [",
          e.data_begin, ", ", e.data_end, "] leave bytes [", expected, ", ",
          e.data_begin, ") of the data section unowned"));
    }
    expected = e.data_end;
    previous = &e;
  }
  if (expected != data_size) {
    return absl::DataLossError(
        absl::StrCat("safetensors header: tensors end at byte ", expected,
                     " of the data section, but it holds ", data_size,
                     " bytes (trailing bytes unowned)"));
  }
  return out;
}

SafetensorsReader::SafetensorsReader(std::string path, ScopedFd fd,
                                     int64_t file_size,
                                     SafetensorsHeader header)
    : path_(std::move(path)),
      fd_(std::move(fd)),
      file_size_(file_size),
      header_(std::move(header)) {
  for (size_t i = 0; i < header_.tensors.size(); ++i) {
    by_name_[header_.tensors[i].name] = static_cast<int>(i);
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(
    const std::string& path) {
  SHARDD_ASSIGN_OR_RETURN(ScopedFd fd, OpenForRead(path));
  SHARDD_ASSIGN_OR_RETURN(int64_t file_size, FileSize(fd.get(), path));
  if (file_size < 8) {
    return absl::DataLossError(absl::StrCat(
        path, ": ", file_size,
        " bytes, too short for the 8-byte header length (truncated?)"));
  }
  unsigned char prefix[8];
  SHARDD_RETURN_IF_ERROR(PreadFully(fd.get(), 0, 8, prefix, path));
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | prefix[i];
  if (header_size == 0 ||
      header_size > static_cast<uint64_t>(kMaxSafetensorsHeaderBytes)) {
    return absl::DataLossError(absl::StrCat(path, ": header length ",
                                            header_size, " must be in [1, ",
                                            kMaxSafetensorsHeaderBytes, "]"));
  }
  if (8 + static_cast<int64_t>(header_size) > file_size) {
    return absl::DataLossError(absl::StrCat(
        path, ": header length ", header_size, " runs past the end of the ",
        file_size, "-byte file (truncated?)"));
  }
  std::string text(header_size, '\0');
  SHARDD_RETURN_IF_ERROR(
      PreadFully(fd.get(), 8, header_size, text.data(), path));
  const int64_t data_start = 8 + static_cast<int64_t>(header_size);
  absl::StatusOr<SafetensorsHeader> header =
      ParseSafetensorsHeader(text, file_size - data_start);
  if (!header.ok()) {
    return absl::Status(header.status().code(),
                        absl::StrCat(path, ": ", header.status().message()));
  }
  return std::unique_ptr<SafetensorsReader>(new SafetensorsReader(
      path, std::move(fd), file_size, *std::move(header)));
}

const SafetensorsEntry* SafetensorsReader::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

absl::Status SafetensorsReader::ReadBytes(const SafetensorsEntry& entry,
                                          int64_t offset, int64_t size,
                                          void* out) const {
  if (offset < 0 || size < 0 || offset > entry.byte_size() ||
      size > entry.byte_size() - offset) {
    return absl::OutOfRangeError(absl::StrCat(
        path_, ": tensor \"", entry.name, "\": bytes [", offset, ", +", size,
        ") outside its ", entry.byte_size(), " bytes"));
  }
  if (size == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(
      PreadFully(fd_.get(), header_.data_start + entry.data_begin + offset,
                 size, out, path_));
  data_bytes_read_.fetch_add(size);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> SafetensorsReader::ReadTensor(
    const SafetensorsEntry& entry) const {
  std::vector<uint8_t> bytes(static_cast<size_t>(entry.byte_size()));
  SHARDD_RETURN_IF_ERROR(ReadBytes(entry, 0, entry.byte_size(), bytes.data()));
  return bytes;
}

}  // namespace checkpoint
}  // namespace shardd
