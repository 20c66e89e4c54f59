// Runs without a GPU: the argument checks of expert_permute.h return before
// any CUDA call, naming the argument and what is allowed.

#include <cstdint>

#include "absl/status/status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/expert_permute.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ::testing::HasSubstr;

// Never dereferenced: the checks fail first or there is nothing to do.
float* const kF = reinterpret_cast<float*>(64);
const int32_t* const kI32 = reinterpret_cast<const int32_t*>(64);
const int64_t* const kI64 = reinterpret_cast<const int64_t*>(64);

void ExpectInvalid(const absl::Status& status, const char* needle) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr(needle)) << status;
}

TEST(ExpertPermuteArgsTest, RefusesBadSizesAndNullPointers) {
  ExpectInvalid(PackDispatchRows(kF, kF, kI32, kI64, -1, 2, 8, 4, kF, nullptr),
                "rows");
  ExpectInvalid(PackDispatchRows(kF, kF, kI32, kI64, 3, 0, 8, 4, kF, nullptr),
                "k");
  ExpectInvalid(PackDispatchRows(kF, kF, kI32, kI64, 3, 2, 0, 4, kF, nullptr),
                "d");
  ExpectInvalid(PackDispatchRows(kF, kF, kI32, kI64, 3, 2, 8, 0, kF, nullptr),
                "local_experts");
  ExpectInvalid(
      PackDispatchRows(kF, nullptr, kI32, kI64, 3, 2, 8, 4, kF, nullptr),
      "weights");
  ExpectInvalid(
      UnpackDispatchRows(kF, 3, 8, kF, nullptr, kF, nullptr), "ids_r");
  ExpectInvalid(PackGradRows(kF, nullptr, 3, 2, 8, kF, nullptr), "order");
  ExpectInvalid(PackCombineGradRows(kF, kF, 3, -1, kF, nullptr), "d");
  ExpectInvalid(CombineRows(kF, kI64, 3, 2, 7, 8, kF, nullptr, nullptr),
                "width");
  ExpectInvalid(CombineRows(kF, kI64, 3, 2, 8, 8, kF, kF, nullptr),
                "d_weights");
  ExpectInvalid(CombineRows(kF, nullptr, 3, 2, 8, 8, kF, nullptr, nullptr),
                "position");
}

TEST(ExpertPermuteArgsTest, EmptyInputsAreNoOps) {
  // Nothing to launch: OK without a device and with null buffers.
  SHARDD_EXPECT_OK(PackDispatchRows(static_cast<const float*>(nullptr),
                                    nullptr, nullptr, nullptr, 0, 2, 8, 4,
                                    nullptr, nullptr));
  SHARDD_EXPECT_OK(UnpackDispatchRows(nullptr, 0, 8,
                                      static_cast<float*>(nullptr), nullptr,
                                      nullptr, nullptr));
  SHARDD_EXPECT_OK(CombineRows(nullptr, nullptr, 0, 2, 9, 8,
                               static_cast<uint16_t*>(nullptr), nullptr,
                               nullptr));
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
