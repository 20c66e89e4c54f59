#include "program/pass_layout.h"

namespace shardd {

PassLayout PassLayout::For(absl::string_view architecture, int passes,
                           int no_grad_passes) {
  PassLayout layout;
  layout.block_diffusion_ = architecture == kBlockDiffusionArchitecture &&
                            passes == 3 && no_grad_passes == 1;
  layout.requires_grad_.assign(passes > 0 ? passes : 0, true);
  if (layout.block_diffusion_) {
    // The self-conditioning decode needs the encoder's K/V, so it cannot
    // come first.
    layout.requires_grad_[1] = false;
  } else {
    for (int p = 0; p < no_grad_passes && p < passes; ++p) {
      layout.requires_grad_[p] = false;
    }
  }
  for (int p = passes - 1; p >= 0; --p) {
    if (layout.requires_grad_[p]) layout.backward_order_.push_back(p);
  }
  return layout;
}

PassLayout PassLayout::ForEval(absl::string_view architecture, int passes,
                               int no_grad_passes) {
  PassLayout layout = For(architecture, passes, no_grad_passes);
  layout.requires_grad_.assign(layout.requires_grad_.size(), false);
  layout.backward_order_.clear();
  layout.eval_ = true;
  return layout;
}

bool PassLayout::requires_grad(int pass) const {
  return pass >= 0 && pass < passes() && requires_grad_[pass];
}

}  // namespace shardd
