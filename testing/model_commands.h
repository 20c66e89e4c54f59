#ifndef SHARDD_TESTING_MODEL_COMMANDS_H_
#define SHARDD_TESTING_MODEL_COMMANDS_H_

// The FORWARD/BACKWARD commands of one whole step, for tests that drive a
// model directly (test-only target).

#include <vector>

#include "program/pass_layout.h"
#include "proto/worker.pb.h"

namespace shardd {
namespace testing_util {

// Per micro-batch: every pass forward (requires_grad from pass `no_grad`
// on), then the passes with gradients backward in reverse order; layer l
// takes EXPERTS commands when layer_has_moe[l].
inline std::vector<v1::Command> ModelStepCommands(
    const std::vector<bool>& layer_has_moe, int passes, int no_grad,
    int microbatches) {
  std::vector<v1::Command> out;
  auto add = [&](v1::Command::Op op, v1::Command::Part part, int layer,
                 int pass, int mb, bool grad) {
    v1::Command c;
    c.set_op(op);
    c.set_part(part);
    c.set_layer(layer);
    c.set_pass(pass);
    c.set_microbatch(mb);
    c.set_requires_grad(grad);
    out.push_back(c);
  };
  const int layers = static_cast<int>(layer_has_moe.size());
  for (int m = 0; m < microbatches; ++m) {
    for (int p = 0; p < passes; ++p) {
      const bool grad = p >= no_grad;
      add(v1::Command::FORWARD, v1::Command::EMBED, -1, p, m, grad);
      for (int l = 0; l < layers; ++l) {
        add(v1::Command::FORWARD, v1::Command::LAYER, l, p, m, grad);
        if (layer_has_moe[l]) {
          add(v1::Command::FORWARD, v1::Command::EXPERTS, l, p, m, grad);
        }
      }
      add(v1::Command::FORWARD, v1::Command::HEAD, -1, p, m, grad);
    }
    for (int p = passes - 1; p >= no_grad; --p) {
      add(v1::Command::BACKWARD, v1::Command::HEAD, -1, p, m, true);
      for (int l = layers - 1; l >= 0; --l) {
        if (layer_has_moe[l]) {
          add(v1::Command::BACKWARD, v1::Command::EXPERTS, l, p, m, true);
        }
        add(v1::Command::BACKWARD, v1::Command::LAYER, l, p, m, true);
      }
      add(v1::Command::BACKWARD, v1::Command::EMBED, -1, p, m, true);
    }
  }
  return out;
}

// The same for a pass layout (program/pass_layout.h): every pass forward
// (requires_grad as the layout says), then the backwards in its order;
// with `exchanged` (expert parallelism) EXPERTS sits between DISPATCH and
// COMBINE (backward: COMBINE, EXPERTS, DISPATCH).
inline std::vector<v1::Command> ModelStepCommands(
    const std::vector<bool>& layer_has_moe, const PassLayout& layout,
    int microbatches, bool exchanged = false) {
  std::vector<v1::Command> out;
  const int layers = static_cast<int>(layer_has_moe.size());
  auto add = [&](v1::Command::Op op, v1::Command::Part part, int layer,
                 int pass, int mb) {
    v1::Command c;
    c.set_op(op);
    c.set_part(part);
    c.set_layer(layer);
    c.set_pass(pass);
    c.set_microbatch(mb);
    c.set_requires_grad(op == v1::Command::BACKWARD ||
                        layout.requires_grad(pass));
    out.push_back(c);
  };
  for (int m = 0; m < microbatches; ++m) {
    for (int p = 0; p < layout.passes(); ++p) {
      add(v1::Command::FORWARD, v1::Command::EMBED, -1, p, m);
      for (int l = 0; l < layers; ++l) {
        add(v1::Command::FORWARD, v1::Command::LAYER, l, p, m);
        if (!layer_has_moe[l]) continue;
        if (exchanged) add(v1::Command::FORWARD, v1::Command::DISPATCH, l, p, m);
        add(v1::Command::FORWARD, v1::Command::EXPERTS, l, p, m);
        if (exchanged) add(v1::Command::FORWARD, v1::Command::COMBINE, l, p, m);
      }
      add(v1::Command::FORWARD, v1::Command::HEAD, -1, p, m);
    }
    for (int p : layout.backward_order()) {
      add(v1::Command::BACKWARD, v1::Command::HEAD, -1, p, m);
      for (int l = layers - 1; l >= 0; --l) {
        if (layer_has_moe[l]) {
          if (exchanged) add(v1::Command::BACKWARD, v1::Command::COMBINE, l, p, m);
          add(v1::Command::BACKWARD, v1::Command::EXPERTS, l, p, m);
          if (exchanged) add(v1::Command::BACKWARD, v1::Command::DISPATCH, l, p, m);
        }
        add(v1::Command::BACKWARD, v1::Command::LAYER, l, p, m);
      }
      add(v1::Command::BACKWARD, v1::Command::EMBED, -1, p, m);
    }
  }
  return out;
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_MODEL_COMMANDS_H_
