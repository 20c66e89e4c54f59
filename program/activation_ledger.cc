#include "program/activation_ledger.h"

#include <algorithm>

namespace shardd {
namespace program_internal {

using v1::Command;

ActivationLedger::ActivationLedger(const v1::ActivationModel* model,
                                   const PassLayout& passes)
    : model_(model), passes_(passes) {
  if (model_ == nullptr) return;
  for (const v1::LayerActivations& layer : model_->layers()) {
    layers_[layer.layer()] = &layer;
  }
}

const v1::LayerActivations& ActivationLedger::Layer(int layer) const {
  auto it = layers_.find(layer);
  return it == layers_.end() ? none_ : *it->second;
}

int64_t ActivationLedger::Apply(Command::Op op, Command::Part part, int layer,
                                int pass) {
  if (model_ == nullptr) return 0;
  const v1::ActivationModel& m = *model_;
  const bool grad = passes_.requires_grad(pass);
  const int64_t before = live_;
  int64_t peak = before;
  if (op == Command::FORWARD) {
    switch (part) {
      case Command::EMBED: {
        live_ += m.stream_bytes();
        peak = live_;
        // The previous pass's output, kept only for this embedding when
        // that pass had no gradients.
        if (pass > 0 && !passes_.requires_grad(pass - 1)) {
          live_ -= m.hidden_bytes();
        }
        break;
      }
      case Command::LAYER: {
        const v1::LayerActivations& l = Layer(layer);
        peak = before + l.saved_bytes() + l.handoff_bytes();
        const bool experts = l.experts_saved_bytes() > 0;
        if (!grad) {
          // Dropped once the layer's last forward is done.
          live_ = experts ? peak : before;
        } else {
          live_ = before + (l.recompute() ? l.checkpoint_bytes()
                                          : l.saved_bytes()) +
                  l.handoff_bytes();
        }
        break;
      }
      case Command::EXPERTS: {
        const v1::LayerActivations& l = Layer(layer);
        peak = before + l.experts_saved_bytes();
        if (!grad) {
          live_ = before - l.handoff_bytes() - l.saved_bytes();
        } else {
          const bool recompute = l.recompute() || l.recompute_experts();
          live_ = before - l.handoff_bytes() +
                  (recompute ? 0 : l.experts_saved_bytes());
        }
        break;
      }
      case Command::HEAD: {
        // The stream becomes the final norm's input.
        peak = before - m.stream_bytes() + m.head_bytes();
        if (grad) {
          live_ = peak;
        } else {
          const bool next = pass + 1 < passes_.passes();
          live_ = before - m.stream_bytes() + (next ? m.hidden_bytes() : 0);
        }
        break;
      }
      default:
        break;
    }
  } else {
    switch (part) {
      case Command::HEAD:
        peak = before + m.grad_stream_bytes();
        live_ = peak - m.head_bytes();
        break;
      case Command::EXPERTS: {
        const v1::LayerActivations& l = Layer(layer);
        const bool recompute = l.recompute() || l.recompute_experts();
        peak = before + l.experts_grad_bytes() + l.experts_backward_bytes() +
               (recompute ? l.experts_saved_bytes() : 0);
        live_ = before + l.experts_grad_bytes() -
                (recompute ? 0 : l.experts_saved_bytes());
        break;
      }
      case Command::LAYER: {
        const v1::LayerActivations& l = Layer(layer);
        peak = before +
               (l.recompute() ? l.saved_bytes() - l.checkpoint_bytes() : 0) +
               l.backward_bytes();
        live_ = before -
                (l.recompute() ? l.checkpoint_bytes() : l.saved_bytes()) -
                l.experts_grad_bytes();
        break;
      }
      case Command::EMBED:
        live_ = before - m.grad_stream_bytes();
        break;
      default:
        break;
    }
  }
  return std::max({peak, before, live_});
}

}  // namespace program_internal
}  // namespace shardd
