#ifndef SHARDD_KERNELS_CUDA_GROUPED_EXPERTS_H_
#define SHARDD_KERNELS_CUDA_GROUPED_EXPERTS_H_

// Grouped MoE experts on one GPU, forward and backward, with the semantics
// of kernels/cpu/grouped_experts.h (NeMo GroupedExperts, torch_mm path):
//
//   W_gu [E, D, 2I]: gate half then up half (concatenated, not interleaved)
//   W_d  [E, I, D]
//   1. the T*K assignments are sorted by expert with a STABLE counting sort
//      on the device (ties keep token order, then k order); masked tokens'
//      assignments are dropped;
//   2. Xs = the permuted rows of x (one fused gather);
//   3. H = Xs @ W_gu[e]                   [n_e, 2I]
//   4. A = act(H[:, :I]) * H[:, I:] * w   [n_e, I]   routing weight applied
//      inside the activation, between up and down, as NeMo does
//   5. O = A @ W_d[e]                     [n_e, D]
//   6. y[t] = sum over t's assignments in k order (fp32, no atomics)
// with act = silu (SwiGLU) or gelu with the tanh approximation (GeGLU). An
// expert with no rows contributes zero and its gradient slices are left as
// they are, so every rank runs the same collectives whatever the routing.
//
// GPT-OSS (GroupedExpertsOptions' alpha, limit and biases), as the CPU:
//   3'. H = Xs @ W_gu[e] + b_gu[e]
//   4'. g = min(H[:, :I], limit), u = clamp(H[:, I:], -limit, limit),
//       A = g * sigmoid(alpha * g) * (u + 1) * w          (kClampedSwiGLU)
//   5'. O = A @ W_d[e] + w * b_d[e]
// The clamps pass gradient inside [-limit, limit] inclusive (torch.clamp).
// The biases are added by separate kernels after each GEMM (both GEMM
// paths), so with bf16 storage H and O are rounded to bf16 twice.
//
// Storage: x, y, w_gu, w_d, dy, dx and the saved activations are fp32 or
// bf16 (ExpertStorage); every GEMM and every sum accumulates in fp32. The
// routing weights, d_weights and the parameter gradients dw_gu, dw_d are
// always fp32 (dw_* are the fp32 reduce buffers of FSDP).
//
// GEMMs: ExpertGemmPath::kGrouped issues one cublasGemmGroupedBatchedEx per
// GEMM over the experts that have rows; kPerExpertLoop issues one
// cublasGemmEx per such expert (the baseline); kAuto (the default) picks
// between the two from the rows per expert. cuBLAS' grouped GEMM only
// writes bf16 from bf16 inputs, so with bf16 storage the two weight-gradient
// GEMMs, which accumulate straight into the fp32 dw buffers (beta = 1), run
// as the per-expert loop on both paths; with fp32 storage every GEMM follows
// the chosen path. fp32 storage computes in CUBLAS_COMPUTE_32F_PEDANTIC (no
// TF32 whatever the handle's math mode), bf16 in CUBLAS_COMPUTE_32F.
//
// Host synchronization: cuBLAS takes the grouped GEMMs' m/n/k on the host,
// so each forward with tokens > 0 copies the per-expert row counts to pinned
// host memory and waits for that copy (one cudaEventSynchronize). That is the
// only time the op blocks the host; the rest of the forward is enqueued
// after it. The backward reuses the forward's counts and never blocks.
// GroupedExpertsWorkspace::host_syncs() counts these waits.
//
// Memory: nothing is allocated per call. The caller provides the device
// workspace (GroupedExpertsWorkspaceBytes) and a GroupedExpertsWorkspace,
// which owns a small pinned host buffer and an event allocated once at
// creation. All pointers passed to the calls are device pointers, except the
// workspace object itself; give them 16-byte alignment (cudaMalloc gives 256):
// the bf16 grouped GEMM and the vectorized kernels rely on it.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardd {
namespace kernels {
namespace cuda {

enum class GatedActivation {
  kSwiGLU,         // silu(g) * u
  kGeGLU,          // gelu_tanh(g) * u
  kClampedSwiGLU,  // GPT-OSS, above
};

// Element type of x, y, the expert weights, dy, dx and the saved
// activations.
enum class ExpertStorage { kFloat32, kBFloat16 };

enum class ExpertGemmPath {
  kGrouped,        // cublasGemmGroupedBatchedEx, one call per GEMM
  kPerExpertLoop,  // one cublasGemmEx per expert with rows
  // Per GEMM: kGrouped while the experts with rows average fewer than
  // kAutoLoopRows rows, else kPerExpertLoop. Measured on an H200
  // (docs/performance.md): cuBLAS' grouped GEMM wins at 256 rows per expert
  // (it saves a launch per expert) and loses at 1024 and more, where each
  // expert's GEMM is large enough for cublasGemmEx's tuned kernels.
  kAuto,
};

inline constexpr int64_t kAutoLoopRows = 512;

// Same fields and limits as kernels::ExpertDims, plus experts <=
// kMaxGroupedExperts (the routing keeps per-expert counters in shared
// memory).
struct ExpertDims {
  int64_t tokens = 0;        // T >= 0
  int64_t dim = 0;           // D >= 1
  int64_t intermediate = 0;  // I >= 1
  int64_t experts = 0;       // E in [1, kMaxGroupedExperts]
  int64_t top_k = 0;         // K in [1, E]
};

inline constexpr int64_t kMaxGroupedExperts = 8192;

struct GroupedExpertsOptions {
  GatedActivation activation = GatedActivation::kSwiGLU;
  ExpertStorage storage = ExpertStorage::kBFloat16;
  ExpertGemmPath gemm_path = ExpertGemmPath::kAuto;
  // GPT-OSS, as kernels::ExpertOptions: the clamped activation's constants
  // (kClampedSwiGLU only; both > 0) and per-expert biases in the storage
  // type (device pointers; null: none). The backward is given the same
  // constants and the same biases' presence.
  float alpha = 1.702f;
  float limit = 7.0f;
  const void* gate_up_bias = nullptr;  // b_gu [E, 2I]
  const void* down_bias = nullptr;     // b_d [E, D]
};

// Gradients of the biases (fp32, device), ADDED to like dw_gu / dw_d (null
// skips one). An expert with no rows leaves its slices as they are.
struct ExpertBiasGrads {
  float* gate_up = nullptr;  // [E, 2I]
  float* down = nullptr;     // [E, D]
};

// OK when `dims` is usable. Errors: INVALID_ARGUMENT naming the field: T < 0,
// D, I or E < 1, E > kMaxGroupedExperts, K outside [1, E], D or 2I beyond
// cuBLAS' int, T * K beyond int32 (rows are addressed as int32).
absl::Status ValidateExpertDims(const ExpertDims& dims);

// Device workspace bytes a forward/backward pair with `dims` and `storage`
// needs (sized for T*K rows, so masking never needs more). Pure arithmetic:
// touches no device. Regions start 256-byte aligned.
// Errors: INVALID_ARGUMENT as ValidateExpertDims, or when the size
// overflows size_t.
absl::StatusOr<size_t> GroupedExpertsWorkspaceBytes(const ExpertDims& dims,
                                                    ExpertStorage storage);

// State of one expert call whose backward is pending (one per layer and
// pass, like the CPU workspace), reused across steps: the caller's device
// workspace, the host copy of the last forward's routing counts and the
// event the forward waits on. Not thread-safe; use it on one stream (or
// order the backward after the forward yourself).
class GroupedExpertsWorkspace {
 public:
  // `device_memory`: caller-owned device memory of `device_bytes` bytes
  // (cudaMalloc alignment, i.e. 256 bytes), at least
  // GroupedExpertsWorkspaceBytes of every call made on this workspace; it
  // must outlive the workspace's use. `max_experts` sizes the host buffers.
  // Allocates pinned host memory and one event, so create workspaces before
  // the step loop.
  // Errors: INVALID_ARGUMENT for a null `device_memory` with nonzero bytes
  // or `max_experts` outside [1, kMaxGroupedExperts] (checked before any
  // CUDA call); CUDA errors from cudaMallocHost / cudaEventCreate
  // (FAILED_PRECONDITION without a device, RESOURCE_EXHAUSTED).
  static absl::StatusOr<std::unique_ptr<GroupedExpertsWorkspace>> Create(
      void* device_memory, size_t device_bytes, int64_t max_experts);

  ~GroupedExpertsWorkspace();
  GroupedExpertsWorkspace(const GroupedExpertsWorkspace&) = delete;
  GroupedExpertsWorkspace& operator=(const GroupedExpertsWorkspace&) = delete;

  // Times the host waited for the device inside forwards and backwards on
  // this workspace: one per successful forward with tokens > 0, none per
  // backward (a forward that rejects an out-of-range index waits once more
  // to read it for the error message).
  int64_t host_syncs() const;

  // After a successful forward: N (unmasked assignments), the row count of
  // each expert [E] on the host, and the device array row_of_slot [T * K]
  // (row of assignment t*K+k in expert order, -1 when masked). Empty / null
  // before.
  bool has_forward() const;
  int64_t rows() const;
  absl::Span<const int32_t> expert_rows() const;
  const int32_t* device_row_of_slot() const;

  size_t device_bytes() const;

  struct State;  // defined in the .cc

 private:
  explicit GroupedExpertsWorkspace(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;

  friend absl::Status GroupedExpertsForward(
      const ExpertDims& dims, const GroupedExpertsOptions& options,
      const void* x, const int32_t* indices, const float* weights,
      const bool* token_mask, const void* w_gu, const void* w_d, void* y,
      GroupedExpertsWorkspace* ws, cublasHandle_t cublas, cudaStream_t stream);
  friend absl::Status GroupedExpertsBackward(
      const ExpertDims& dims, const GroupedExpertsOptions& options,
      const void* w_gu, const void* w_d, const void* dy, void* dx,
      bool accumulate_dx, float* d_weights, float* dw_gu, float* dw_d,
      const ExpertBiasGrads& bias_grads, GroupedExpertsWorkspace* ws,
      cublasHandle_t cublas, cudaStream_t stream);
};

// Forward, enqueued on `stream` (device pointers; storage type per
// options.storage unless noted):
//   x [T, D]; indices [T, K] int32 in [0, E) (masked tokens' entries are
//   ignored); weights [T, K] fp32; token_mask [T] bool or null for all
//   tokens; w_gu [E, D, 2I]; w_d [E, I, D]; y [T, D], overwritten (masked
//   tokens get zeros).
// Pointers other than token_mask may be null only when T == 0. Saves what
// the backward needs in `ws`. Blocks the host once (see the top of the
// file). `cublas` runs on `stream` with host pointer mode for the call; its
// previous stream and pointer mode are restored before returning (note that
// cublasSetStream drops a workspace set with cublasSetWorkspace).
// Errors: INVALID_ARGUMENT for bad dims or options, a null pointer or
// handle, a workspace that is too small or has too few max_experts, or an
// unmasked index outside [0, E) (named as indices[t, k]); CUDA / cuBLAS
// failures as mapped by kernels/cuda/cuda_status.h.
absl::Status GroupedExpertsForward(const ExpertDims& dims,
                                   const GroupedExpertsOptions& options,
                                   const void* x, const int32_t* indices,
                                   const float* weights, const bool* token_mask,
                                   const void* w_gu, const void* w_d, void* y,
                                   GroupedExpertsWorkspace* ws,
                                   cublasHandle_t cublas, cudaStream_t stream);

// Backward of the last forward on `ws`, whose w_gu and w_d must be passed
// again unchanged, enqueued on `stream` after it. dy [T, D].
//   dx [T, D]: overwritten, or added to when `accumulate_dx` (masked tokens
//     get zero, or are left as they are when accumulating).
//   d_weights [T, K] fp32: dL/dweights, overwritten (zero for masked
//     tokens); it feeds the router backward.
//   dw_gu [E, D, 2I] and dw_d [E, I, D] fp32: ADDED to (zero them at the
//     start of a step).
// Any output may be null to skip it (frozen experts pass dw_gu = dw_d =
// nullptr). Never blocks the host. The workspace is not consumed: a second
// backward adds the parameter gradients again.
// Errors: FAILED_PRECONDITION if `ws` is null or holds no forward, or dims,
// activation or storage differ from the forward's (the GEMM path may
// differ); INVALID_ARGUMENT for a required null pointer (dy, w_d, w_gu when
// dx is wanted, the handle); CUDA / cuBLAS failures.
absl::Status GroupedExpertsBackward(
    const ExpertDims& dims, const GroupedExpertsOptions& options,
    const void* w_gu, const void* w_d, const void* dy, void* dx,
    bool accumulate_dx, float* d_weights, float* dw_gu, float* dw_d,
    GroupedExpertsWorkspace* ws, cublasHandle_t cublas, cudaStream_t stream);

// The same, also ADDING the bias gradients (kernels::ExpertBiasGrads'
// semantics: db_gu[e] += sum of dH over e's rows, db_d[e] += sum of w * dO,
// and d_weights gains dO . b_d[e]). Errors also: FAILED_PRECONDITION when
// alpha, limit or the biases' presence differ from the forward's.
absl::Status GroupedExpertsBackward(
    const ExpertDims& dims, const GroupedExpertsOptions& options,
    const void* w_gu, const void* w_d, const void* dy, void* dx,
    bool accumulate_dx, float* d_weights, float* dw_gu, float* dw_d,
    const ExpertBiasGrads& bias_grads, GroupedExpertsWorkspace* ws,
    cublasHandle_t cublas, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_GROUPED_EXPERTS_H_
