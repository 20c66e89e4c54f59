#ifndef SHARDD_KERNELS_CUDA_DTYPE_H_
#define SHARDD_KERNELS_CUDA_DTYPE_H_

// Storage types of the CUDA ops. bf16 tensors are passed as uint16_t bit
// patterns (like the CPU path, kernels/cpu/bf16.h); arithmetic is fp32.

#include <cstddef>
#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

enum class DType {
  kFloat32,
  kBFloat16,
};

inline constexpr size_t DTypeSize(DType dtype) {
  return dtype == DType::kFloat32 ? sizeof(float) : sizeof(uint16_t);
}

inline constexpr const char* DTypeName(DType dtype) {
  return dtype == DType::kFloat32 ? "fp32" : "bf16";
}

// The DType of a storage type: float -> kFloat32, uint16_t -> kBFloat16.
template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct DTypeOf<uint16_t> {
  static constexpr DType value = DType::kBFloat16;
};

// Device workspaces are carved into pieces aligned to this many bytes (enough
// for 16-byte vector access and cuBLAS' preferred alignment).
inline constexpr size_t kWorkspaceAlignment = 256;

inline constexpr size_t AlignWorkspaceBytes(size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment *
         kWorkspaceAlignment;
}

// Hands out consecutive aligned pieces of a caller-provided workspace. With a
// null base it only adds up the sizes, so the ...WorkspaceBytes() queries and
// the ops share one layout function and cannot disagree.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}

  template <typename T>
  T* Take(size_t count) {
    char* piece = base_ == nullptr ? nullptr : base_ + used_;
    used_ += AlignWorkspaceBytes(count * sizeof(T));
    return reinterpret_cast<T*>(piece);
  }

  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_DTYPE_H_
