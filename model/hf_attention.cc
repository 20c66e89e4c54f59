#include "model/hf_attention.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardd {
namespace hf_internal {
namespace {

constexpr int64_t kMaxPositions = int64_t{1} << 26;

// A number field of a rope object; `def` when absent or null.
absl::StatusOr<double> Number(const json& obj, const std::string& where,
                              const std::string& key, double def) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return def;
  if (!it->is_number() || !std::isfinite(it->get<double>())) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".", key, ": must be a number, got ", DescribeJson(*it)));
  }
  return it->get<double>();
}

absl::Status Positive(double value, const std::string& name) {
  if (!(value > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": must be > 0, got ", value));
  }
  return absl::OkStatus();
}

absl::Status ReadRope(const ConfigReader& r, int64_t max_positions,
                      v1::RopeSpec* rope) {
  std::string where;
  const json* params = r.Find("rope_parameters", &where);
  if (params == nullptr) params = r.Find("rope_scaling", &where);
  if (params != nullptr && !params->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": must be an object, got ", DescribeJson(*params)));
  }
  const json empty = json::object();
  SHARDD_ASSIGN_OR_RETURN(const double top_theta,
                          r.NonNegativeDoubleOr("rope_theta", 10000.0));
  SHARDD_ASSIGN_OR_RETURN(const double top_partial,
                          r.NonNegativeDoubleOr("partial_rotary_factor", 1.0));
  return ReadRopeObject(params != nullptr ? *params : empty, where, top_theta,
                        top_partial, max_positions, rope);
}

}  // namespace

absl::Status ReadRopeObject(const json& p, const std::string& where,
                            double default_theta, double default_partial,
                            int64_t max_positions, v1::RopeSpec* rope) {
  SHARDD_ASSIGN_OR_RETURN(const double theta,
                          Number(p, where, "rope_theta", default_theta));
  SHARDD_RETURN_IF_ERROR(Positive(theta, "rope_theta"));
  rope->set_theta(theta);
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    auto it = p.find(key);
    if (it != p.end() && !it->is_null()) {
      if (!it->is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".", key, ": must be a string, got ", DescribeJson(*it)));
      }
      type = it->get<std::string>();
      break;
    }
  }
  // "dynamic" NTK changes the frequencies only past max_position_embeddings,
  // which a training sequence never reaches: default there.
  if (type == "dynamic") type = "default";
  if (type != "default" && type != "linear" && type != "llama3" &&
      type != "yarn" && type != "proportional") {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".rope_type: \"", type,
        "\" is not supported; allowed: default, linear, dynamic, llama3, "
        "yarn, proportional"));
  }
  rope->set_type(type);
  SHARDD_ASSIGN_OR_RETURN(
      const double partial,
      Number(p, where, "partial_rotary_factor", default_partial));
  if (!(partial > 0 && partial <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partial_rotary_factor: must be in (0, 1], got ", partial));
  }
  rope->set_partial_rotary_factor(partial);
  SHARDD_ASSIGN_OR_RETURN(const double factor, Number(p, where, "factor", 0.0));
  if (type == "linear" || type == "llama3") {
    SHARDD_RETURN_IF_ERROR(Positive(factor, where + ".factor"));
  }
  rope->set_factor(factor);
  SHARDD_ASSIGN_OR_RETURN(const double original,
                          Number(p, where, "original_max_position_embeddings",
                                 static_cast<double>(max_positions)));
  SHARDD_RETURN_IF_ERROR(
      Positive(original, where + ".original_max_position_embeddings"));
  rope->set_original_max_position_embeddings(static_cast<int64_t>(original));
  if (type == "llama3") {
    SHARDD_ASSIGN_OR_RETURN(const double low,
                            Number(p, where, "low_freq_factor", 0.0));
    SHARDD_ASSIGN_OR_RETURN(const double high,
                            Number(p, where, "high_freq_factor", 0.0));
    SHARDD_RETURN_IF_ERROR(Positive(low, where + ".low_freq_factor"));
    if (!(high > low)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".high_freq_factor: must be greater than low_freq_factor (",
          low, "), got ", high));
    }
    rope->set_low_freq_factor(low);
    rope->set_high_freq_factor(high);
  }
  if (type == "yarn") {
    SHARDD_ASSIGN_OR_RETURN(const double beta_fast,
                            Number(p, where, "beta_fast", 0.0));
    SHARDD_ASSIGN_OR_RETURN(const double beta_slow,
                            Number(p, where, "beta_slow", 0.0));
    SHARDD_ASSIGN_OR_RETURN(const double mscale,
                            Number(p, where, "mscale", 0.0));
    SHARDD_ASSIGN_OR_RETURN(const double mscale_all,
                            Number(p, where, "mscale_all_dim", 0.0));
    SHARDD_ASSIGN_OR_RETURN(const double attention,
                            Number(p, where, "attention_factor", 0.0));
    rope->set_beta_fast(beta_fast);
    rope->set_beta_slow(beta_slow);
    rope->set_mscale(mscale);
    rope->set_mscale_all_dim(mscale_all);
    rope->set_attention_factor(attention);
    auto truncate = p.find("truncate");
    if (truncate != p.end() && !truncate->is_null()) {
      if (!truncate->is_boolean()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".truncate: must be true or false, got ",
                         DescribeJson(*truncate)));
      }
      rope->set_untruncated(!truncate->get<bool>());
    }
  }
  return absl::OkStatus();
}

absl::Status ReadAttention(const ConfigReader& r, int64_t layers,
                           SlidingLayers sliding, v1::AttentionSpec* out) {
  SHARDD_ASSIGN_OR_RETURN(
      const int64_t max_positions,
      r.IntOr("max_position_embeddings", 4096, 1, kMaxPositions));
  out->set_max_position_embeddings(max_positions);
  SHARDD_RETURN_IF_ERROR(ReadRope(r, max_positions, out->mutable_rope()));

  std::string name;
  const json* window = r.Find("sliding_window", &name);
  int64_t window_size = 0;
  if (window != nullptr) {
    SHARDD_ASSIGN_OR_RETURN(window_size,
                            r.Int("sliding_window", 1, kMaxPositions));
  } else if (sliding == SlidingLayers::kAlternate) {
    window_size = 128;  // GptOssConfig's default.
  }
  out->clear_sliding_layers();
  const json* types = r.Find("layer_types", &name);
  if (types != nullptr) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != layers) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": must be a list of ", layers,
                       " strings \"sliding_attention\" or \"full_attention\""));
    }
    bool any = false;
    for (size_t i = 0; i < types->size(); ++i) {
      const json& t = (*types)[i];
      const bool is_sliding =
          t.is_string() && t.get<std::string>() == "sliding_attention";
      if (!is_sliding &&
          !(t.is_string() && t.get<std::string>() == "full_attention")) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, "[", i,
                         "]: must be \"sliding_attention\" or "
                         "\"full_attention\", got ",
                         DescribeJson(t)));
      }
      out->add_sliding_layers(is_sliding);
      any = any || is_sliding;
    }
    if (any && window_size == 0) {
      return absl::InvalidArgumentError(
          "sliding_window: missing, but layer_types has sliding_attention "
          "layers; set it to an integer >= 1");
    }
    if (!any) out->clear_sliding_layers();
  } else if (window_size > 0 && (sliding == SlidingLayers::kAllWhenSet ||
                                 sliding == SlidingLayers::kQwen)) {
    bool use = true;
    int64_t first = 0;
    if (sliding == SlidingLayers::kQwen) {
      SHARDD_ASSIGN_OR_RETURN(use, r.BoolOr("use_sliding_window", false));
      SHARDD_ASSIGN_OR_RETURN(first,
                              r.IntOr("max_window_layers", layers, 0, layers));
    }
    if (use && first < layers) {
      for (int64_t i = 0; i < layers; ++i) out->add_sliding_layers(i >= first);
    }
  } else if (window_size > 0 && sliding == SlidingLayers::kAlternate) {
    for (int64_t i = 0; i < layers; ++i) out->add_sliding_layers(i % 2 == 0);
  }
  out->set_sliding_window(out->sliding_layers_size() > 0 ? window_size : 0);
  return absl::OkStatus();
}

}  // namespace hf_internal
}  // namespace shardd
