#ifndef SHARDD_KERNELS_CUDA_CUDNN_ATTENTION_H_
#define SHARDD_KERNELS_CUDA_CUDNN_ATTENTION_H_

// cuDNN's fused flash attention (the cuDNN 9 graph API's SDPA forward and
// backward, through NVIDIA's cuDNN frontend) for the attention shapes it
// computes, in bf16 with fp32 softmax statistics. The own kernels
// (attention.h) keep the rest; CudnnAttentionSupports is the written rule
// that chooses per call (docs/design.md, "Attention on the GPU").
//
// cuDNN is not linked: LoadCudnn opens the libcudnn.so.9 installed on the
// machine (a GPU machine with PyTorch has it through nvidia-cudnn-cu13) and
// checks its version against the API used here. Layouts are the own
// kernels': q [B, T, Hq, Dh], k [B, S, Hkv, Dh], v [B, S, Hkv, Dv],
// out [B, T, Hq, Dv], lse [B, Hq, T] (natural-log log-sum-exp of the scaled
// scores); cuDNN reads them through strides, without copies.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/attention.h"

namespace shardd {
namespace kernels {
namespace cuda {

// cuDNN 9.5 is the oldest whose SDPA backward takes the sliding-window
// (diagonal band) masks and grouped-query heads this code asks for; the
// frontend checks finer per-feature limits when it builds a graph.
inline constexpr int64_t kMinCudnnVersion = 90500;
// Environment variable naming the libcudnn to open (else the loader's
// search path finds libcudnn.so.9).
inline constexpr char kCudnnLibraryEnv[] = "SHARDD_CUDNN_LIBRARY";

// Which attention kernels the GPU model's blocks call.
enum class AttentionKernels : uint8_t {
  kOwn,    // attention.h's everywhere
  kAuto,   // cuDNN where CudnnAttentionSupports allows and cuDNN loads
  kCudnn,  // the same, but a cuDNN that does not load is an error
};
inline constexpr char kAttentionKernelsEnv[] = "SHARDD_ATTENTION";
// SHARDD_ATTENTION: "own" (the default until cuDNN's path has been
// verified on a GPU, docs/performance.md), "auto" or "cudnn".
// Errors: INVALID_ARGUMENT naming the variable and the allowed values.
absl::StatusOr<AttentionKernels> AttentionKernelsFromEnvironment();

// Opens cuDNN once per process and returns its version (cudnnGetVersion:
// 91900 for 9.19.0). Later calls return the first result.
// Errors: FAILED_PRECONDITION when the library cannot be opened (the
// message names what was tried and how to provide it), lacks
// cudnnGetVersion, or is older than kMinCudnnVersion or not cuDNN 9.
absl::StatusOr<int64_t> LoadCudnn();

// Whether cuDNN's fused attention computes this call: bf16 storage, q and
// v heads of equal width, a multiple of 8 and at most 256 (Hopper's limit
// for the fused backward), causal or sliding-window masks with queries
// and keys aligned (q_offset 0, T == S), no sinks and no packed rows
// (options.key_begin). OK when it does; UNIMPLEMENTED naming the first
// reason when not (the own kernels compute those: block-causal masks and
// decodes with offsets, 512-wide heads, sinks, packed rows, fp32 storage).
absl::Status CudnnAttentionSupports(const AttentionDims& dims,
                                    const AttentionOptions& options,
                                    bool bf16);

// Execution plans per shape on one device, built on first use and cached
// (graph construction and heuristics cost milliseconds; execution does
// not allocate). Not thread-safe: one per stream user.
class CudnnAttention {
 public:
  // Errors: LoadCudnn's; INTERNAL when cudnnCreate or cudnnSetStream fails.
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(
      cudaStream_t stream);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Workspace bytes of the forward / backward of this call's shape (the
  // plan is built and cached on the way). Errors: CudnnAttentionSupports';
  // INTERNAL with cuDNN's message when no engine computes the graph.
  absl::StatusOr<size_t> ForwardWorkspaceBytes(const AttentionDims& dims,
                                               const AttentionOptions& options);
  absl::StatusOr<size_t> BackwardWorkspaceBytes(
      const AttentionDims& dims, const AttentionOptions& options);

  // out and lse from q, k, v (device memory, bf16 but lse). `workspace` has
  // ForwardWorkspaceBytes. Errors: as ForwardWorkspaceBytes, and
  // INVALID_ARGUMENT for a smaller workspace.
  absl::Status Forward(const AttentionDims& dims,
                       const AttentionOptions& options, const uint16_t* q,
                       const uint16_t* k, const uint16_t* v, uint16_t* out,
                       float* lse, void* workspace, size_t workspace_bytes);
  // dq, dk, dv (bf16, overwritten) of the forward that wrote out and lse,
  // from d_out. Deterministic (cuDNN's deterministic algorithm), so a
  // recomputed step repeats its bits.
  absl::Status Backward(const AttentionDims& dims,
                        const AttentionOptions& options, const uint16_t* q,
                        const uint16_t* k, const uint16_t* v,
                        const uint16_t* out, const float* lse,
                        const uint16_t* d_out, uint16_t* dq, uint16_t* dk,
                        uint16_t* dv, void* workspace,
                        size_t workspace_bytes);

  // Plans built so far (a cache miss each).
  int64_t plans_built() const { return plans_built_; }

 private:
  struct Plan;
  // (backward, B, T, S, Hq, Hkv, Dh, Dv, mask, window, scale bits)
  using Key = std::tuple<bool, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int, int64_t, uint32_t>;

  CudnnAttention() = default;
  absl::StatusOr<Plan*> PlanFor(const AttentionDims& dims,
                                const AttentionOptions& options,
                                bool backward);

  void* handle_ = nullptr;  // cudnnHandle_t
  std::map<Key, std::unique_ptr<Plan>> plans_;
  int64_t plans_built_ = 0;
};

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_CUDNN_ATTENTION_H_
