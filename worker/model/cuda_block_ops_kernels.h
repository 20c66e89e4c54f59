#ifndef SHARDD_WORKER_MODEL_CUDA_BLOCK_OPS_KERNELS_H_
#define SHARDD_WORKER_MODEL_CUDA_BLOCK_OPS_KERNELS_H_

// The elementwise glue of CudaBlockOps (worker/model/cuda_block_ops.h)
// that kernels/cuda/ has no op for: residual adds, the self-conditioning
// coupling, the step-loss accumulation and the load-balancing statistics'
// bookkeeping. Plain launchers returning
// cudaError_t (no absl, so nvcc never sees it); asynchronous on `stream`.
// fp32 or bf16 storage (uint16_t bit patterns), fp32 arithmetic with
// explicit round-to-nearest operations (no FMA contraction), so fp32 results
// equal the CPU model's `x += a + b` and `x += scale * h` bit for bit.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace device_model {

// The step's loss and data-error counters in device memory; zeroed at a
// step's start, read once by DeviceMoeModel::ReadStepLoss.
struct DeviceStepLoss {
  double loss_sum = 0.0;        // sum of per-(pass, micro-batch) mean losses
  int64_t tokens = 0;           // counted targets
  int64_t invalid_targets = 0;  // from CrossEntropyDeviceResult
  int32_t bad_ids = 0;          // from the embedding kernels
  int32_t padding = 0;
};

// out[i] = x[i] + (a[i] + b[i]) (b may be null: out[i] = x[i] + a[i]).
// out may alias x. n >= 0.
cudaError_t LaunchResidualAdd(const float* x, const float* a, const float* b,
                              float* out, int64_t n, cudaStream_t stream);
cudaError_t LaunchResidualAdd(const uint16_t* x, const uint16_t* a,
                              const uint16_t* b, uint16_t* out, int64_t n,
                              cudaStream_t stream);

// x[i] = x[i] + scale * h[i] (product rounded, then the sum). n >= 0.
cudaError_t LaunchAddScaled(float* x, const float* h, float scale, int64_t n,
                            cudaStream_t stream);
cudaError_t LaunchAddScaled(uint16_t* x, const uint16_t* h, float scale,
                            int64_t n, cudaStream_t stream);

// One thread: acc->loss_sum += weight * *mean_loss; acc->tokens += *count;
// acc->invalid_targets += *invalid_targets (device pointers into a
// CrossEntropyDeviceResult; weight 1 but for DiffusionGemma's weighted
// terms).
cudaError_t LaunchAccumulateStepLoss(const double* mean_loss,
                                     const int64_t* count,
                                     const int64_t* invalid_targets,
                                     double weight, DeviceStepLoss* acc,
                                     cudaStream_t stream);

// x[i] *= scale (DiffusionGemma's embedding scale). n >= 0.
cudaError_t LaunchScale(float* x, float scale, int64_t n, cudaStream_t stream);
cudaError_t LaunchScale(uint16_t* x, float scale, int64_t n,
                        cudaStream_t stream);

// out[i] = (a[i] + b[i]) * s[0] (b may be null: a[i] * s[0]), s a device
// scalar (DiffusionGemma's layer_scalar). out may alias a. n >= 0.
cudaError_t LaunchSumTimesScalar(const float* a, const float* b, const float* s,
                                 float* out, int64_t n, cudaStream_t stream);
cudaError_t LaunchSumTimesScalar(const uint16_t* a, const uint16_t* b,
                                 const uint16_t* s, uint16_t* out, int64_t n,
                                 cudaStream_t stream);

// The load-balancing statistics (kernels/cuda/router_aux_loss.h) between
// their device sums and the all-reduce, as the CPU model converts them.

// One thread: *counter += value.
cudaError_t LaunchAddCount(int64_t* counter, int64_t value,
                           cudaStream_t stream);

// out[i] = (float) in[i] (round to nearest): the sums the ranks all-reduce
// in fp32, like the CPU's RouterAuxStats::prob_sums. n >= 0.
cudaError_t LaunchDoubleToFloat(const double* in, float* out, int64_t n,
                                cudaStream_t stream);
// out[i] = (double) in[i] (exact). n >= 0.
cudaError_t LaunchFloatToDouble(const float* in, double* out, int64_t n,
                                cudaStream_t stream);

// One thread: acc->loss_sum += coef * *value (the pass's aux term).
cudaError_t LaunchAccumulateAuxLoss(const double* value, double coef,
                                    DeviceStepLoss* acc, cudaStream_t stream);

// x[i] *= (float) *count: the aux gradient times the number of ranks whose
// average the reduce-scatter forms (summed on the device). n >= 0.
cudaError_t LaunchScaleByCount(float* x, int64_t n, const int64_t* count,
                               cudaStream_t stream);

}  // namespace device_model
}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_CUDA_BLOCK_OPS_KERNELS_H_
