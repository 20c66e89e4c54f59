#include "kernels/cuda/attention.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/attention_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/op_checks.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxGrid = 65535;

absl::Status Validate(const AttentionDims& d, const AttentionOptions& o,
                      const char* op) {
  SHARDD_RETURN_IF_ERROR(ValidateAttention(d, o));
  SHARDD_RETURN_IF_ERROR(
      CheckInRange(d.head_dim, 1, kMaxAttentionHeadDim, "dims.head_dim", op));
  SHARDD_RETURN_IF_ERROR(CheckInRange(d.v_head_dim, 0, kMaxAttentionHeadDim,
                                      "dims.v_head_dim", op));
  SHARDD_RETURN_IF_ERROR(CheckInRange(d.batch, 1, kMaxGrid, "dims.batch", op));
  return CheckInRange(d.q_heads, 1, kMaxGrid, "dims.q_heads", op);
}

// The widest heads need more shared memory than some GPUs give a block; say
// so by name rather than fail the launch with cudaErrorInvalidValue.
absl::Status CheckSharedMemory(const AttentionLaunch& a, const char* op) {
  const size_t need = AttentionSharedMemoryBytes(a);
  if (need <= 48 * 1024) return absl::OkStatus();
  int device = 0, limit = 0;
  SHARDD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), op);
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                             device),
      op);
  if (need <= static_cast<size_t>(limit)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      op, ": dims.head_dim ", a.head_dim, " and dims.v_head_dim ",
      a.v_head_dim == 0 ? a.head_dim : a.v_head_dim, " need ", need,
      " bytes of shared memory per block; CUDA device ", device, " allows ",
      limit));
}

AttentionLaunch ToLaunch(const AttentionDims& d, const AttentionOptions& o) {
  AttentionLaunch a;
  a.batch = d.batch;
  a.q_len = d.q_len;
  a.kv_len = d.kv_len;
  a.q_heads = d.q_heads;
  a.kv_heads = d.kv_heads;
  a.head_dim = d.head_dim;
  a.v_head_dim = d.v_head_dim;
  a.scale = o.scale;
  a.rule = o.rule();
  a.sinks = o.sinks;
  a.key_begin = o.key_begin;
  return a;
}

template <typename T>
absl::Status Forward(const AttentionDims& d, const AttentionOptions& o,
                     const T* q, const T* k, const T* v, T* out, float* lse,
                     cudaStream_t stream) {
  constexpr const char* kOp = "cuda AttentionForward";
  SHARDD_RETURN_IF_ERROR(Validate(d, o, kOp));
  if (d.q_len == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(q, "q", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(out, "out", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(lse, "lse", kOp));
  if (d.kv_len > 0) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(k, "k", kOp));
    SHARDD_RETURN_IF_ERROR(CheckNotNull(v, "v", kOp));
  }
  const AttentionLaunch launch = ToLaunch(d, o);
  SHARDD_RETURN_IF_ERROR(CheckSharedMemory(launch, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchAttentionForward(launch, q, k, v, out, lse, stream), kOp);
  return absl::OkStatus();
}

template <typename T>
absl::Status Backward(const AttentionDims& d, const AttentionOptions& o,
                      const T* q, const T* k, const T* v, const T* out,
                      const float* lse, const T* d_out, float* dq, float* dk,
                      float* dv, float* d_sinks, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* kOp = "cuda AttentionBackward";
  SHARDD_RETURN_IF_ERROR(Validate(d, o, kOp));
  if (d.q_len == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(q, "q", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(out, "out", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(lse, "lse", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(d_out, "d_out", kOp));
  if (d.kv_len > 0) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(k, "k", kOp));
    SHARDD_RETURN_IF_ERROR(CheckNotNull(v, "v", kOp));
  }
  SHARDD_RETURN_IF_ERROR(CheckWorkspace(
      workspace, workspace_bytes, AttentionBackwardWorkspaceBytes(d), kOp));
  float* delta = static_cast<float*>(workspace);
  float* sink_part = delta + d.batch * d.q_heads * d.q_len;
  const AttentionLaunch launch = ToLaunch(d, o);
  SHARDD_RETURN_IF_ERROR(CheckSharedMemory(launch, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchAttentionBackward(launch, q, k, v, out, lse, d_out, dq, dk, dv,
                              d_sinks, delta, sink_part, stream),
      kOp);
  return absl::OkStatus();
}

}  // namespace

size_t AttentionBackwardWorkspaceBytes(const AttentionDims& d) {
  if (d.batch < 1 || d.q_heads < 1 || d.q_len < 1) return 0;
  return 2 * sizeof(float) * static_cast<size_t>(d.batch * d.q_heads * d.q_len);
}

absl::Status AttentionForward(const AttentionDims& dims,
                              const AttentionOptions& options, const float* q,
                              const float* k, const float* v, float* out,
                              float* lse, cudaStream_t stream) {
  return Forward(dims, options, q, k, v, out, lse, stream);
}

absl::Status AttentionForward(const AttentionDims& dims,
                              const AttentionOptions& options,
                              const uint16_t* q, const uint16_t* k,
                              const uint16_t* v, uint16_t* out, float* lse,
                              cudaStream_t stream) {
  return Forward(dims, options, q, k, v, out, lse, stream);
}

absl::Status AttentionBackward(const AttentionDims& dims,
                               const AttentionOptions& options, const float* q,
                               const float* k, const float* v, const float* out,
                               const float* lse, const float* d_out, float* dq,
                               float* dk, float* dv, float* d_sinks,
                               void* workspace, size_t workspace_bytes,
                               cudaStream_t stream) {
  return Backward(dims, options, q, k, v, out, lse, d_out, dq, dk, dv, d_sinks,
                  workspace, workspace_bytes, stream);
}

absl::Status AttentionBackward(const AttentionDims& dims,
                               const AttentionOptions& options,
                               const uint16_t* q, const uint16_t* k,
                               const uint16_t* v, const uint16_t* out,
                               const float* lse, const uint16_t* d_out,
                               float* dq, float* dk, float* dv, float* d_sinks,
                               void* workspace, size_t workspace_bytes,
                               cudaStream_t stream) {
  return Backward(dims, options, q, k, v, out, lse, d_out, dq, dk, dv, d_sinks,
                  workspace, workspace_bytes, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
