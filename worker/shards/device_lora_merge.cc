#include "worker/shards/device_lora_merge.h"

#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/op_checks.h"
#include "kernels/cuda/row_major_gemm.h"
#include "worker/shards/lora_merge.h"

namespace shardd {
namespace {

namespace kc = kernels::cuda;

absl::Status CheckTarget(const LoraTarget& t, int64_t experts, const char* op) {
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  for (const auto& [value, name] :
       {std::pair<int64_t, const char*>{t.rank, "rank"},
        {t.in, "in"},
        {t.out, "out"}}) {
    if (value < 1 || value > kMaxInt) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": LoRA target ", t.base, " has ", name, " = ",
                       value, "; allowed [1, ", kMaxInt, "]"));
    }
  }
  if (experts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": experts must be >= 0, got ", experts));
  }
  return absl::OkStatus();
}

absl::Status Run(cublasHandle_t handle, cudaStream_t stream,
                 const std::vector<LoraGemm>& gemms, const LoraBuffers& buf,
                 const char* op) {
  SHARDD_RETURN_IF_ERROR(kc::BindCublasHandle(handle, stream, op));
  for (const LoraGemm& g : gemms) {
    kc::GemmOperand a, b;
    a.data = buf.Get(g.a.buffer) + g.a.offset;
    a.ld = g.a.ld;
    a.transpose = g.a.transpose;
    b.data = buf.Get(g.b.buffer) + g.b.offset;
    b.ld = g.b.ld;
    b.transpose = g.b.transpose;
    SHARDD_RETURN_IF_ERROR(kc::RowMajorGemm(
        handle, g.m, g.n, g.k, g.alpha, a, b, g.beta,
        buf.Mutable(g.c) + g.c_offset, kc::DType::kFloat32, g.ldc, op));
  }
  return absl::OkStatus();
}

// The handle and every named device buffer, named when null.
absl::Status CheckNotNull(
    std::initializer_list<std::pair<const void*, const char*>> pointers,
    cublasHandle_t handle, const char* op) {
  SHARDD_RETURN_IF_ERROR(kc::CheckNotNull(handle, "handle", op));
  for (const auto& [pointer, name] : pointers) {
    SHARDD_RETURN_IF_ERROR(kc::CheckNotNull(pointer, name, op));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DeviceLoraMergeInto(cublasHandle_t handle, cudaStream_t stream,
                                 const LoraTarget& target, int64_t experts,
                                 const float* a, const float* b, float* w) {
  constexpr const char* kOp = "device LoRA merge";
  SHARDD_RETURN_IF_ERROR(CheckTarget(target, experts, kOp));
  SHARDD_RETURN_IF_ERROR(
      CheckNotNull({{a, "a"}, {b, "b"}, {w, "w"}}, handle, kOp));
  LoraBuffers buf;
  buf.a = a;
  buf.b = b;
  buf.weight = w;
  return Run(handle, stream, LoraMergeGemms(target, experts), buf, kOp);
}

absl::Status DeviceLoraSplitGrad(cublasHandle_t handle, cudaStream_t stream,
                                 const LoraTarget& target, int64_t experts,
                                 const float* a, const float* b, const float* g,
                                 float* da, float* db) {
  constexpr const char* kOp = "device LoRA gradient split";
  SHARDD_RETURN_IF_ERROR(CheckTarget(target, experts, kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(
      {{a, "a"}, {b, "b"}, {g, "g"}, {da, "da"}, {db, "db"}}, handle, kOp));
  LoraBuffers buf;
  buf.a = a;
  buf.b = b;
  buf.grad = g;
  buf.grad_a = da;
  buf.grad_b = db;
  return Run(handle, stream, LoraSplitGradGemms(target, experts), buf, kOp);
}

}  // namespace shardd
