#ifndef SHARDD_KERNELS_CUDA_RMS_NORM_KERNELS_H_
#define SHARDD_KERNELS_CUDA_RMS_NORM_KERNELS_H_

// Launchers of the RMSNorm kernels (rms_norm_kernels.cu); arguments are
// validated by rms_norm.cc. rows >= 1, dim >= 1.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

// Rows per dweight partial sum for `rows` rows (a function of rows only, so
// results do not depend on the device).
int64_t RmsNormRowsPerChunk(int64_t rows);

cudaError_t LaunchRmsNormForward(const float* x, const float* weight,
                                 int64_t rows, int64_t dim, float eps, float* y,
                                 float* inv_rms, cudaStream_t stream);
cudaError_t LaunchRmsNormForward(const uint16_t* x, const uint16_t* weight,
                                 int64_t rows, int64_t dim, float eps,
                                 uint16_t* y, float* inv_rms,
                                 cudaStream_t stream);

// dweight (may be null) needs `partials`: ceil(rows / RmsNormRowsPerChunk)
// * dim floats.
cudaError_t LaunchRmsNormBackward(const float* dy, const float* x,
                                  const float* weight, const float* inv_rms,
                                  int64_t rows, int64_t dim, float* dx,
                                  bool accumulate_dx, float* dweight,
                                  float* partials, cudaStream_t stream);
cudaError_t LaunchRmsNormBackward(const uint16_t* dy, const uint16_t* x,
                                  const uint16_t* weight, const float* inv_rms,
                                  int64_t rows, int64_t dim, uint16_t* dx,
                                  bool accumulate_dx, float* dweight,
                                  float* partials, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_RMS_NORM_KERNELS_H_
