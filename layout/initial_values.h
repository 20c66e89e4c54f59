#ifndef SHARDD_LAYOUT_INITIAL_VALUES_H_
#define SHARDD_LAYOUT_INITIAL_VALUES_H_

// Where a rank's fresh fp32 master shards take their values from when they
// do not come from the seeded initialisation (param_init.h): for example a
// Hugging Face checkpoint (checkpoint/hf_weights.h). InitMasterShards asks
// for exactly the global element ranges the rank owns, so an implementation
// reads only those.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "proto/model.pb.h"

namespace shardd {

class InitialValues {
 public:
  virtual ~InitialValues() = default;

  // Writes elements [begin, end) of parameter `name` (fully qualified;
  // row-major over tensor.shape(), the global shape) as fp32 into `out`.
  // Called concurrently only with distinct `out` buffers; implementations
  // are thread-safe. Errors: implementation-defined, each naming the
  // parameter.
  virtual absl::Status Read(const std::string& name,
                            const v1::TensorSpec& tensor, int64_t begin,
                            int64_t end, float* out) const = 0;

  // False for a parameter these values leave to the seeded initialisation
  // (e.g. fresh LoRA adapters over a base checkpoint).
  virtual bool Provides(const std::string& name) const { return true; }
};

}  // namespace shardd

#endif  // SHARDD_LAYOUT_INITIAL_VALUES_H_
