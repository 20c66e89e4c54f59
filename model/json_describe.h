#ifndef SHARDD_MODEL_JSON_DESCRIBE_H_
#define SHARDD_MODEL_JSON_DESCRIBE_H_

#include <string>

#include "nlohmann/json.hpp"

namespace shardd {

// A short description of a JSON value for error messages: "null", "true",
// "a string", "an array", "an object", or the number itself (cut at 40
// characters). Never throws.
std::string DescribeJson(const nlohmann::json& value);

}  // namespace shardd

#endif  // SHARDD_MODEL_JSON_DESCRIBE_H_
