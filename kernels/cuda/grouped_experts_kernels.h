#ifndef SHARDD_KERNELS_CUDA_GROUPED_EXPERTS_KERNELS_H_
#define SHARDD_KERNELS_CUDA_GROUPED_EXPERTS_KERNELS_H_

// Internal: the device kernels of the CUDA grouped experts
// (grouped_experts_kernels.cu) behind plain launchers. Only
// kernels/cuda/grouped_experts.cc should include this; the public API is
// kernels/cuda/grouped_experts.h. No absl here: nvcc compiles the .cu side.
//
// Every launcher enqueues on `stream`, returns the launch error
// (cudaGetLastError) and does nothing for empty sizes. Element data of the
// activations is fp32 or bf16 (`DeviceDtype`); routing weights, their
// gradients and all sums are fp32.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {
namespace internal {

enum class DeviceDtype { kFloat32, kBFloat16 };
enum class DeviceGate { kSilu, kGeluTanh, kClampedSilu };

// The gate's constants: kClampedSilu's sigmoid gain and clamp (GPT-OSS's
// swiglu alpha and limit); ignored by the other gates.
struct GateParams {
  float alpha = 1.702f;
  float limit = 7.0f;
};

// Assignments (slots) handled by one block of the routing kernels.
constexpr int64_t kRoutingChunk = 2048;
// Per-expert counters live in shared memory (4 bytes each).
constexpr int64_t kMaxRoutingExperts = 8192;

constexpr int64_t RoutingChunks(int64_t slots) {
  return (slots + kRoutingChunk - 1) / kRoutingChunk;
}

// Routing step 1. For every chunk c of kRoutingChunk slots, counts the live
// assignments of each expert: chunk_counts[c * experts + e]. A slot is live
// when its token is unmasked (token_mask null or token_mask[t]) and its index
// is in [0, experts). status[0] becomes the smallest unmasked slot whose
// index is outside [0, experts), or 0xFFFFFFFF when there is none.
cudaError_t LaunchRoutingCount(const int32_t* indices, const bool* token_mask,
                               int64_t tokens, int64_t top_k, int64_t experts,
                               int32_t* chunk_counts, uint32_t* status,
                               cudaStream_t stream);

// Routing step 2 (one block). Turns chunk_counts into exclusive per-expert
// bases over chunks (in place), writes the per-expert totals to
// expert_rows[experts], the exclusive scan of the totals to
// offsets[experts + 1], and the experts with at least one row, ascending, to
// nonempty_experts[0 .. number of such experts).
cudaError_t LaunchRoutingScan(int32_t* chunk_counts, int64_t chunks,
                              int64_t experts, int32_t* expert_rows,
                              int32_t* offsets, int32_t* nonempty_experts,
                              cudaStream_t stream);

// Routing step 3. Stable placement: the live slots of expert e get rows
// offsets[e], offsets[e] + 1, ... in slot order (token order, then k).
// Writes row_of_slot[slot] (-1 when not live), row_token[row] and
// row_weight[row] = weights[slot].
cudaError_t LaunchRoutingPlace(const int32_t* indices, const bool* token_mask,
                               const float* weights, int64_t tokens,
                               int64_t top_k, int64_t experts,
                               const int32_t* chunk_bases,
                               const int32_t* offsets, int32_t* row_of_slot,
                               int32_t* row_token, float* row_weight,
                               cudaStream_t stream);

// dst[row_of_slot[s]] = src[s / top_k] for every slot s with a row: the
// [tokens, dim] source gathered into expert order.
cudaError_t LaunchGatherRows(DeviceDtype dtype, const void* src,
                             const int32_t* row_of_slot, int64_t tokens,
                             int64_t top_k, int64_t dim, void* dst,
                             cudaStream_t stream);

// out[t] = (accumulate ? out[t] : 0) + sum over k in order of
// rows[row_of_slot[t * top_k + k]], skipping slots without a row; summed in
// fp32 and rounded once to the storage type. Deterministic (no atomics).
cudaError_t LaunchCombineRows(DeviceDtype dtype, const void* rows,
                              const int32_t* row_of_slot, int64_t tokens,
                              int64_t top_k, int64_t dim, bool accumulate,
                              void* out, cudaStream_t stream);

// a[r, i] = f(h[r, i]) * h[r, I + i] * row_weight[r] for r < rows, with
// h [rows, 2I] (gate half then up half) and a [rows, I]; kClampedSilu:
// a = g' sigmoid(alpha g') (u' + 1) w with g' = min(g, limit),
// u' = clamp(u, -limit, limit).
cudaError_t LaunchGatedActivationForward(DeviceDtype dtype, DeviceGate gate,
                                         GateParams params, const void* h,
                                         const float* row_weight, int64_t rows,
                                         int64_t inter, void* a,
                                         cudaStream_t stream);

// From da = dL/da [rows, I]: dh = dL/dh [rows, 2I] and
// row_dweight[r] = sum_i da[r, i] * (a[r, i] / w[r]) (fixed-order block
// reduction).
cudaError_t LaunchGatedActivationBackward(
    DeviceDtype dtype, DeviceGate gate, GateParams params, const void* h,
    const float* row_weight, const void* da, int64_t rows, int64_t inter,
    void* dh, float* row_dweight, cudaStream_t stream);

// out[s] = row_of_slot[s] < 0 ? 0 : row_values[row_of_slot[s]] for
// s < slots.
cudaError_t LaunchSlotValues(const float* row_values,
                             const int32_t* row_of_slot, int64_t slots,
                             float* out, cudaStream_t stream);

// One operand of a per-expert GEMM: the matrix of group j (expert
// e = nonempty_experts[j]) starts at
//   base + offsets[e] * row_stride_bytes + e * expert_stride_bytes.
struct ExpertOperand {
  const void* base = nullptr;
  int64_t row_stride_bytes = 0;
  int64_t expert_stride_bytes = 0;
};

// Writes the A, B and C pointer arrays of a grouped GEMM over the first
// `groups` non-empty experts: pointers[0 .. groups) for a,
// pointers[groups .. 2 groups) for b, pointers[2 groups .. 3 groups) for c.
cudaError_t LaunchExpertGemmPointers(ExpertOperand a, ExpertOperand b,
                                     ExpertOperand c,
                                     const int32_t* nonempty_experts,
                                     const int32_t* offsets, int64_t groups,
                                     void** pointers, cudaStream_t stream);

}  // namespace internal
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_GROUPED_EXPERTS_KERNELS_H_
