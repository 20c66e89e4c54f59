#ifndef SHARDD_WORKER_SHARDS_LORA_MERGE_H_
#define SHARDD_WORKER_SHARDS_LORA_MERGE_H_

// The arithmetic of a LoRA-adapted weight on the CPU (docs/lora.md). The
// blocks compute with the merged weight W' = W + s B A and produce its
// gradient G = dL/dW' as for any weight; since W' is linear in A and B,
//   dL/dA = s B^T G,   dL/dB = s G A^T
// exactly (per expert for stacked experts, whose W is shardd's in-major
// [in, out] = W_hf^T). So every block, dense or grouped, gets LoRA without
// a LoRA path of its own; the frozen W takes no gradient and no optimizer
// state. The price against a fused LoRA kernel is the weight-gradient GEMM
// of each adapted weight, which full fine-tuning computes too.

#include <cstdint>
#include <vector>

#include "model/lora.h"

namespace shardd {

// The merge and the gradient split are row-major GEMMs,
//   C[m, n] = alpha op(A)[m, k] op(B)[k, n] + beta C[m, n],
// listed here once so that the host (OpenBLAS, LoraMergeInto below) and a
// device (cuBLAS through kernels/cuda/row_major_gemm.h,
// device_lora_merge.h) run the same calls on the same operands.
enum class LoraBuffer : uint8_t { kA, kB, kGrad, kWeight, kGradA, kGradB };

struct LoraGemmOperand {
  LoraBuffer buffer = LoraBuffer::kA;
  int64_t offset = 0;  // elements into the buffer
  int64_t ld = 0;      // row length of the stored (row-major) matrix
  bool transpose = false;
};

struct LoraGemm {
  int64_t m = 0, n = 0, k = 0;
  float alpha = 0.0f;
  LoraGemmOperand a, b;
  float beta = 0.0f;
  LoraBuffer c = LoraBuffer::kWeight;
  int64_t c_offset = 0;
  int64_t ldc = 0;
};

// The buffers a LoraGemm names, host or device pointers alike; a role the
// call does not use may stay null.
struct LoraBuffers {
  const float* a = nullptr;
  const float* b = nullptr;
  const float* grad = nullptr;  // G = dL/dW' in W's layout
  float* weight = nullptr;
  float* grad_a = nullptr;
  float* grad_b = nullptr;

  // The written roles (kWeight, kGradA, kGradB); null for the others.
  float* Mutable(LoraBuffer which) const;
  const float* Get(LoraBuffer which) const;
};

// w += s B A: one GEMM for a linear, one per expert for stacked experts
// (`experts` of them, beta 1).
std::vector<LoraGemm> LoraMergeGemms(const LoraTarget& target, int64_t experts);

// da = s B^T G, db = s G A^T (beta 0): two GEMMs per linear or expert.
std::vector<LoraGemm> LoraSplitGradGemms(const LoraTarget& target,
                                         int64_t experts);

// w += s B A over `experts` experts (the target's own count, or the ones
// this rank holds under expert parallelism; ignored for a linear).
void LoraMergeInto(const LoraTarget& target, int64_t experts, const float* a,
                   const float* b, float* w);

// da = s B^T G, db = s G A^T (overwritten), for G = dL/dW' in W's layout.
void LoraSplitGrad(const LoraTarget& target, int64_t experts, const float* a,
                   const float* b, const float* g, float* da, float* db);

}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_LORA_MERGE_H_
