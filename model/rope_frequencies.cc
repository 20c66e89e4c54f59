#include "model/rope_frequencies.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace shardd {
namespace {

// YaRN's magnitude correction m(s, k).
double YarnMscale(double scale, double k) {
  return scale <= 1.0 ? 1.0 : 0.1 * k * std::log(scale) + 1.0;
}

// The dimension at which `rotations` full turns fit the original context.
double CorrectionDim(double rotations, int64_t dim, double base,
                     double positions) {
  return dim * std::log(positions / (rotations * 2.0 * M_PI)) /
         (2.0 * std::log(base));
}

}  // namespace

absl::StatusOr<RopeFrequencies> ComputeRopeFrequencies(const v1::RopeSpec& rope,
                                                       int64_t head_dim) {
  const std::string type = rope.type().empty() ? "default" : rope.type();
  const double theta = rope.theta();
  if (!(theta > 0) || !std::isfinite(theta)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope.theta: must be > 0, got ", theta));
  }
  const double partial =
      rope.partial_rotary_factor() == 0 ? 1.0 : rope.partial_rotary_factor();
  RopeFrequencies out;
  out.interleaved = rope.interleaved();
  std::vector<double> f;
  if (type == "proportional") {
    const int64_t rotated = static_cast<int64_t>(partial * head_dim / 2);
    const double factor = rope.factor() > 0 ? rope.factor() : 1.0;
    f.assign(head_dim / 2, 0.0);
    for (int64_t i = 0; i < rotated; ++i) {
      f[i] = std::pow(theta, -static_cast<double>(2 * i) / head_dim) / factor;
    }
  } else {
    const int64_t dim = static_cast<int64_t>(head_dim * partial);
    if (dim < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("rope.partial_rotary_factor: rotates ", dim, " of ",
                       head_dim, " dims; at least 2 must rotate"));
    }
    f.resize(dim / 2);
    for (int64_t i = 0; i < dim / 2; ++i) {
      f[i] = std::pow(theta, -static_cast<double>(2 * i) / dim);
    }
    const double factor = rope.factor();
    if (type == "linear" || type == "llama3" || type == "yarn") {
      if (!(factor > 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rope.factor: a ", type, " rope needs factor > 0, got ", factor));
      }
    }
    if (type == "linear") {
      for (double& x : f) x /= factor;
    } else if (type == "llama3") {
      const double original = rope.original_max_position_embeddings();
      const double low = rope.low_freq_factor(), high = rope.high_freq_factor();
      if (!(original > 0) || !(low > 0) || !(high > low)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rope: llama3 needs original_max_position_embeddings > 0 and "
            "0 < low_freq_factor < high_freq_factor, got ",
            original, ", ", low, ", ", high));
      }
      const double low_wavelen = original / low;
      const double high_wavelen = original / high;
      for (double& x : f) {
        const double wavelen = 2.0 * M_PI / x;
        if (wavelen > low_wavelen) {
          x /= factor;
        } else if (!(wavelen < high_wavelen)) {
          const double smooth = (original / wavelen - low) / (high - low);
          x = (1.0 - smooth) * x / factor + smooth * x;
        }
      }
    } else if (type == "yarn") {
      const double original = rope.original_max_position_embeddings();
      if (!(original > 0)) {
        return absl::InvalidArgumentError(
            "rope.original_max_position_embeddings: yarn needs it > 0");
      }
      const double fast = rope.beta_fast() > 0 ? rope.beta_fast() : 32.0;
      const double slow = rope.beta_slow() > 0 ? rope.beta_slow() : 1.0;
      double lo = CorrectionDim(fast, dim, theta, original);
      double hi = CorrectionDim(slow, dim, theta, original);
      if (!rope.untruncated()) {
        lo = std::floor(lo);
        hi = std::ceil(hi);
      }
      lo = std::max(lo, 0.0);
      hi = std::min(hi, static_cast<double>(dim - 1));
      if (lo == hi) hi += 0.001;  // No singular ramp.
      for (int64_t i = 0; i < dim / 2; ++i) {
        const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
        const double extrapolation = 1.0 - ramp;
        f[i] = f[i] / factor * (1.0 - extrapolation) + f[i] * extrapolation;
      }
      double attention = rope.attention_factor();
      if (attention == 0) {
        attention = rope.mscale() != 0 && rope.mscale_all_dim() != 0
                        ? YarnMscale(factor, rope.mscale()) /
                              YarnMscale(factor, rope.mscale_all_dim())
                        : YarnMscale(factor, 1.0);
      }
      out.attention_factor = static_cast<float>(attention);
    } else if (type != "default") {
      return absl::InvalidArgumentError(absl::StrCat(
          "rope.type: \"", type,
          "\" is not supported; allowed: default, linear, llama3, yarn, "
          "proportional"));
    }
  }
  out.inv_freq.assign(f.begin(), f.end());
  return out;
}

}  // namespace shardd
