// Argument checks and workspace sizes of the CUDA ops. Runs without a GPU:
// every call here fails validation before touching the device, and the
// pointers are never dereferenced.

#include <cstdint>
#include <limits>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/bias.h"
#include "kernels/cuda/cross_entropy.h"
#include "kernels/cuda/dense_mlp.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/router_aux_loss.h"
#include "kernels/cuda/row_major_gemm.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ::testing::HasSubstr;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

// Stand-ins for device pointers: never dereferenced, aligned to 256 bytes.
template <typename T>
T* Fake(uintptr_t slot = 1) {
  return reinterpret_cast<T*>(slot * 4096);
}

size_t Align(size_t bytes) { return (bytes + 255) / 256 * 256; }

TEST(OpsArgsTest, Casts) {
  EXPECT_THAT(CastFp32ToBf16(Fake<float>(), Fake<uint16_t>(2), -1, nullptr),
              StatusIs(kInvalid, HasSubstr("n must be >= 0")));
  EXPECT_THAT(CastFp32ToBf16(nullptr, Fake<uint16_t>(), 4, nullptr),
              StatusIs(kInvalid, HasSubstr("in is null")));
  EXPECT_THAT(CastBf16ToFp32(Fake<uint16_t>(), nullptr, 4, nullptr),
              StatusIs(kInvalid, HasSubstr("out is null")));
  // out starts inside in's 4096 bytes.
  EXPECT_THAT(
      CastFp32ToBf16(Fake<float>(), Fake<uint16_t>() + 100, 1024, nullptr),
      StatusIs(kInvalid, HasSubstr("must not overlap")));
  // Nothing to do: OK without touching the device.
  EXPECT_THAT(CastFp32ToBf16(nullptr, nullptr, 0, nullptr), IsOk());
}

TEST(OpsArgsTest, Embedding) {
  EXPECT_EQ(EmbeddingBackwardWorkspaceBytes(1000, 3000),
            Align(1001 * 4) + Align(3000 * 4));
  EXPECT_EQ(EmbeddingBackwardWorkspaceBytes(-1, 3), 0u);
  EXPECT_THAT(EmbeddingForward(Fake<float>(), -1, 4, Fake<int32_t>(2), 3,
                               Fake<float>(3), nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("vocab_size")));
  EXPECT_THAT(EmbeddingForward(Fake<uint16_t>(), 10, 4, nullptr, 3,
                               Fake<uint16_t>(3), nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("ids is null")));
  EXPECT_THAT(
      EmbeddingForward(Fake<float>(), 10, 4, Fake<int32_t>(2), int64_t{1} << 32,
                       Fake<float>(3), nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("num_tokens")));
  const size_t need = EmbeddingBackwardWorkspaceBytes(10, 3);
  EXPECT_THAT(
      EmbeddingBackward(Fake<float>(), Fake<int32_t>(2), 3, 10, 4,
                        Fake<float>(3), nullptr, need, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("workspace is null")));
  EXPECT_THAT(EmbeddingBackward(Fake<float>(), Fake<int32_t>(2), 3, 10, 4,
                                Fake<float>(3), Fake<char>(4), need - 1,
                                nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("workspace_bytes")));
  EXPECT_THAT(EmbeddingBackward(Fake<uint16_t>(), Fake<int32_t>(2), 3, 10, 4,
                                Fake<float>(3), Fake<char>(4) + 8, need,
                                nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("aligned")));
}

TEST(OpsArgsTest, RmsNorm) {
  // 300 rows: chunks of 64 rows -> 5 partial rows of 256 floats.
  EXPECT_EQ(RmsNormBackwardWorkspaceBytes(300, 256), Align(5 * 256 * 4));
  // 100000 rows: at most 1024 chunks -> 98 rows each -> 1021 chunks.
  EXPECT_EQ(RmsNormBackwardWorkspaceBytes(100000, 10), Align(1021 * 10 * 4));
  EXPECT_EQ(RmsNormBackwardWorkspaceBytes(0, 10), 0u);
  EXPECT_THAT(RmsNormForward(Fake<float>(), Fake<float>(2), 4, 0, 1e-6f,
                             Fake<float>(3), Fake<float>(4), nullptr),
              StatusIs(kInvalid, HasSubstr("dim")));
  EXPECT_THAT(RmsNormForward(Fake<float>(), Fake<float>(2), 4, 8, -1.0f,
                             Fake<float>(3), Fake<float>(4), nullptr),
              StatusIs(kInvalid, HasSubstr("eps")));
  EXPECT_THAT(RmsNormForward(Fake<uint16_t>(), Fake<uint16_t>(2), 4, 8, 1e-6f,
                             Fake<uint16_t>(3), nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("inv_rms is null")));
  EXPECT_THAT(RmsNormBackward(Fake<float>(), Fake<float>(2), Fake<float>(3),
                              Fake<float>(4), 4, 8, Fake<float>(5), false,
                              Fake<float>(6), nullptr, 0, nullptr),
              StatusIs(kInvalid, HasSubstr("workspace is null")));
  EXPECT_THAT(
      RmsNormBackward(Fake<float>(), nullptr, Fake<float>(3), Fake<float>(4), 4,
                      8, Fake<float>(5), false, nullptr, nullptr, 0, nullptr),
      StatusIs(kInvalid, HasSubstr("x is null")));
}

TEST(OpsArgsTest, Router) {
  const RouterDims dims{200, 32, 8, 2};
  EXPECT_EQ(RouterSavedBytes(dims),
            Align(200 * 8 * 4) + Align(200 * 4) + Align(200 * 2 * 4));
  EXPECT_EQ(RouterBackwardWorkspaceBytes(dims, DType::kBFloat16),
            Align(200 * 8 * 2));
  EXPECT_EQ(RouterBackwardWorkspaceBytes(dims, DType::kFloat32),
            Align(200 * 8 * 4));
  EXPECT_EQ(RouterSavedBytes(RouterDims{1, 1, 2000, 1}), 0u);

  const size_t saved = RouterSavedBytes(dims);
  auto forward = [&](const RouterDims& d, void* saved_ptr, size_t bytes,
                     cublasHandle_t handle) {
    return RouterForward(d, Fake<float>(1), Fake<float>(2), Fake<int32_t>(3),
                         Fake<float>(4), saved_ptr, bytes, handle, nullptr);
  };
  EXPECT_THAT(
      forward(RouterDims{10, 4, 2000, 2}, Fake<char>(5), saved, nullptr),
      StatusIs(kInvalid, HasSubstr("experts must be in [1, 1024]")));
  EXPECT_THAT(forward(RouterDims{10, 4, 64, 33}, Fake<char>(5), saved, nullptr),
              StatusIs(kInvalid, HasSubstr("top_k must be in [1, 32]")));
  EXPECT_THAT(forward(RouterDims{10, 4, 4, 5}, Fake<char>(5), saved, nullptr),
              StatusIs(kInvalid, HasSubstr("top_k must be in [1, 4]")));
  EXPECT_THAT(forward(dims, Fake<char>(5), saved - 1, nullptr),
              StatusIs(kInvalid, HasSubstr("saved: workspace_bytes")));
  EXPECT_THAT(forward(dims, Fake<char>(5), saved, nullptr),
              StatusIs(kInvalid, HasSubstr("cuBLAS handle is null")));
  // T == 0 needs nothing at all.
  EXPECT_THAT(forward(RouterDims{0, 4, 8, 2}, nullptr, 0, nullptr), IsOk());

  EXPECT_THAT(RouterBackward(dims, Fake<uint16_t>(1), nullptr, Fake<float>(3),
                             Fake<char>(4), saved, Fake<uint16_t>(5), false,
                             nullptr, Fake<char>(6), 1 << 20, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("w (needed for dx) is null")));
  EXPECT_THAT(
      RouterBackward(dims, nullptr, Fake<float>(2), Fake<float>(3),
                     Fake<char>(4), saved, nullptr, false, Fake<float>(5),
                     Fake<char>(6), 1 << 20, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("x (needed for dw) is null")));
  EXPECT_THAT(
      RouterBackward(dims, Fake<float>(1), Fake<float>(2), Fake<float>(3),
                     Fake<char>(4), saved, Fake<float>(5), false,
                     Fake<float>(6), Fake<char>(7), 16, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("workspace_bytes is 16")));
}

TEST(OpsArgsTest, RouterNewerScorings) {
  RouterDims dims{200, 32, 64, 6};
  dims.scoring = RouterScoring::kSigmoidGroupLimited;
  dims.groups = 8;
  dims.top_groups = 3;
  // The selected scores [T, K] join the CPU cache's other pieces.
  EXPECT_EQ(RouterSavedBytes(dims), Align(200 * 64 * 4) + Align(200 * 4) +
                                        2 * Align(200 * 6 * 4));
  EXPECT_EQ(RouterSoftmax(dims, Fake<char>(5)), nullptr);
  RouterDims bad = dims;
  bad.groups = 7;
  EXPECT_EQ(RouterSavedBytes(bad), 0u);
  auto forward = [&](const RouterDims& d, const float* selection) {
    return RouterForward(d, Fake<float>(1), Fake<float>(2), nullptr, selection,
                         Fake<int32_t>(3), Fake<float>(4), Fake<char>(5),
                         size_t{1} << 30, nullptr, nullptr);
  };
  EXPECT_THAT(forward(bad, nullptr),
              StatusIs(kInvalid, HasSubstr("groups must split experts=64")));
  bad = dims;
  bad.top_groups = 9;
  EXPECT_THAT(forward(bad, nullptr),
              StatusIs(kInvalid, HasSubstr("top_groups must be in [1, 8]")));
  bad = dims;
  bad.top_groups = 1;
  bad.top_k = 10;
  EXPECT_THAT(forward(bad, nullptr),
              StatusIs(kInvalid, HasSubstr("exceeds the 8 experts")));
  bad = dims;
  bad.scale = std::numeric_limits<float>::infinity();
  EXPECT_THAT(forward(bad, nullptr),
              StatusIs(kInvalid, HasSubstr("scale must be finite")));
  RouterDims topk{200, 32, 64, 4};
  topk.scoring = RouterScoring::kTopKThenSoftmax;
  EXPECT_THAT(forward(topk, Fake<float>(6)),
              StatusIs(kInvalid, HasSubstr("selection_bias is only for")));
  EXPECT_EQ(RouterSoftmax(topk, Fake<char>(5)), nullptr);
  topk.keep_softmax = true;
  EXPECT_EQ(RouterSoftmax(topk, Fake<char>(5)), Fake<float>(5));
  EXPECT_EQ(RouterSoftmax(RouterDims{200, 32, 64, 4}, Fake<char>(5)),
            Fake<float>(5));
  // A bias gradient alone still needs d_weights.
  EXPECT_THAT(
      RouterBackward(topk, Fake<float>(1), Fake<float>(2), nullptr, nullptr,
                     Fake<char>(4), RouterSavedBytes(topk), nullptr, false,
                     nullptr, Fake<float>(7), Fake<char>(8), size_t{1} << 30,
                     nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("d_weights is null")));
}

TEST(OpsArgsTest, Bias) {
  EXPECT_THAT(AddBias(Fake<float>(1), -1, 4, Fake<float>(2), nullptr),
              StatusIs(kInvalid, HasSubstr("tokens")));
  EXPECT_THAT(AddBias(Fake<uint16_t>(1), 3, 0, Fake<uint16_t>(2), nullptr),
              StatusIs(kInvalid, HasSubstr("out must be in")));
  EXPECT_THAT(AddBias(static_cast<const float*>(nullptr), 3, 4, Fake<float>(2),
                      nullptr),
              StatusIs(kInvalid, HasSubstr("b is null")));
  EXPECT_THAT(BiasBackward(Fake<uint16_t>(1), 3, 4, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("db is null")));
  EXPECT_THAT(BiasBackward(static_cast<const float*>(nullptr), 0, 4, nullptr,
                           nullptr),
              IsOk());
}

TEST(OpsArgsTest, RouterAuxLoss) {
  EXPECT_THAT(RouterAuxLossAccumulate(Fake<float>(1), Fake<int32_t>(2), 10, 8,
                                      9, Fake<int64_t>(3), Fake<double>(4),
                                      nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("top_k must be in [1, 8]")));
  EXPECT_THAT(RouterAuxLossAccumulate(Fake<float>(1), nullptr, 10, 8, 2,
                                      Fake<int64_t>(3), Fake<double>(4),
                                      nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("indices is null")));
  EXPECT_THAT(RouterAuxLossAccumulate(nullptr, nullptr, 0, 8, 2, nullptr,
                                      nullptr, nullptr, nullptr),
              IsOk());
  EXPECT_THAT(RouterAuxLossValue(Fake<int64_t>(1), Fake<double>(2), nullptr, 8,
                                 Fake<double>(3), nullptr),
              StatusIs(kInvalid, HasSubstr("total_rows is null")));
  EXPECT_THAT(RouterAuxLossBackward(Fake<float>(1), 10, 0, Fake<int64_t>(2),
                                    Fake<int64_t>(3), 1.0, Fake<float>(4),
                                    nullptr),
              StatusIs(kInvalid, HasSubstr("experts must be in")));
  EXPECT_THAT(RouterAuxLossBackward(Fake<float>(1), 10, 8, Fake<int64_t>(2),
                                    Fake<int64_t>(3), 1.0, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("d_logits is null")));
}

TEST(OpsArgsTest, CrossEntropy) {
  const CrossEntropyDims dims{300, 64, 1000};
  CudaCrossEntropyOptions options;
  options.block_rows = 128;
  const size_t rows = Align(300 * 8) + Align(300 * 4);
  EXPECT_EQ(CrossEntropyWorkspaceBytes(dims, DType::kFloat32, options, true),
            Align(128 * 1000 * 4) + rows);
  EXPECT_EQ(CrossEntropyWorkspaceBytes(dims, DType::kBFloat16, options, false),
            Align(128 * 1000 * 4) + rows);
  EXPECT_EQ(CrossEntropyWorkspaceBytes(dims, DType::kBFloat16, options, true),
            Align(128 * 1000 * 4) + Align(128 * 1000 * 2) + rows);
  // A block larger than T is clamped to T.
  options.block_rows = 100000;
  EXPECT_EQ(CrossEntropyWorkspaceBytes(dims, DType::kFloat32, options, false),
            Align(300 * 1000 * 4) + rows);
  options.block_rows = 0;
  EXPECT_EQ(CrossEntropyWorkspaceBytes(dims, DType::kFloat32, options, false),
            0u);
  EXPECT_THAT(LmHeadCrossEntropyForward(
                  dims, Fake<float>(1), Fake<float>(2), Fake<int32_t>(3),
                  Fake<CrossEntropyDeviceResult>(4), Fake<char>(5), 1 << 30,
                  options, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("block_rows")));
  options.block_rows = 128;
  EXPECT_THAT(LmHeadCrossEntropyForward(
                  dims, Fake<uint16_t>(1), Fake<uint16_t>(2), Fake<int32_t>(3),
                  nullptr, Fake<char>(5), 1 << 30, options, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("result is null")));
  EXPECT_THAT(
      LmHeadCrossEntropyBackward(
          dims, Fake<float>(1), Fake<float>(2), Fake<int32_t>(3), HUGE_VALF,
          Fake<float>(4), nullptr, false, Fake<CrossEntropyDeviceResult>(5),
          Fake<char>(6), 1 << 30, options, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("loss_scale must be finite")));
  EXPECT_THAT(
      LmHeadCrossEntropyBackward(
          dims, Fake<float>(1), Fake<float>(2), nullptr, 1.0f, Fake<float>(4),
          nullptr, false, Fake<CrossEntropyDeviceResult>(5), Fake<char>(6),
          1 << 30, options, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("targets is null")));
  EXPECT_THAT(LmHeadCrossEntropyForward(
                  dims, Fake<float>(1), Fake<float>(2), Fake<int32_t>(3),
                  Fake<CrossEntropyDeviceResult>(4), Fake<char>(5), 1 << 30,
                  options, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("cuBLAS handle is null")));
}

TEST(OpsArgsTest, DenseMlp) {
  const DenseMlpDims dims{70, 48, 96};
  EXPECT_EQ(DenseMlpSavedBytes(dims, DType::kFloat32), 2 * Align(70 * 96 * 4));
  EXPECT_EQ(DenseMlpForwardWorkspaceBytes(dims, DType::kBFloat16),
            Align(70 * 96 * 2));
  EXPECT_EQ(DenseMlpBackwardWorkspaceBytes(dims, DType::kBFloat16),
            3 * Align(70 * 96 * 2));
  EXPECT_EQ(DenseMlpSavedBytes(DenseMlpDims{1, 0, 1}, DType::kFloat32), 0u);
  EXPECT_THAT(
      DenseMlpForward(dims, static_cast<GatedActivation>(7), Fake<float>(1),
                      Fake<float>(2), Fake<float>(3), Fake<float>(4),
                      Fake<float>(5), false, Fake<char>(6), 1 << 30,
                      Fake<char>(7), 1 << 30, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("activation")));
  EXPECT_THAT(DenseMlpBackward(dims, GatedActivation::kSwiGLU, nullptr,
                               Fake<float>(2), Fake<float>(3), Fake<float>(4),
                               Fake<float>(5), Fake<char>(6), 1 << 30, nullptr,
                               false, Fake<float>(7), nullptr, nullptr,
                               Fake<char>(8), 1 << 30, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("x is null")));
  EXPECT_THAT(
      DenseMlpForward(dims, GatedActivation::kGeGLU, Fake<uint16_t>(1),
                      Fake<uint16_t>(2), Fake<uint16_t>(3), Fake<uint16_t>(4),
                      Fake<uint16_t>(5), false, Fake<char>(6), 1 << 30,
                      Fake<char>(7), 16, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("workspace_bytes is 16")));
}

TEST(OpsArgsTest, AdamWAndClipping) {
  EXPECT_EQ(SumOfSquaresWorkspaceBytes(0), 0u);
  EXPECT_EQ(SumOfSquaresWorkspaceBytes(1), Align(8));
  EXPECT_EQ(SumOfSquaresWorkspaceBytes(2048 * 3 + 1), Align(4 * 8));
  EXPECT_EQ(SumOfSquaresWorkspaceBytes(5000000), Align(1024 * 8));

  AdamWConfig config;
  auto step = [&](int64_t n, int64_t t, const AdamWConfig& c) {
    return AdamWStep(Fake<float>(1), Fake<float>(2), Fake<float>(3),
                     Fake<float>(4), n, t, c, nullptr, nullptr, nullptr);
  };
  EXPECT_THAT(step(10, 0, config), StatusIs(kInvalid, HasSubstr("step")));
  EXPECT_THAT(step(-1, 1, config), StatusIs(kInvalid, HasSubstr("n must")));
  AdamWConfig bad = config;
  bad.beta2 = 1.0;
  EXPECT_THAT(step(10, 1, bad), StatusIs(kInvalid, HasSubstr("beta2")));
  bad = config;
  bad.lr = std::nan("");
  EXPECT_THAT(step(10, 1, bad), StatusIs(kInvalid, HasSubstr("lr")));
  bad = config;
  bad.weight_decay = -0.1;
  EXPECT_THAT(step(10, 1, bad), StatusIs(kInvalid, HasSubstr("weight_decay")));
  EXPECT_THAT(step(0, 1, config), IsOk());
  EXPECT_THAT(AdamWStep(Fake<float>(1), nullptr, Fake<float>(3), Fake<float>(4),
                        10, 1, config, nullptr, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("grad is null")));

  EXPECT_THAT(SumOfSquares(Fake<float>(1), 10, nullptr, false, Fake<char>(2),
                           256, nullptr),
              StatusIs(kInvalid, HasSubstr("result is null")));
  EXPECT_THAT(SumOfSquares(Fake<float>(1), 10, Fake<double>(2), false, nullptr,
                           0, nullptr),
              StatusIs(kInvalid, HasSubstr("workspace is null")));
  EXPECT_THAT(ScaleInPlace(Fake<float>(1), 10, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("scale is null")));
  EXPECT_THAT(ClipCoefficientFromSumOfSquares(Fake<double>(1), 1.0, nullptr,
                                              nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("coefficient is null")));
}

TEST(OpsArgsTest, RowMajorGemm) {
  const GemmOperand a{Fake<float>(1), DType::kFloat32, 8, false};
  const GemmOperand b{Fake<uint16_t>(2), DType::kBFloat16, 8, false};
  EXPECT_THAT(RowMajorGemm(nullptr, 4, 8, 8, 1.0f, a, b, 0.0f, Fake<float>(3),
                           DType::kFloat32, 8, "t"),
              StatusIs(kInvalid, HasSubstr("share a dtype")));
  const GemmOperand short_ld{Fake<float>(2), DType::kFloat32, 4, false};
  EXPECT_THAT(RowMajorGemm(nullptr, 4, 8, 8, 1.0f, a, short_ld, 0.0f,
                           Fake<float>(3), DType::kFloat32, 8, "t"),
              StatusIs(kInvalid, HasSubstr("leading dimensions")));
  EXPECT_THAT(BindCublasHandle(nullptr, nullptr, "t"),
              StatusIs(kInvalid, HasSubstr("handle is null")));
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
