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

#include "model/lora.h"

namespace shardd {

// w += s B A over `experts` experts (the target's own count, or the ones
// this rank holds under expert parallelism; ignored for a linear).
void LoraMergeInto(const LoraTarget& target, int64_t experts, const float* a,
                   const float* b, float* w);

// da = s B^T G, db = s G A^T (overwritten), for G = dL/dW' in W's layout.
void LoraSplitGrad(const LoraTarget& target, int64_t experts, const float* a,
                   const float* b, const float* g, float* da, float* db);

}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_LORA_MERGE_H_
