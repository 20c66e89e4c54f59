#ifndef SHARDD_KERNELS_CPU_UNINIT_VECTOR_H_
#define SHARDD_KERNELS_CPU_UNINIT_VECTOR_H_

// A std::vector whose resize() leaves new elements of trivial types
// uninitialized, for scratch that a kernel overwrites before it reads: no
// serial memset, and the pages are first touched by the (parallel) code
// that fills them.

#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace shardd {
namespace kernels {

template <typename T>
class DefaultInitAllocator : public std::allocator<T> {
 public:
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  using std::allocator<T>::allocator;

  // Default-initialization: nothing for trivial types.
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <typename T>
using UninitVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_UNINIT_VECTOR_H_
