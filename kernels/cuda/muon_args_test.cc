// Runs without a GPU: the argument checks of muon.h return before any CUDA
// call, and the workspace arithmetic.

#include <cublas_v2.h>

#include <limits>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/cpu/muon.h"
#include "kernels/cuda/muon.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

TEST(MuonArgsTest, RefusesBadArguments) {
  float* p = reinterpret_cast<float*>(256);
  cublasHandle_t h = reinterpret_cast<cublasHandle_t>(256);
  EXPECT_EQ(MuonMomentumStep(p, p, 4, 1.0f, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MuonNesterovUpdate(p, p, 4, 0.9f, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MuonApply(p, p, 4, -1.0, 0.0, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MuonScale(p, -1, 2.0f, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MuonScale(nullptr, 4, 2.0f, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MuonScale(p, 4, std::numeric_limits<float>::infinity(), nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NewtonSchulz(h, p, 0, 4, 5, p, 1 << 20, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NewtonSchulz(h, p, 4, 4, 0, p, 1 << 20, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NewtonSchulz(h, p, 4, 4, 5, p, 16, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // workspace too small
  EXPECT_EQ(NewtonSchulz(nullptr, p, 4, 4, 5, p, 1 << 20, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_GT(NewtonSchulzWorkspaceBytes(96, 32),
            kernels::NewtonSchulzWorkspace(96, 32) * sizeof(float));
  EXPECT_EQ(NewtonSchulzWorkspaceBytes(0, 32), 0u);
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
