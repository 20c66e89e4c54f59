// The planner's CUDA-free sizes (common/device_saved_bytes.h) are the
// kernels' own: what a GPU worker's ledger counts is what the plan counts.
// Runs without a GPU (the size queries make no CUDA call).

#include "common/device_saved_bytes.h"

#include <cstdint>

#include "gtest/gtest.h"
#include "kernels/cuda/dense_mlp.h"
#include "kernels/cuda/grouped_experts.h"
#include "kernels/cuda/router.h"

namespace shardd {
namespace {

namespace kc = kernels::cuda;

// Token counts across the alignment and routing-chunk boundaries.
constexpr int64_t kTokens[] = {1, 3, 63, 64, 65, 511, 2047, 2048, 4097};

TEST(DeviceSavedBytesTest, RouterMatchesTheKernel) {
  for (int64_t t : kTokens) {
    for (auto scoring : {kernels::RouterScoring::kSoftmaxThenTopK,
                         kernels::RouterScoring::kTopKThenSoftmax,
                         kernels::RouterScoring::kSigmoidGroupLimited}) {
      for (int64_t e : {8, 60, 128}) {
        kc::RouterDims dims{t, 64, e, 4};
        dims.scoring = scoring;
        if (scoring == kernels::RouterScoring::kSigmoidGroupLimited) {
          dims.groups = 4;
          dims.top_groups = 2;
        }
        for (bool keep : {false, true}) {
          dims.keep_softmax = keep;
          EXPECT_EQ(
              static_cast<int64_t>(kc::RouterSavedBytes(dims)),
              device_bytes::RouterSaved(
                  t, e, 4, scoring != kernels::RouterScoring::kSoftmaxThenTopK))
              << "t " << t << " e " << e << " scoring "
              << static_cast<int>(scoring) << " keep_softmax " << keep;
        }
      }
    }
  }
}

TEST(DeviceSavedBytesTest, DenseMlpMatchesTheKernel) {
  for (int64_t t : kTokens) {
    for (int64_t inter : {1, 24, 96, 1408}) {
      const kc::DenseMlpDims dims{t, 64, inter};
      EXPECT_EQ(static_cast<int64_t>(
                    kc::DenseMlpSavedBytes(dims, kc::DType::kFloat32)),
                device_bytes::DenseMlpSaved(t, inter, 4))
          << t << " x " << inter;
      EXPECT_EQ(static_cast<int64_t>(
                    kc::DenseMlpSavedBytes(dims, kc::DType::kBFloat16)),
                device_bytes::DenseMlpSaved(t, inter, 2))
          << t << " x " << inter;
    }
  }
}

TEST(DeviceSavedBytesTest, GroupedExpertsMatchTheKernel) {
  for (int64_t t : kTokens) {
    for (int64_t k : {1, 2, 8}) {
      for (int64_t e : {8, 60, 128}) {
        for (int64_t inter : {24, 768}) {
          const kc::ExpertDims dims{t, 96, inter, e, k};
          for (auto storage :
               {kc::ExpertStorage::kFloat32, kc::ExpertStorage::kBFloat16}) {
            const auto bytes = kc::GroupedExpertsWorkspaceBytes(dims, storage);
            ASSERT_TRUE(bytes.ok()) << bytes.status();
            const int64_t elem = storage == kc::ExpertStorage::kFloat32 ? 4 : 2;
            EXPECT_EQ(
                static_cast<int64_t>(*bytes),
                device_bytes::GroupedExpertsWorkspace(t, k, e, 96, inter, elem))
                << "t " << t << " k " << k << " e " << e << " inter " << inter
                << " elem " << elem;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace shardd
