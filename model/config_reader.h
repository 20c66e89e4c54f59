#ifndef SHARDD_MODEL_CONFIG_READER_H_
#define SHARDD_MODEL_CONFIG_READER_H_

// Typed, range-checked reads of a Hugging Face config.json (internal to
// model/: hf_config and hf_attention).

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "model/json_describe.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace hf_internal {

using nlohmann::json;

// Typed, range-checked access to config.json fields. Multimodal configs nest
// the language model under "text_config"; fields are looked up there first.
class ConfigReader {
 public:
  explicit ConfigReader(const json& top) : top_(top) {
    auto it = top.find("text_config");
    if (it != top.end() && it->is_object()) text_ = &*it;
  }

  // A reader of the top-level fields only, for those of a multimodal
  // wrapper config (DiffusionGemma's canvas_length).
  ConfigReader TopLevel() const { return ConfigReader(top_, nullptr); }

  // Whether the field is present with the value null (where a family gives
  // null a meaning of its own rather than "absent").
  bool IsNull(const std::string& key) const {
    if (text_ != nullptr) {
      auto it = text_->find(key);
      if (it != text_->end()) return it->is_null();
    }
    auto it = top_.find(key);
    return it != top_.end() && it->is_null();
  }

  // The field's value and its printable name; nullptr when absent or null.
  const json* Find(const std::string& key, std::string* name) const {
    if (text_ != nullptr) {
      auto it = text_->find(key);
      if (it != text_->end() && !it->is_null()) {
        *name = "text_config." + key;
        return &*it;
      }
    }
    *name = key;
    auto it = top_.find(key);
    if (it == top_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  bool Has(const std::string& key) const {
    std::string name;
    return Find(key, &name) != nullptr;
  }

  // Required integer in [lo, hi].
  absl::StatusOr<int64_t> Int(const std::string& key, int64_t lo,
                              int64_t hi) const {
    std::string name;
    const json* v = Find(key, &name);
    if (v == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": missing; must be an integer in [", lo, ", ", hi, "]"));
    }
    return CheckInt(*v, name, lo, hi);
  }

  // Optional integer in [lo, hi]; absent or null gives `def`.
  absl::StatusOr<int64_t> IntOr(const std::string& key, int64_t def, int64_t lo,
                                int64_t hi) const {
    std::string name;
    const json* v = Find(key, &name);
    if (v == nullptr) return def;
    return CheckInt(*v, name, lo, hi);
  }

  absl::StatusOr<bool> BoolOr(const std::string& key, bool def) const {
    std::string name;
    const json* v = Find(key, &name);
    if (v == nullptr) return def;
    if (!v->is_boolean()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": must be true or false, got ", DescribeJson(*v)));
    }
    return v->get<bool>();
  }

  absl::StatusOr<double> NonNegativeDoubleOr(const std::string& key,
                                             double def) const {
    std::string name;
    const json* v = Find(key, &name);
    if (v == nullptr) return def;
    if (!v->is_number()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": must be a non-negative number, got ", DescribeJson(*v)));
    }
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": must be a non-negative number, got ", DescribeJson(*v)));
    }
    return d;
  }

  absl::StatusOr<std::string> StringOr(const std::string& key,
                                       const std::string& def) const {
    std::string name;
    const json* v = Find(key, &name);
    if (v == nullptr) return def;
    if (!v->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": must be a string, got ", DescribeJson(*v)));
    }
    return v->get<std::string>();
  }

 private:
  static absl::StatusOr<int64_t> CheckInt(const json& v,
                                          const std::string& name, int64_t lo,
                                          int64_t hi) {
    const std::string allowed =
        absl::StrCat("must be an integer in [", lo, ", ", hi, "]");
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": ", allowed, ", got ", u));
      }
      if (static_cast<int64_t>(u) < lo) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": ", allowed, ", got ", u));
      }
      return static_cast<int64_t>(u);
    }
    if (v.is_number_integer()) {
      const int64_t i = v.get<int64_t>();
      if (i < lo || i > hi) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": ", allowed, ", got ", i));
      }
      return i;
    }
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", allowed, ", got ", DescribeJson(v)));
  }

  ConfigReader(const json& top, const json* text) : top_(top), text_(text) {}

  const json& top_;
  const json* text_ = nullptr;
};

}  // namespace hf_internal
}  // namespace shardd

#endif  // SHARDD_MODEL_CONFIG_READER_H_
