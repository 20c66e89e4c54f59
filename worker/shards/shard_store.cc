#include "worker/shards/shard_store.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/compute_pool.h"
#include "layout/shard_layout.h"
#include "worker/shards/lora_merge.h"

namespace shardd {
namespace {

bool SupportedCompute(v1::DType dtype) {
  return dtype == v1::FLOAT32 || dtype == v1::BFLOAT16;
}

// dst[i] = src[i] converted from `dtype` (fp32 or bf16) to fp32.
void ToFp32(const void* src, v1::DType dtype, int64_t n, float* dst) {
  if (dtype == v1::BFLOAT16) {
    kernels::Bf16ToFp32Array(static_cast<const uint16_t*>(src), dst, n);
  } else {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
}

using kernels::kElementGrain;

// dst[i] += src[i], dst in `dtype` (fp32, or bf16 rounded once per add).
void AddInto(const float* src, int64_t n, v1::DType dtype, void* dst) {
  kernels::ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    if (dtype == v1::BFLOAT16) {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = begin; i < end; ++i) {
        d[i] = kernels::Fp32ToBf16(kernels::Bf16ToFp32(d[i]) + src[i]);
      }
    } else {
      float* d = static_cast<float*>(dst);
      for (int64_t i = begin; i < end; ++i) d[i] += src[i];
    }
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardStore>> ShardStore::Create(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const ShardStoreOptions& options, MemoryTracker* tracker) {
  const int world = plan.mesh().dp_shard();
  if (world < 1 || options.shard_rank < 0 || options.shard_rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_rank: must be in [0, ", world, "), got ", options.shard_rank));
  }
  SHARDD_ASSIGN_OR_RETURN(std::vector<UnitLayout> layouts,
                          ComputeUnitLayouts(plan, options.shard_rank));
  auto store = absl::WrapUnique(new ShardStore(tracker, options));
  SHARDD_ASSIGN_OR_RETURN(const std::vector<LoraTarget> lora,
                          LoraTargetsOf(model));
  for (const LoraTarget& t : lora) store->lora_[t.base] = t;
  std::vector<float*> masters;
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    const UnitLayout& layout = layouts[u];
    auto state = std::make_unique<UnitState>();
    state->shard_numel = layout.shard_numel;
    state->gathered_numel = layout.gathered_numel;
    state->grad_chunk_numel = layout.grad_chunk_numel;
    state->world = layout.world;
    state->group_rank = options.shard_rank % layout.world;
    state->ep = layout.ep;
    state->compute = unit.precision().compute_dtype();
    state->reduce = unit.precision().reduce_dtype();
    state->flat = layout.flat;
    state->num_params = unit.params_size();
    if (!SupportedCompute(state->compute) || !SupportedCompute(state->reduce)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit '", unit.name(),
          "': the CPU worker computes and reduces in "
          "float32 or bfloat16, got compute ",
          DTypeName(state->compute), " and reduce ", DTypeName(state->reduce)));
    }
    state->state_numel =
        options.trim_frozen_state ? TrainableEnd(layout) : state->shard_numel;
    const int64_t bytes = state->shard_numel * 4;
    const int64_t state_bytes = state->state_numel * 4;
    state->master = TrackedBuffer(tracker, MemoryKind::kShardParams, bytes);
    state->grads = TrackedBuffer(tracker, MemoryKind::kShardGrads, state_bytes);
    state->exp_avg =
        TrackedBuffer(tracker, MemoryKind::kOptimizerState, state_bytes);
    state->exp_avg_sq =
        TrackedBuffer(tracker, MemoryKind::kOptimizerState, state_bytes);
    for (TrackedBuffer* b :
         {&state->grads, &state->exp_avg, &state->exp_avg_sq}) {
      if (!b->empty()) {
        std::memset(b->data(), 0, static_cast<size_t>(state_bytes));
      }
    }
    state->copies.resize(unit.params_size());
    for (int p = 0; p < unit.params_size(); ++p) {
      store->params_[unit.params(p).name()] = ParamRef{u, p};
    }
    masters.push_back(state->master.as<float>());
    store->units_.push_back(std::move(state));
  }
  // Every owned range from its global initialiser; padding zero.
  SHARDD_RETURN_IF_ERROR(InitMasterShards(plan, model, options.shard_rank,
                                          options.seed, masters,
                                          options.initial_values));
  store->layouts_ = std::move(layouts);
  for (int u = 0; u < plan.units_size(); ++u) {
    UnitState& state = *store->units_[u];
    if (plan.units(u).precision().keep_compute_shard() &&
        state.compute != v1::FLOAT32) {
      state.compute_shard =
          TrackedBuffer(tracker, MemoryKind::kShardParams,
                        state.shard_numel * DTypeBytes(state.compute));
      store->RefreshComputeShard(u, 0, state.shard_numel);
    }
  }
  return store;
}

absl::StatusOr<ShardStore::UnitState*> ShardStore::Unit(int unit) {
  if (unit < 0 || unit >= static_cast<int>(units_.size())) {
    return absl::NotFoundError(absl::StrCat("unit ", unit, ": the plan has ",
                                            units_.size(), " units"));
  }
  return units_[unit].get();
}

absl::StatusOr<const ShardStore::ParamRef*> ShardStore::Param(
    const std::string& name) const {
  auto it = params_.find(name);
  if (it == params_.end()) {
    return absl::NotFoundError(
        absl::StrCat("parameter '", name, "' is not in the plan"));
  }
  return &it->second;
}

bool ShardStore::gathered(int unit) const {
  return unit >= 0 && unit < num_units() && !units_[unit]->gathered.empty();
}

void ShardStore::RefreshComputeShard(int unit, int64_t begin, int64_t count) {
  if (unit < 0 || unit >= num_units()) return;
  UnitState& state = *units_[unit];
  if (state.compute_shard.empty() || count <= 0) return;
  // bf16 is the only compute dtype narrower than the fp32 master here.
  kernels::Fp32ToBf16Array(state.master.as<float>() + begin,
                           state.compute_shard.as<uint16_t>() + begin, count);
}

int ShardStore::slice_group_size(int unit) const {
  return unit >= 0 && unit < num_units() ? units_[unit]->slice_group : 0;
}

void ShardStore::DropSlice(int unit) {
  if (unit < 0 || unit >= num_units()) return;
  units_[unit]->slice.Reset();
  units_[unit]->slice_group = 0;
}

bool ShardStore::grad_allocated(int unit) const {
  return unit >= 0 && unit < num_units() &&
         !units_[unit]->unsharded_grad.empty();
}

absl::Status ShardStore::Unshard(int unit, Communicator* shard_group,
                                 const SliceGroups* slice_groups) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (!state->gathered.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Unshard: unit ", unit, " is already gathered"));
  }
  const int64_t elem = DTypeBytes(state->compute);
  if (state->slice_group > 1) {
    // Re-gather from the slices kept at the post-forward reshard: only the
    // G ranks of this rank's slice group take part.
    const int g = state->slice_group;
    Communicator* group = nullptr;
    if (slice_groups != nullptr) {
      auto it = slice_groups->find(g);
      if (it != slice_groups->end()) group = it->second;
    }
    if (group == nullptr || group->world_size() != g ||
        group->rank() != options_.shard_rank % g) {
      return absl::InvalidArgumentError(
          absl::StrCat("Unshard: unit ", unit, " holds a 1/", g,
                       " slice and needs a slice group of ", g,
                       " ranks with this rank at ", options_.shard_rank % g));
    }
    state->gathered = TrackedBuffer(tracker_, MemoryKind::kGatheredParams,
                                    state->gathered_numel * elem, &cache_);
    const absl::Status status = group->AllGather(
        state->slice.data(), state->gathered.data(), state->gathered_numel / g,
        state->compute, options_.collective_timeout);
    if (!status.ok()) {
      state->gathered.Reset();
      return status;
    }
    // Consumed; the buffer goes at DropSlice.
    state->slice_group = 0;
    return absl::OkStatus();
  }
  if (shard_group->world_size() != state->world ||
      shard_group->rank() != state->group_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Unshard: unit ", unit, " is gathered over ", state->world,
        " ranks with this rank at ", state->group_rank, "; the group has ",
        shard_group->world_size(), " with it at ", shard_group->rank()));
  }
  state->gathered = TrackedBuffer(tracker_, MemoryKind::kGatheredParams,
                                  state->gathered_numel * elem, &cache_);
  if (!state->compute_shard.empty()) {
    // The compute-dtype copy is the all-gather's input as it is (the
    // backend copies it into this rank's slot).
    absl::Status status = shard_group->AllGather(
        state->compute_shard.data(), state->gathered.data(), state->shard_numel,
        state->compute, options_.collective_timeout);
    if (!status.ok()) state->gathered.Reset();
    return status;
  }
  // Copy-in straight into this rank's slot, then gather in place.
  char* slot = state->gathered.as<char>() +
               state->group_rank * state->shard_numel * elem;
  const float* master = state->master.as<float>();
  if (state->compute == v1::BFLOAT16) {
    kernels::Fp32ToBf16Array(master, reinterpret_cast<uint16_t*>(slot),
                             state->shard_numel);
  } else {
    std::memcpy(slot, master, static_cast<size_t>(state->shard_numel) * 4);
  }
  absl::Status status =
      shard_group->AllGather(slot, state->gathered.data(), state->shard_numel,
                             state->compute, options_.collective_timeout);
  if (!status.ok()) state->gathered.Reset();
  return status;
}

absl::Status ShardStore::Reshard(int unit, int group_size) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (state->gathered.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Reshard: unit ", unit, " is not gathered"));
  }
  SHARDD_RETURN_IF_ERROR(CheckSliceGroupSize(group_size, state->world));
  const int g = group_size;
  if (g != 0) {
    const int64_t elem = DTypeBytes(state->compute);
    const int64_t slice_bytes = state->gathered_numel / g * elem;
    state->slice = TrackedBuffer(tracker_, MemoryKind::kGatheredParams,
                                 slice_bytes, &cache_);
    std::memcpy(
        state->slice.data(),
        state->gathered.as<char>() + (state->group_rank % g) * slice_bytes,
        static_cast<size_t>(slice_bytes));
    state->slice_group = g;
  }
  for (TrackedBuffer& copy : state->copies) copy.Reset();
  state->gathered.Reset();
  return absl::OkStatus();
}

absl::Status ShardStore::AllocGrad(int unit) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (!state->unsharded_grad.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("AllocGrad: unit ", unit, " already has a gradient"));
  }
  if (state->grad_chunk_numel == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("AllocGrad: unit ", unit, " has no trainable parameters"));
  }
  const int64_t bytes =
      state->grad_chunk_numel * state->world * DTypeBytes(state->reduce);
  state->unsharded_grad =
      TrackedBuffer(tracker_, MemoryKind::kUnshardedGrads, bytes, &cache_);
  kernels::FillZero(state->unsharded_grad.data(), bytes);
  return absl::OkStatus();
}

absl::Status ShardStore::ReduceScatter(int unit, Communicator* shard_group,
                                       Communicator* replicas) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (state->unsharded_grad.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ReduceScatter: unit ", unit, " has no gradient"));
  }
  const int64_t elem = DTypeBytes(state->reduce);
  const int64_t chunk = state->grad_chunk_numel;
  if (shard_group->world_size() != state->world ||
      shard_group->rank() != state->group_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ReduceScatter: unit ", unit, " is reduced over ", state->world,
        " ranks with this rank at ", state->group_rank, "; the group has ",
        shard_group->world_size(), " with it at ", shard_group->rank()));
  }
  // The reduced chunk lands in this rank's own slot of the input.
  char* out =
      state->unsharded_grad.as<char>() + state->group_rank * chunk * elem;
  SHARDD_RETURN_IF_ERROR(shard_group->ReduceScatter(
      state->unsharded_grad.data(), out, chunk, state->reduce, ReduceOp::kAvg,
      options_.collective_timeout));
  if (replicas != nullptr && replicas->world_size() > 1) {
    SHARDD_RETURN_IF_ERROR(replicas->AllReduce(out, chunk, state->reduce,
                                               ReduceOp::kAvg,
                                               options_.collective_timeout));
  }
  // Add the reduced chunk into the sharded gradient (UnitLayout::shard_grad:
  // a flat bucket chunk matches the shard element for element; a dim-0
  // chunk holds only the trainable parameters' shards).
  // An expert-parallel block's gradient holds the rows of its ep ranks'
  // tokens: averaged over the ep_shard ranks it is the sum of ep ranks'
  // local-mean gradients, so 1/ep more makes it the dp_shard average the
  // other units get.
  const float scale = 1.0f / static_cast<float>(state->ep);
  float* grads = state->grads.as<float>();
  auto add = [&](int64_t from, int64_t to, int64_t n) {
    kernels::ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
      if (state->reduce == v1::BFLOAT16) {
        const uint16_t* in = reinterpret_cast<const uint16_t*>(out) + from;
        for (int64_t i = begin; i < end; ++i)
          grads[to + i] += scale * kernels::Bf16ToFp32(in[i]);
      } else {
        const float* in = reinterpret_cast<const float*>(out) + from;
        for (int64_t i = begin; i < end; ++i) grads[to + i] += scale * in[i];
      }
    });
  };
  for (const CopySegment& seg : layouts_[unit].shard_grad) {
    add(seg.src, seg.dst, seg.count);
  }
  state->unsharded_grad.Reset();
  return absl::OkStatus();
}

bool ShardStore::ViewsInPlace(const UnitState& unit,
                              const ParamPlacement& param) const {
  if (unit.compute != v1::FLOAT32 || param.gathered.empty()) return false;
  // Flat buckets gather the parameters back to back; a single parameter's
  // rank chunks are consecutive rows; one rank holds everything in order.
  return unit.flat || unit.num_params == 1 || unit.world == 1;
}

absl::StatusOr<const float*> ShardStore::ParamView(const std::string& name) {
  SHARDD_ASSIGN_OR_RETURN(const ParamRef* ref, Param(name));
  UnitState* unit = units_[ref->unit].get();
  const ParamPlacement& param = layouts_[ref->unit].params[ref->index];
  if (unit->gathered.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "parameter '", name, "': unit ", ref->unit, " is not gathered"));
  }
  auto lora = lora_.find(name);
  if (lora != lora_.end()) return LoraView(lora->second, *ref);
  if (ViewsInPlace(*unit, param)) {
    return unit->gathered.as<const float>() + param.gathered[0].src;
  }
  TrackedBuffer& copy = unit->copies[ref->index];
  if (!copy.empty()) return copy.as<const float>();
  copy = TrackedBuffer(tracker_, MemoryKind::kWorkspace, param.numel * 4);
  CopyOut(*unit, param, copy.as<float>());
  return copy.as<const float>();
}

void ShardStore::CopyOut(const UnitState& unit, const ParamPlacement& param,
                         float* out) const {
  const int64_t elem = DTypeBytes(unit.compute);
  const char* base = unit.gathered.as<const char>();
  for (const CopySegment& seg : param.gathered) {
    ToFp32(base + seg.src * elem, unit.compute, seg.count, out + seg.dst);
  }
}

absl::StatusOr<ShardStore::LoraFactors> ShardStore::LoraFactorsOf(
    const LoraTarget& t, const ParamRef& ref) {
  const ParamPlacement& param = layouts_[ref.unit].params[ref.index];
  LoraFactors out;
  out.experts = t.experts == 0 ? 0 : t.experts / units_[ref.unit]->ep;
  if (param.numel != std::max<int64_t>(out.experts, 1) * t.in * t.out) {
    return absl::InternalError(absl::StrCat(
        "parameter '", t.base, "': ", param.numel,
        " gathered elements do not hold its LoRA geometry"));
  }
  SHARDD_ASSIGN_OR_RETURN(out.a, ParamView(t.a));
  SHARDD_ASSIGN_OR_RETURN(out.b, ParamView(t.b));
  return out;
}

absl::StatusOr<const float*> ShardStore::LoraView(const LoraTarget& t,
                                                  const ParamRef& ref) {
  UnitState* unit = units_[ref.unit].get();
  TrackedBuffer& copy = unit->copies[ref.index];
  // Merged once per gather (Reshard drops the copy). Always a copy: the
  // gathered buffer keeps W, since a reshard slice of it may seed the next
  // gather.
  if (!copy.empty()) return copy.as<const float>();
  SHARDD_ASSIGN_OR_RETURN(const LoraFactors f, LoraFactorsOf(t, ref));
  const ParamPlacement& param = layouts_[ref.unit].params[ref.index];
  copy = TrackedBuffer(tracker_, MemoryKind::kWorkspace, param.numel * 4);
  CopyOut(*unit, param, copy.as<float>());
  LoraMergeInto(t, f.experts, f.a, f.b, copy.as<float>());
  return copy.as<const float>();
}

absl::Status ShardStore::AccumulateGrad(const std::string& name,
                                        const float* values) {
  SHARDD_ASSIGN_OR_RETURN(const ParamRef* ref, Param(name));
  auto lora = lora_.find(name);
  if (lora != lora_.end()) {
    // dL/dW' -> the adapters' gradients; the frozen W takes none.
    const LoraTarget& t = lora->second;
    SHARDD_ASSIGN_OR_RETURN(const LoraFactors f, LoraFactorsOf(t, *ref));
    const int64_t count = std::max<int64_t>(f.experts, 1) * t.rank;
    std::vector<float> da(count * t.in), db(count * t.out);
    LoraSplitGrad(t, f.experts, f.a, f.b, values, da.data(), db.data());
    SHARDD_RETURN_IF_ERROR(AccumulateGrad(t.a, da.data()));
    return AccumulateGrad(t.b, db.data());
  }
  const ParamPlacement& param = layouts_[ref->unit].params[ref->index];
  if (param.frozen) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter '", name, "' is frozen: it has no gradient"));
  }
  UnitState* unit = units_[ref->unit].get();
  if (unit->unsharded_grad.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter '", name, "': unit ", ref->unit,
                     " has no gradient buffer (ALLOC_GRAD missing)"));
  }
  const int64_t elem = DTypeBytes(unit->reduce);
  char* base = unit->unsharded_grad.as<char>();
  for (const CopySegment& seg : param.grad) {
    AddInto(values + seg.src, seg.count, unit->reduce, base + seg.dst * elem);
  }
  return absl::OkStatus();
}

ShardStore::UnitShard ShardStore::shard(int unit) const {
  UnitShard out;
  if (unit < 0 || unit >= num_units()) return out;
  const UnitState& state = *units_[unit];
  out.params = state.master.as<float>();
  out.grads = state.grads.as<float>();
  out.exp_avg = state.exp_avg.as<float>();
  out.exp_avg_sq = state.exp_avg_sq.as<float>();
  out.state_numel = state.state_numel;
  out.numel = state.shard_numel;
  return out;
}

absl::Status ShardStore::CopyToHost(const float* from, int64_t n,
                                    float* to) const {
  return CopyHostFloats(from, n, to);
}

absl::Status ShardStore::CopyFromHost(const float* from, int64_t n,
                                      float* to) {
  return CopyHostFloats(from, n, to);
}

absl::Status ShardStore::ResetUnit(int unit) {
  if (unit < 0 || unit >= num_units()) {
    return absl::NotFoundError(
        absl::StrCat("unit ", unit, ": the store has ", num_units(), " units"));
  }
  const UnitState& state = *units_[unit];
  if (!state.grads.empty() && state.state_numel > 0) {
    std::memset(state.grads.data(), 0,
                static_cast<size_t>(state.state_numel) * sizeof(float));
  }
  RefreshComputeShard(unit, 0, state.shard_numel);
  return absl::OkStatus();
}

float* ShardStore::BufferOf(const UnitState& unit, ShardBuffer buffer) {
  switch (buffer) {
    case ShardBuffer::kExpAvg:
      return unit.exp_avg.as<float>();
    case ShardBuffer::kExpAvgSq:
      return unit.exp_avg_sq.as<float>();
    case ShardBuffer::kParams:
      break;
  }
  return unit.master.as<float>();
}

absl::Status ShardStore::CheckHeld(const std::string& name,
                                   const ParamRef& ref,
                                   ShardBuffer buffer) const {
  if (buffer == ShardBuffer::kParams) return absl::OkStatus();
  const int64_t held = units_[ref.unit]->state_numel;
  for (const OwnedRange& run : layouts_[ref.unit].params[ref.index].owned) {
    if (run.shard_offset + (run.end - run.begin) > held) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parameter '", name,
          "': its optimizer state is not held (a frozen parameter past the "
          "unit's last trainable range)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ShardStore::CopyOwnedParamSlice(const std::string& name,
                                             float* out,
                                             ShardBuffer buffer) const {
  SHARDD_ASSIGN_OR_RETURN(const ParamRef* ref, Param(name));
  SHARDD_RETURN_IF_ERROR(CheckHeld(name, *ref, buffer));
  const float* from = BufferOf(*units_[ref->unit], buffer);
  for (const OwnedRange& run : layouts_[ref->unit].params[ref->index].owned) {
    std::memcpy(out + run.begin, from + run.shard_offset,
                static_cast<size_t>(run.end - run.begin) * 4);
  }
  return absl::OkStatus();
}

absl::Status ShardStore::WriteOwnedParamSlice(const std::string& name,
                                              const float* in,
                                              ShardBuffer buffer) {
  SHARDD_ASSIGN_OR_RETURN(const ParamRef* ref, Param(name));
  SHARDD_RETURN_IF_ERROR(CheckHeld(name, *ref, buffer));
  float* to = BufferOf(*units_[ref->unit], buffer);
  for (const OwnedRange& run : layouts_[ref->unit].params[ref->index].owned) {
    const int64_t n = run.end - run.begin;
    std::memcpy(to + run.shard_offset, in + run.begin,
                static_cast<size_t>(n) * 4);
    if (buffer == ShardBuffer::kParams) {
      RefreshComputeShard(ref->unit, run.shard_offset, n);
    }
  }
  return absl::OkStatus();
}

}  // namespace shardd
