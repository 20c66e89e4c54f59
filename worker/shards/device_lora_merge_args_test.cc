// Runs without a GPU: the argument checks of device_lora_merge.h return
// before any CUDA call.

#include <cublas_v2.h>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "model/lora.h"
#include "worker/shards/device_lora_merge.h"

namespace shardd {
namespace {

TEST(DeviceLoraMergeTest, RefusesBadTargetsAndBuffers) {
  LoraTarget t;
  t.base = "q_proj.weight";
  t.in = 4;
  t.out = 4;
  t.rank = 0;
  float* p = reinterpret_cast<float*>(64);
  cublasHandle_t h = reinterpret_cast<cublasHandle_t>(64);
  absl::Status s = DeviceLoraMergeInto(h, nullptr, t, 0, p, p, p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank = 0"), absl::string_view::npos) << s;
  t.rank = 2;
  s = DeviceLoraSplitGrad(h, nullptr, t, 0, p, p, nullptr, p, p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // The null buffer is named.
  EXPECT_NE(s.message().find("g is null"), absl::string_view::npos) << s;
  s = DeviceLoraMergeInto(nullptr, nullptr, t, 0, p, p, p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("handle"), absl::string_view::npos) << s;
  s = DeviceLoraMergeInto(h, nullptr, t, -1, p, p, p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace
}  // namespace shardd
