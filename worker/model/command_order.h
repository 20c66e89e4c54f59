#ifndef SHARDD_WORKER_MODEL_COMMAND_ORDER_H_
#define SHARDD_WORKER_MODEL_COMMAND_ORDER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "program/pass_layout.h"
#include "proto/worker.pb.h"

namespace shardd {

// Checks one micro-batch handed to a model's SetBatch: `microbatch` in
// [0, microbatches), batch and seq >= 1, non-null arrays of batch * seq ids,
// inputs in [0, vocab), targets in [0, vocab) or -1 (ignored). Returns the
// number of counted (non-ignored) targets. INVALID_ARGUMENT names the field.
// The ids in targets[0, n) other than -1, each checked to lie in
// [0, vocab): INVALID_ARGUMENT naming `field`[i] otherwise.
absl::StatusOr<int64_t> CountTargets(const int32_t* targets, int64_t n,
                                     int64_t vocab, absl::string_view field);

absl::StatusOr<int64_t> CheckMicroBatch(int microbatch, int microbatches,
                                        const int32_t* inputs,
                                        const int32_t* targets, int64_t batch,
                                        int64_t seq, int64_t vocab);

// The order in which a model accepts one step's FORWARD and BACKWARD
// commands, shared by the CPU and the CUDA model (what each command
// computes is theirs). Per pass: EMBED, then LAYER l (and EXPERTS l in a
// MoE layer) for l = 0..L-1, then HEAD; pass p's EMBED needs pass p-1's
// HEAD (self-conditioning). Backward, in a pass with gradients: HEAD, then
// for l = L-1..0 EXPERTS l (MoE layers) and LAYER l, then EMBED.
//
// Not thread-safe.
class ModelCommandOrder {
 public:
  // `layer_has_moe[l]`: layer l takes EXPERTS commands. With
  // `per_microbatch` every (pass, micro-batch) keeps its own place, so
  // micro-batches may interleave (the CUDA model keeps activations per
  // micro-batch); without it the place is per pass and a micro-batch's
  // FORWARD EMBED starts the pass over (the CPU model reuses one set of
  // activations per pass).
  ModelCommandOrder(int passes, int no_grad_passes, int microbatches,
                    std::vector<bool> layer_has_moe, bool per_microbatch);
  // The same with the passes' gradients laid out by `passes`
  // (program/pass_layout.h: DiffusionGemma's pass 1 builds no graph).
  ModelCommandOrder(const PassLayout& passes, int microbatches,
                    std::vector<bool> layer_has_moe, bool per_microbatch);

  // Whether `c` may run now. INVALID_ARGUMENT: pass, micro-batch or layer
  // out of range, an op other than FORWARD/BACKWARD (`model` names the
  // model in that message), a part the op does not take, EXPERTS of a
  // layer without experts (forward). FAILED_PRECONDITION: BACKWARD of a
  // pass without gradients, or a command out of order (the message says
  // which command must come first).
  absl::Status Check(const v1::Command& c, absl::string_view model) const;

  // Records that `c`, which passed Check, ran.
  void Commit(const v1::Command& c);

  // Forgets every command (a new step).
  void Reset();

  // Expert parallelism: every MoE layer's EXPERTS sits between DISPATCH and
  // COMBINE, forward (DISPATCH, EXPERTS, COMBINE) and backward (COMBINE,
  // EXPERTS, DISPATCH); without it DISPATCH and COMBINE are refused.
  void SetExchanged(bool exchanged) { exchanged_ = exchanged; }

 private:
  struct Place {
    bool embedded = false;
    bool head_done = false;
    bool head_backward_done = false;
    int next_backward_layer = -1;
    std::vector<bool> layer_done;
    std::vector<bool> experts_done;
    // Under expert parallelism, how far a layer's exchange got: forward 1
    // after DISPATCH, 2 after EXPERTS (experts_done after COMBINE);
    // backward 3 after COMBINE, 4 after EXPERTS (0 again after DISPATCH).
    std::vector<int> stage;
  };

  const Place& At(int pass, int microbatch) const;
  Place& At(int pass, int microbatch);
  absl::Status CheckForward(const v1::Command& c) const;
  absl::Status CheckBackward(const v1::Command& c) const;

  int passes_;
  PassLayout layout_;
  int microbatches_;
  std::vector<bool> layer_has_moe_;
  bool per_microbatch_;
  bool exchanged_ = false;
  std::vector<Place> places_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_COMMAND_ORDER_H_
