#include "checkpoint/json_text.h"

#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardd {
namespace checkpoint {
namespace {

using nlohmann::json;

// A SAX pass that builds nothing: it records the first syntax error and the
// first repeated object key, which the DOM parser would silently accept.
class StrictChecker : public nlohmann::json_sax<json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return true;
  }
  bool key(string_t& k) override {
    if (!keys_.back().insert(k).second) {
      error_ = absl::StrCat("key \"", k, "\" appears twice in one object");
      return false;
    }
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    error_ = absl::StrCat("malformed JSON at byte ", position, ": ", ex.what());
    return false;
  }

  const std::string& error() const { return error_; }

 private:
  std::vector<std::set<std::string>> keys_;
  std::string error_;
};

// First string or key in `value` that is not valid UTF-8, as a JSON path.
bool FindBadUtf8(const json& value, const std::string& path,
                 std::string* where) {
  if (value.is_string()) {
    if (!IsValidUtf8(value.get_ref<const std::string&>())) {
      *where = path.empty() ? "the value" : path;
      return true;
    }
  } else if (value.is_object()) {
    for (auto it = value.begin(); it != value.end(); ++it) {
      if (!IsValidUtf8(it.key())) {
        *where =
            absl::StrCat("a key in ", path.empty() ? "the top level" : path);
        return true;
      }
      if (FindBadUtf8(it.value(), absl::StrCat(path, "/", it.key()), where)) {
        return true;
      }
    }
  } else if (value.is_array()) {
    for (size_t i = 0; i < value.size(); ++i) {
      if (FindBadUtf8(value[i], absl::StrCat(path, "/", i), where)) return true;
    }
  }
  return false;
}

}  // namespace

absl::StatusOr<json> ParseJsonStrict(absl::string_view text,
                                     absl::string_view what,
                                     absl::StatusCode code) {
  StrictChecker checker;
  if (!json::sax_parse(text.begin(), text.end(), &checker,
                       nlohmann::detail::input_format_t::json,
                       /*strict=*/true)) {
    return absl::Status(code, absl::StrCat(what, ": ", checker.error()));
  }
  json value = json::parse(text.begin(), text.end(), nullptr,
                           /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    return absl::Status(code, absl::StrCat(what, ": malformed JSON"));
  }
  return value;
}

absl::StatusOr<std::string> DumpJson(const json& value, int indent) {
  std::string where;
  if (FindBadUtf8(value, "", &where)) {
    return absl::InvalidArgumentError(
        absl::StrCat("JSON text must be UTF-8; ", where, " is not"));
  }
  // Checked above, so the handler never throws.
  return value.dump(indent, ' ', /*ensure_ascii=*/false,
                    json::error_handler_t::replace);
}

bool IsValidUtf8(absl::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = p + text.size();
  while (p < end) {
    const unsigned char c = *p;
    int extra;
    uint32_t cp;
    if (c < 0x80) {
      ++p;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      extra = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (end - p <= extra) return false;
    for (int i = 1; i <= extra; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[extra] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    p += extra + 1;
  }
  return true;
}

bool GetNonNegativeInt(const json& value, int64_t* out) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return false;
    }
    *out = static_cast<int64_t>(v);
    return true;
  }
  if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    if (v < 0) return false;
    *out = v;
    return true;
  }
  return false;
}

std::string DescribeJsonValue(const json& value) {
  if (value.is_object()) return "an object";
  if (value.is_array()) return absl::StrCat("an array of ", value.size());
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 40) text = absl::StrCat(text.substr(0, 37), "...");
  return absl::StrCat(value.type_name(), " ", text);
}

}  // namespace checkpoint
}  // namespace shardd
