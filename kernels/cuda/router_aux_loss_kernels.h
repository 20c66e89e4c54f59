#ifndef SHARDD_KERNELS_CUDA_ROUTER_AUX_LOSS_KERNELS_H_
#define SHARDD_KERNELS_CUDA_ROUTER_AUX_LOSS_KERNELS_H_

// Launchers of the load-balancing loss kernels (router_aux_loss_kernels.cu);
// the argument checks are in router_aux_loss.cc. No absl.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

// counts[indices[i]] += 1 for the n = rows * top_k entries in [0, experts);
// the others add 1 to *invalid_indices (when not null).
cudaError_t LaunchRouterAuxCount(const int32_t* indices, int64_t n,
                                 int64_t experts, int64_t* counts,
                                 int64_t* invalid_indices, cudaStream_t stream);

cudaError_t LaunchRouterAuxValue(const int64_t* counts, const double* prob_sums,
                                 const int64_t* total_rows, int64_t experts,
                                 double* value, cudaStream_t stream);

cudaError_t LaunchRouterAuxBackward(const float* probs, int64_t rows,
                                    int64_t experts, const int64_t* counts,
                                    const int64_t* total_rows, double scale,
                                    float* d_logits, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ROUTER_AUX_LOSS_KERNELS_H_
