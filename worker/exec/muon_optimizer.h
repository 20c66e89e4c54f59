#ifndef SHARDD_WORKER_EXEC_MUON_OPTIMIZER_H_
#define SHARDD_WORKER_EXEC_MUON_OPTIMIZER_H_

// "muon": Muon (kernels/cpu/muon.h, Keller Jordan's published algorithm) for
// the hidden weight matrices, AdamW (kernels/cpu/adamw.h) for every other
// trainable parameter, with the job's lr and weight decay.
//
// Which parameters are Muon's (MuonRoleOf, from the model's module tree):
//   - a 2-D weight inside an attention or dense-MLP module (q/k/v/o, MLA's
//     low-rank projections, gate/up/down): one matrix;
//   - a 3-D tensor of a grouped-experts module, [E, in, out]: each expert's
//     [in, out] matrix separately;
//   - everything else is AdamW's: the embedding, the LM head, norms,
//     biases, 1-D and 2-D tensors of grouped experts (expert biases,
//     per-expert scales), attention sinks, and the router's [E, D] weight
//     (it produces logits, like the LM head, and has few rows; the
//     published recipe keeps input and output layers on AdamW).
// The update's shape scale sqrt(max(1, fan_out / fan_in)) uses the
// matrix's torch orientation: [out, in] for 2-D weights, and [in, out] as
// shardd stores each expert (fan_out = shape[2]).
//
// State: Muon's momentum lives in the parameter's exp_avg buffer, so
// checkpoints and resharding treat it as AdamW's first moment; its
// exp_avg_sq stays zero between steps (Prepare keeps the step's
// orthogonalised update there until Apply, Apply and Discard zero it).
//
// Sharding: on dim-0 shards each rank holds some rows of a matrix, so
// Prepare all-gathers the unit's Nesterov updates over the shard group (one
// all-gather per unit that holds a Muon matrix, through the backend's
// OptimizerShards, into a workspace buffer freed before the next unit),
// orthogonalises each whole matrix (every rank the same, on the same bits)
// and keeps this rank's rows. A dim-0 shard of stacked experts holds whole
// experts, so those are orthogonalised locally, without communication.
// Flat (megatron_fsdp) units cut matrices anywhere: Create refuses a flat
// unit holding a Muon parameter.
//
// Devices: written against OptimizerShards, so the CPU backend (kernels/cpu,
// Gloo) and the GPU backend (kernels/cuda with cuBLAS Newton-Schulz, NCCL)
// run this same code.

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/muon.h"
#include "model/model_util.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "worker/exec/optimizer.h"

namespace shardd {

enum class MuonRole {
  kAdamW,    // Not a Muon parameter.
  kMatrix,   // One 2-D [out, in] matrix.
  kExperts,  // [E, in, out]: E matrices.
};

MuonRole MuonRoleOf(const ParamRef& param);

class MuonOptimizer final : public Optimizer {
 public:
  // Errors: INVALID_ARGUMENT for a flat unit holding a Muon parameter
  // ("optimizer muon: unit N ... is a flat range (strategy S) ..."), a plan
  // parameter missing from `model`, or a bad `muon` (muon_lr, momentum,
  // ns_steps).
  static absl::StatusOr<std::unique_ptr<MuonOptimizer>> Create(
      const kernels::MuonConfig& muon, const kernels::AdamWConfig& adamw,
      const v1::ShardingPlan& plan, const v1::ModelSpec& model,
      const OptimizerShards& shards);

  absl::string_view name() const override { return "muon"; }
  absl::Status Prepare(OptimizerShards* shards, int unit,
                       const OptimizerStepContext& step) override;
  absl::Status Apply(OptimizerShards* shards, int unit,
                     const OptimizerStepContext& step) override;
  void Discard(OptimizerShards* shards) override;

 private:
  struct MuonParam {
    int placement = 0;  // Index into the unit layout's params.
    MuonRole role = MuonRole::kMatrix;
    int64_t matrices = 1;  // E for experts.
    int64_t rows = 0;      // Of one matrix as stored.
    int64_t cols = 0;
    float scale = 1.0f;  // MuonShapeScale in the torch orientation.
    // Experts sharded on dim 0 (each rank holds whole experts), as opposed
    // to split by elements (PlanOptions.shard_placement): then an expert
    // can straddle ranks and is orthogonalised from the gathered updates.
    bool whole_experts = true;
  };
  struct Unit {
    std::vector<MuonParam> params;
    // Trainable shard ranges of the AdamW parameters (sorted, merged).
    std::vector<std::pair<int64_t, int64_t>> adamw_ranges;
    // Whether Prepare all-gathers (a 2-D Muon matrix, or experts split by
    // elements, over > 1 ranks).
    bool gather = false;
  };

  MuonOptimizer(const kernels::MuonConfig& muon,
                const kernels::AdamWConfig& adamw)
      : muon_(muon), adamw_(adamw) {}

  const kernels::MuonConfig muon_;
  const kernels::AdamWConfig adamw_;
  std::vector<Unit> units_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_MUON_OPTIMIZER_H_
