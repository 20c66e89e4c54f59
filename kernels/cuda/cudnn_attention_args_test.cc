// The cuDNN attention's written rule and its loader, without a GPU: which
// calls go to cuDNN, and the error a machine without cuDNN gets.

#include <cstdlib>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cudnn_attention.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

AttentionDims Qwen3Like() {
  AttentionDims d;
  d.batch = 1;
  d.q_len = d.kv_len = 4096;
  d.q_heads = 32;
  d.kv_heads = 4;
  d.head_dim = 128;
  return d;
}

TEST(CudnnAttentionRuleTest, TakesCausalAndSlidingWindowGqaInBf16) {
  AttentionOptions causal;
  causal.mask = AttentionMask::kCausal;
  SHARDD_EXPECT_OK(CudnnAttentionSupports(Qwen3Like(), causal, true));
  AttentionOptions sliding;
  sliding.mask = AttentionMask::kSlidingWindow;
  sliding.window = 128;
  SHARDD_EXPECT_OK(CudnnAttentionSupports(Qwen3Like(), sliding, true));
  AttentionDims mqa = Qwen3Like();
  mqa.kv_heads = 1;
  mqa.head_dim = 64;
  SHARDD_EXPECT_OK(CudnnAttentionSupports(mqa, causal, true));
}

TEST(CudnnAttentionRuleTest, LeavesTheRestToTheOwnKernels) {
  AttentionOptions causal;
  const auto unimplemented = [](const char* why) {
    return StatusIs(absl::StatusCode::kUnimplemented, HasSubstr(why));
  };
  EXPECT_THAT(CudnnAttentionSupports(Qwen3Like(), causal, /*bf16=*/false),
              unimplemented("fp32"));
  AttentionDims wide = Qwen3Like();
  wide.head_dim = 512;  // DiffusionGemma's full layers
  EXPECT_THAT(CudnnAttentionSupports(wide, causal, true),
              unimplemented("head dims 512"));
  AttentionDims odd = Qwen3Like();
  odd.head_dim = 100;
  EXPECT_THAT(CudnnAttentionSupports(odd, causal, true),
              unimplemented("multiple of 8"));
  AttentionDims mla = Qwen3Like();
  mla.v_head_dim = 64;  // DeepSeek-V3: q/k 192, v 128 style
  EXPECT_THAT(CudnnAttentionSupports(mla, causal, true),
              unimplemented("equal q and v"));
  AttentionOptions block;
  block.mask = AttentionMask::kBlockCausal;
  block.block = 8;
  EXPECT_THAT(CudnnAttentionSupports(Qwen3Like(), block, true),
              unimplemented("masks other"));
  AttentionOptions decode = causal;
  decode.q_offset = 4;
  EXPECT_THAT(CudnnAttentionSupports(Qwen3Like(), decode, true),
              unimplemented("offset"));
  const float sinks[32] = {};
  AttentionOptions gpt_oss = causal;
  gpt_oss.sinks = sinks;
  EXPECT_THAT(CudnnAttentionSupports(Qwen3Like(), gpt_oss, true),
              unimplemented("sink"));
  // Packed SFT rows: cuDNN's masks cannot restart inside a row.
  const int32_t first[1] = {0};
  AttentionOptions packed = causal;
  packed.key_begin = first;
  EXPECT_THAT(CudnnAttentionSupports(Qwen3Like(), packed, true),
              unimplemented("packed rows"));
}

TEST(AttentionKernelsTest, ReadsTheEnvironment) {
  ASSERT_EQ(unsetenv(kAttentionKernelsEnv), 0);
  EXPECT_THAT(AttentionKernelsFromEnvironment(),
              IsOkAndHolds(AttentionKernels::kOwn));
  ASSERT_EQ(setenv(kAttentionKernelsEnv, "auto", 1), 0);
  EXPECT_THAT(AttentionKernelsFromEnvironment(),
              IsOkAndHolds(AttentionKernels::kAuto));
  ASSERT_EQ(setenv(kAttentionKernelsEnv, "cudnn", 1), 0);
  EXPECT_THAT(AttentionKernelsFromEnvironment(),
              IsOkAndHolds(AttentionKernels::kCudnn));
  ASSERT_EQ(setenv(kAttentionKernelsEnv, "flash", 1), 0);
  EXPECT_THAT(AttentionKernelsFromEnvironment(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(kAttentionKernelsEnv),
                             HasSubstr("own, auto and cudnn"))));
  ASSERT_EQ(unsetenv(kAttentionKernelsEnv), 0);
}

// The process's one LoadCudnn call, pointed at a library that does not
// exist: the error names it and says how to provide cuDNN.
TEST(CudnnLoaderTest, AMissingLibraryIsAClearError) {
  ASSERT_EQ(setenv(kCudnnLibraryEnv, "/nonexistent/libcudnn.so.9", 1), 0);
  EXPECT_THAT(LoadCudnn(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("/nonexistent/libcudnn.so.9"),
                             HasSubstr("nvidia-cudnn-cu13"),
                             HasSubstr(kCudnnLibraryEnv))));
  // The result is kept: a second call does not retry.
  EXPECT_THAT(LoadCudnn(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(CudnnAttention::Create(nullptr).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
