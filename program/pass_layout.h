#ifndef SHARDD_PROGRAM_PASS_LAYOUT_H_
#define SHARDD_PROGRAM_PASS_LAYOUT_H_

// Which forward passes of a step build a graph, and the order in which the
// passes with gradients run their backward. The step shape (passes,
// no_grad_passes) says how many; the model's architecture says where.

#include <vector>

#include "absl/strings/string_view.h"

namespace shardd {

// DiffusionGemma's architecture name: its 3-pass steps use the
// block-diffusion layout.
inline constexpr char kBlockDiffusionArchitecture[] =
    "DiffusionGemmaForBlockDiffusion";

class PassLayout {
 public:
  // The layout of a step of `passes` passes, `no_grad_passes` of them
  // without gradients. For kBlockDiffusionArchitecture with 3 passes and 1
  // without gradients, NeMo AutoModel's training forward: pass 0 the causal
  // encode (gradients), pass 1 the self-conditioning decode (no graph),
  // pass 2 the decode (gradients), whose backward runs first and hands the
  // encoder's K/V gradients to pass 0's. Otherwise the first
  // `no_grad_passes` passes build no graph. Expects 0 <= no_grad_passes <
  // passes (the callers check the step shape first).
  static PassLayout For(absl::string_view architecture, int passes,
                        int no_grad_passes);
  // The same passes run forward only (an eval program): none builds a
  // graph, none has a backward.
  static PassLayout ForEval(absl::string_view architecture, int passes,
                            int no_grad_passes);

  int passes() const { return static_cast<int>(requires_grad_.size()); }
  // False for a pass outside [0, passes).
  bool requires_grad(int pass) const;
  // The passes with gradients, last first: the order of their backwards.
  const std::vector<int>& backward_order() const { return backward_order_; }
  bool block_diffusion() const { return block_diffusion_; }
  bool eval() const { return eval_; }

 private:
  std::vector<bool> requires_grad_;
  std::vector<int> backward_order_;
  bool block_diffusion_ = false;
  bool eval_ = false;
};

}  // namespace shardd

#endif  // SHARDD_PROGRAM_PASS_LAYOUT_H_
