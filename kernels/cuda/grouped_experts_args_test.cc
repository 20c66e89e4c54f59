// Runs without a GPU: the workspace-size arithmetic and the argument checks
// that return before any CUDA call.

#include <cstddef>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/grouped_experts.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

TEST(GroupedExpertsWorkspaceBytesTest, SmallCaseByHand) {
  // T=10, D=8, I=4, E=3, K=2, fp32: 20 slots in one routing chunk. Regions,
  // each starting on a 256-byte boundary:
  //   status 4*4 @0, chunk counts 3*4 @256, offsets 4*4 @512,
  //   nonempty 3*4 @768, row_of_slot / row_token / row_weight / row_dweight
  //   20*4 each @1024 @1280 @1536 @1792, GEMM pointers 6*3*3*8=432 @2048,
  //   xs 20*8*4=640 @2560, h 20*8*4=640 @3328, a 20*4*4=320 @4096,
  //   o 640 @4608, da 320 @5376, dh 640 @5888 -> ends at 6528.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const size_t bytes,
      GroupedExpertsWorkspaceBytes({10, 8, 4, 3, 2}, ExpertStorage::kFloat32));
  EXPECT_EQ(bytes, 6528u);
}

TEST(GroupedExpertsWorkspaceBytesTest, ActivationsDominateAtScale) {
  // Qwen3-30B-A3B experts at 16k tokens: per slot the six activation
  // buffers hold 2D + 6I elements and the routing rows 16 bytes; the rest is
  // O(E * chunks) plus alignment.
  const ExpertDims dims{16384, 2048, 768, 128, 8};
  const uint64_t slots = 16384 * 8;
  for (ExpertStorage storage :
       {ExpertStorage::kFloat32, ExpertStorage::kBFloat16}) {
    const uint64_t elem = storage == ExpertStorage::kFloat32 ? 4 : 2;
    SHARDD_ASSERT_OK_AND_ASSIGN(const size_t bytes,
                                GroupedExpertsWorkspaceBytes(dims, storage));
    const uint64_t floor = slots * ((2 * 2048 + 6 * 768) * elem + 16);
    const uint64_t chunks = (slots + 2047) / 2048;
    const uint64_t small = (1 + 128) * 4 + chunks * 128 * 4 + 129 * 4 +
                           128 * 4 + 6 * 3 * 128 * 8 + 15 * 256;
    EXPECT_GE(bytes, floor);
    EXPECT_LE(bytes, floor + small);
  }
}

TEST(GroupedExpertsWorkspaceBytesTest, GrowsWithTokensAndBf16IsSmaller) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const size_t small, GroupedExpertsWorkspaceBytes(
                              {100, 64, 32, 8, 2}, ExpertStorage::kBFloat16));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const size_t large, GroupedExpertsWorkspaceBytes(
                              {200, 64, 32, 8, 2}, ExpertStorage::kBFloat16));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const size_t large_fp32,
      GroupedExpertsWorkspaceBytes({200, 64, 32, 8, 2},
                                   ExpertStorage::kFloat32));
  EXPECT_LT(small, large);
  EXPECT_LT(large, large_fp32);
  // Zero tokens still has the per-expert regions.
  SHARDD_ASSERT_OK_AND_ASSIGN(const size_t empty,
                              GroupedExpertsWorkspaceBytes(
                                  {0, 64, 32, 8, 2}, ExpertStorage::kBFloat16));
  EXPECT_GT(empty, 0u);
  EXPECT_LT(empty, small);
}

TEST(GroupedExpertsWorkspaceBytesTest, RejectsBadDimsNamingTheField) {
  const ExpertStorage bf16 = ExpertStorage::kBFloat16;
  EXPECT_THAT(
      GroupedExpertsWorkspaceBytes({-1, 8, 4, 3, 2}, bf16),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens")));
  EXPECT_THAT(GroupedExpertsWorkspaceBytes({1, 0, 4, 3, 2}, bf16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dim")));
  EXPECT_THAT(
      GroupedExpertsWorkspaceBytes({1, 8, 0, 3, 2}, bf16),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("intermediate")));
  EXPECT_THAT(
      GroupedExpertsWorkspaceBytes({1, 8, 4, kMaxGroupedExperts + 1, 2}, bf16),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("experts count must be in [1, 8192]")));
  EXPECT_THAT(GroupedExpertsWorkspaceBytes({1, 8, 4, 3, 4}, bf16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
  EXPECT_THAT(GroupedExpertsWorkspaceBytes({kMaxInt / 2 + 1, 8, 4, 3, 2}, bf16),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tokens * top_k")));
  EXPECT_THAT(
      GroupedExpertsWorkspaceBytes({1, 8, 4, 3, 2},
                                   static_cast<ExpertStorage>(9)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("storage")));
}

TEST(GroupedExpertsWorkspaceBytesTest, ReportsOverflow) {
  EXPECT_THAT(
      GroupedExpertsWorkspaceBytes({kMaxInt, kMaxInt, kMaxInt / 2, 1, 1},
                                   ExpertStorage::kFloat32),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
}

TEST(GroupedExpertsArgsTest, ForwardRejectsBeforeTouchingTheDevice) {
  const ExpertDims dims{4, 8, 4, 3, 2};
  const GroupedExpertsOptions options;
  // Any non-null value: these calls must fail before dereferencing.
  int dummy = 0;
  const void* p = &dummy;
  const int32_t* idx = reinterpret_cast<const int32_t*>(&dummy);
  const float* w = reinterpret_cast<const float*>(&dummy);
  void* out = &dummy;
  cublasHandle_t handle = reinterpret_cast<cublasHandle_t>(&dummy);

  EXPECT_THAT(
      GroupedExpertsForward({4, 8, 4, 3, 0}, options, p, idx, w, nullptr, p, p,
                            out, nullptr, handle, nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
  EXPECT_THAT(GroupedExpertsForward(dims, options, nullptr, idx, w, nullptr, p,
                                    p, out, nullptr, handle, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("experts x must not be null")));
  EXPECT_THAT(GroupedExpertsForward(dims, options, p, idx, w, nullptr, p,
                                    nullptr, out, nullptr, handle, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("w_d must not be null")));
  EXPECT_THAT(GroupedExpertsForward(dims, options, p, idx, w, nullptr, p, p,
                                    out, nullptr, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cublas handle must not be null")));
  EXPECT_THAT(GroupedExpertsForward(dims, options, p, idx, w, nullptr, p, p,
                                    out, nullptr, handle, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("workspace must not be null")));
  GroupedExpertsOptions bad = options;
  bad.activation = static_cast<GatedActivation>(5);
  EXPECT_THAT(GroupedExpertsForward(dims, bad, p, idx, w, nullptr, p, p, out,
                                    nullptr, handle, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("options.activation")));
  bad = options;
  bad.gemm_path = static_cast<ExpertGemmPath>(5);
  EXPECT_THAT(GroupedExpertsForward(dims, bad, p, idx, w, nullptr, p, p, out,
                                    nullptr, handle, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("options.gemm_path")));
}

TEST(GroupedExpertsArgsTest, BackwardWithoutWorkspaceIsFailedPrecondition) {
  int dummy = 0;
  EXPECT_THAT(
      GroupedExpertsBackward({4, 8, 4, 3, 2}, GroupedExpertsOptions(), &dummy,
                             &dummy, &dummy, &dummy, false, nullptr, nullptr,
                             nullptr, nullptr, nullptr, nullptr),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("GroupedExpertsForward")));
}

TEST(GroupedExpertsArgsTest, CreateRejectsBadArgumentsBeforeCuda) {
  EXPECT_THAT(GroupedExpertsWorkspace::Create(nullptr, 1024, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("device_memory must not be null")));
  int dummy = 0;
  EXPECT_THAT(
      GroupedExpertsWorkspace::Create(&dummy, 4, 0),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_experts")));
  EXPECT_THAT(
      GroupedExpertsWorkspace::Create(&dummy, 4, kMaxGroupedExperts + 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_experts")));
}

TEST(GroupedExpertsArgsTest, ClampedSwiGluNeedsPositiveConstants) {
  GroupedExpertsOptions options;
  options.activation = GatedActivation::kClampedSwiGLU;
  options.limit = 0.0f;
  EXPECT_THAT(
      GroupedExpertsForward({4, 8, 4, 3, 2}, options, nullptr, nullptr,
                            nullptr, nullptr, nullptr, nullptr, nullptr,
                            nullptr, nullptr, nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("clamped SwiGLU needs alpha and limit > 0")));
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
