#include "model/json_describe.h"

#include <string>

namespace shardd {

std::string DescribeJson(const nlohmann::json& value) {
  using json = nlohmann::json;
  switch (value.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return value.get<bool>() ? "true" : "false";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default: {
      std::string s =
          value.dump(-1, ' ', false, json::error_handler_t::replace);
      if (s.size() > 40) s = s.substr(0, 40) + "...";
      return s;
    }
  }
}

}  // namespace shardd
