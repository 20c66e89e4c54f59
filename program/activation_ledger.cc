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
  for (const v1::LayerActivations& layer : model_->decode_layers()) {
    decode_layers_[layer.layer()] = &layer;
  }
}

const v1::LayerActivations& ActivationLedger::Layer(int layer) const {
  auto it = layers_.find(layer);
  return it == layers_.end() ? none_ : *it->second;
}

const v1::LayerActivations& ActivationLedger::DecodeLayer(int layer) const {
  auto it = decode_layers_.find(layer);
  return it == decode_layers_.end() ? none_ : *it->second;
}

ActivationLedger::Exchanges ActivationLedger::AllToAll(Command::Op op,
                                                       Command::Part part,
                                                       int layer,
                                                       int pass) const {
  Exchanges out;
  if (model_ == nullptr || model_->ep() <= 1 ||
      (part != Command::DISPATCH && part != Command::COMBINE)) {
    return out;
  }
  const v1::LayerActivations& l =
      model_->block_diffusion() && pass > 0 ? DecodeLayer(layer) : Layer(layer);
  if (l.routed_rows() <= 0) return out;
  const int64_t d = model_->hidden_size();
  out.rows = l.routed_rows();
  out.count = 1;
  if (op == Command::FORWARD) {
    // Rows out with their local expert and weight; outputs back.
    out.floats = part == Command::DISPATCH ? d + 2 : d;
    return out;
  }
  if (part == Command::DISPATCH) {
    out.floats = d + 1;  // Input gradients with the weights' back.
    return out;
  }
  out.floats = d;  // Output gradients out.
  if (l.recompute() || l.recompute_experts()) {
    // The recomputed forward's dispatch and combine first.
    out.count += 2;
    out.floats += (d + 2) + d;
  }
  return out;
}

int64_t ActivationLedger::LayerPart(Command::Op op, Command::Part part,
                                    const v1::LayerActivations& l, bool keep,
                                    bool recompute) {
  const int64_t before = live_;
  int64_t peak = before;
  const bool experts = l.experts_saved_bytes() > 0;
  // Only a pass with gradients recomputes.
  const bool recompute_layer = recompute && l.recompute();
  const bool recompute_experts =
      recompute && (l.recompute() || l.recompute_experts());
  if (op == Command::FORWARD && part == Command::LAYER) {
    peak = before + l.saved_bytes() + l.handoff_bytes();
    if (!keep) {
      // Dropped once the layer's last forward is done.
      live_ = experts ? peak : before;
    } else {
      const bool trim = recompute_layer && !l.checkpoint_after_experts();
      live_ = before + (trim ? l.checkpoint_bytes() : l.saved_bytes()) +
              l.handoff_bytes();
    }
  } else if (op == Command::FORWARD) {  // EXPERTS
    peak = before + l.experts_saved_bytes();
    if (!keep) {
      live_ = before - l.handoff_bytes() - l.saved_bytes();
    } else if (recompute_experts) {
      // Recomputed experts keep experts_checkpoint_bytes; a layer that
      // checkpoints after its experts trims itself now.
      const bool trim = recompute_layer && l.checkpoint_after_experts();
      live_ = before - l.handoff_bytes() + l.experts_checkpoint_bytes() -
              (trim ? l.saved_bytes() - l.checkpoint_bytes() : 0);
    } else {
      live_ = before - l.handoff_bytes() + l.experts_saved_bytes();
    }
  } else if (part == Command::EXPERTS) {
    peak = before + l.experts_grad_bytes() + l.experts_backward_bytes() +
           (recompute_experts
                ? l.experts_saved_bytes() - l.experts_checkpoint_bytes()
                : 0);
    // The grouped experts' state goes; what the layer's backward reads
    // stays.
    live_ = before + l.experts_grad_bytes() +
            (recompute_experts
                 ? l.experts_kept_bytes() - l.experts_checkpoint_bytes()
                 : l.experts_kept_bytes() - l.experts_saved_bytes());
  } else {  // BACKWARD(LAYER)
    peak = before +
           (recompute_layer ? l.saved_bytes() - l.checkpoint_bytes() : 0) +
           l.backward_bytes();
    live_ = before -
            (recompute_layer ? l.checkpoint_bytes() : l.saved_bytes()) -
            l.experts_kept_bytes() - l.experts_grad_bytes();
  }
  return peak;
}

int64_t ActivationLedger::Apply(Command::Op op, Command::Part part, int layer,
                                int pass) {
  if (model_ == nullptr) return 0;
  const int64_t before = live_;
  int64_t peak = before;
  // The exchange's buffers are counted in EXPERTS' peak (the activation
  // model's dispatch bytes): they live from DISPATCH to COMBINE.
  if (part == Command::DISPATCH || part == Command::COMBINE) return before;
  if (model_->block_diffusion()) {
    peak = BlockDiffusion(op, part, layer, pass);
    return std::max({peak, before, live_});
  }
  const v1::ActivationModel& m = *model_;
  const bool grad = passes_.requires_grad(pass);
  if (part == Command::LAYER || part == Command::EXPERTS) {
    peak = LayerPart(op, part, Layer(layer), grad, grad);
  } else if (op == Command::FORWARD && part == Command::EMBED) {
    live_ += m.stream_bytes();
    peak = live_;
    // The previous pass's output, kept only for this embedding when that
    // pass had no gradients.
    if (pass > 0 && !passes_.requires_grad(pass - 1)) {
      live_ -= m.hidden_bytes();
    }
  } else if (op == Command::FORWARD && part == Command::HEAD) {
    // The stream becomes the final norm's input.
    peak = before - m.stream_bytes() + m.head_bytes();
    if (grad) {
      live_ = peak;
    } else {
      const bool next = pass + 1 < passes_.passes();
      live_ = before - m.stream_bytes() + (next ? m.hidden_bytes() : 0);
    }
  } else if (part == Command::HEAD) {  // BACKWARD
    peak = before + m.grad_stream_bytes();
    live_ = peak - m.head_bytes();
  } else if (part == Command::EMBED) {  // BACKWARD
    live_ = before - m.grad_stream_bytes();
  }
  return std::max({peak, before, live_});
}

int64_t ActivationLedger::BlockDiffusion(Command::Op op, Command::Part part,
                                         int layer, int pass) {
  const v1::ActivationModel& m = *model_;
  const bool eval = passes_.eval();
  const bool encode = pass == 0;
  const int64_t before = live_;
  int64_t peak = before;
  const int64_t stream = encode ? m.stream_bytes() : m.decode_stream_bytes();
  const int64_t head = encode ? m.head_bytes() : m.decode_head_bytes();
  const int64_t grad_stream =
      encode ? m.grad_stream_bytes() : m.decode_grad_stream_bytes();
  if (part == Command::LAYER || part == Command::EXPERTS) {
    const v1::LayerActivations& l = encode ? Layer(layer) : DecodeLayer(layer);
    if (op == Command::FORWARD) {
      // The encode keeps its K/V for the decodes (in an evaluation until
      // the last decode's layer is done); the self-conditioning decode and
      // an evaluated decode drop theirs once the layer is done.
      const bool keep = encode || (pass == 2 && !eval);
      peak = LayerPart(op, part, l, keep, passes_.requires_grad(pass));
      if (eval && pass == 2 && part == Command::EXPERTS) {
        const v1::LayerActivations& e = Layer(layer);
        live_ -= e.saved_bytes() + e.experts_saved_bytes();
      }
      return peak;
    }
    if (part == Command::EXPERTS) return LayerPart(op, part, l, true, true);
    // BACKWARD(LAYER): a decode adds the encode's K/V gradients; the
    // encode frees them with the rest.
    const int64_t kv =
        encode ? encoder_kv_grads_[layer] : l.encoder_kv_grad_bytes();
    peak = LayerPart(op, part, l, true, true);
    if (encode) {
      live_ -= kv;
      encoder_kv_grads_[layer] = 0;
    } else {
      peak += kv;
      live_ += kv;
      encoder_kv_grads_[layer] = kv;
    }
    return peak;
  }
  if (op == Command::FORWARD && part == Command::EMBED) {
    if (pass == 1) {
      live_ += m.sc_embed_bytes() + stream;
    } else if (pass == 2) {
      live_ += m.sc_signal_bytes() + stream;
      peak = live_;
      // An evaluation needs no self-conditioning state once the decode's
      // input is built.
      if (eval) {
        live_ -= m.sc_embed_bytes() + m.sc_signal_bytes() + m.sc_probs_bytes();
      }
    } else {
      live_ += stream;
    }
    return std::max(peak, live_);
  }
  if (op == Command::FORWARD) {  // HEAD
    peak = before - stream + head;
    if (pass == 1) {
      // The softmaxed logits for pass 2; the hidden states go.
      peak += m.sc_probs_bytes();
      live_ = before - stream + m.sc_probs_bytes();
    } else if (eval) {
      live_ = before - stream;
    } else {
      live_ = peak;
    }
    return peak;
  }
  if (part == Command::HEAD) {  // BACKWARD
    peak = before + grad_stream;
    live_ = peak - head;
    return peak;
  }
  // BACKWARD(EMBED): the decode's self-conditioning backward frees its
  // state and the probabilities.
  if (pass == 2) {
    peak = before + m.sc_backward_bytes();
    live_ = before - grad_stream - m.sc_embed_bytes() - m.sc_signal_bytes() -
            m.sc_probs_bytes();
  } else {
    live_ = before - grad_stream;
  }
  return peak;
}

}  // namespace program_internal
}  // namespace shardd
