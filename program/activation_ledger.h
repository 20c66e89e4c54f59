#ifndef SHARDD_PROGRAM_ACTIVATION_LEDGER_H_
#define SHARDD_PROGRAM_ACTIVATION_LEDGER_H_

// The live activations of one rank through a step's computations, from a
// plan's activation model (ShardingPlan.activations, planner/
// activation_model.h): what each FORWARD keeps and each BACKWARD frees,
// with recomputed layers, passes without gradients and evaluations. The
// CPU model holds exactly these bytes (docs/design.md, "Activation
// memory"). Internal to program/: the replay (step_replay.h) adds them to
// the unsharded bytes.

#include <cstdint>
#include <map>

#include "program/pass_layout.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"

namespace shardd {
namespace program_internal {

class ActivationLedger {
 public:
  // `model` null (no activation model): every computation keeps nothing.
  // `model` must outlive the ledger.
  ActivationLedger(const v1::ActivationModel* model, const PassLayout& passes);

  // Applies one computation (the replay has checked its order) and returns
  // the most bytes live during it; live() is then the bytes after it.
  int64_t Apply(v1::Command::Op op, v1::Command::Part part, int layer,
                int pass);

  int64_t live() const { return live_; }

  // Expert parallelism (the model's ep > 1): the all-to-all exchanges one
  // computation runs and the routed rows each moves, as the workers'
  // ExpertExchange sends them (worker/model/expert_exchange.h): FORWARD
  // DISPATCH sends rows of D + 2 floats (the row, its local expert and
  // weight), FORWARD COMBINE rows of D; BACKWARD COMBINE sends D (after
  // dispatching and combining again when the experts are recomputed) and
  // BACKWARD DISPATCH returns D + 1 (the weight's gradient). `floats` sums
  // the widths of the exchanges; with balanced routing each moves `rows`
  // rows. None for every other part.
  struct Exchanges {
    int count = 0;
    int64_t rows = 0;
    int64_t floats = 0;
  };
  Exchanges AllToAll(v1::Command::Op op, v1::Command::Part part, int layer,
                     int pass) const;

 private:
  const v1::LayerActivations& Layer(int layer) const;
  const v1::LayerActivations& DecodeLayer(int layer) const;

  // A layer's FORWARD / BACKWARD of LAYER or EXPERTS with `l`'s bytes;
  // `keep`: the forward keeps them (for a backward, or a later decode);
  // `recompute`: the pass builds a graph, so l's recompute flags apply.
  int64_t LayerPart(v1::Command::Op op, v1::Command::Part part,
                    const v1::LayerActivations& l, bool keep, bool recompute);
  // DiffusionGemma's block-diffusion step.
  int64_t BlockDiffusion(v1::Command::Op op, v1::Command::Part part, int layer,
                         int pass);

  const v1::ActivationModel* model_;
  const PassLayout passes_;
  std::map<int, const v1::LayerActivations*> layers_;
  std::map<int, const v1::LayerActivations*> decode_layers_;
  // Block diffusion: the encode layers' K/V gradients from the decode.
  std::map<int, int64_t> encoder_kv_grads_;
  v1::LayerActivations none_;
  int64_t live_ = 0;
};

}  // namespace program_internal
}  // namespace shardd

#endif  // SHARDD_PROGRAM_ACTIVATION_LEDGER_H_
