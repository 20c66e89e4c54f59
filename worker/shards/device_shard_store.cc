#include "worker/shards/device_shard_store.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/memory/cuda_memory_backend.h"
#include "worker/shards/device_shard_kernels.h"

namespace shardd {
namespace {

bool Supported(v1::DType dtype) {
  return dtype == v1::FLOAT32 || dtype == v1::BFLOAT16;
}

cudaStream_t ToCuda(void* stream) { return static_cast<cudaStream_t>(stream); }

absl::StatusOr<DeviceBuffer> Alloc(DeviceAllocator* allocator, int64_t bytes,
                                   MemoryKind kind, cudaStream_t stream) {
  return DeviceBuffer::Allocate(allocator, bytes, kind, ToDeviceStream(stream));
}

}  // namespace

DeviceShardStore::DeviceShardStore(DeviceAllocator* allocator,
                                   cudaStream_t compute_stream,
                                   NcclCommunicator* shard_group,
                                   NcclCommunicator* replicas,
                                   const DeviceSliceGroups& slice_groups,
                                   const DeviceShardStoreOptions& options)
    : allocator_(allocator),
      compute_stream_(compute_stream),
      shard_group_(shard_group),
      replicas_(replicas),
      slice_groups_(slice_groups),
      options_(options) {}

DeviceShardStore::~DeviceShardStore() {
  // Buffers go back to the allocator (no device wait: the allocator only
  // reuses them for later work on their home streams).
  units_.clear();
  if (edge_event_ != nullptr) cudaEventDestroy(edge_event_);
}

absl::StatusOr<std::unique_ptr<DeviceShardStore>> DeviceShardStore::Create(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const DeviceShardStoreOptions& options, DeviceAllocator* allocator,
    cudaStream_t compute_stream, NcclCommunicator* shard_group,
    NcclCommunicator* replicas, const DeviceSliceGroups& slice_groups,
    NcclCommunicator* ep_shard) {
  if (allocator == nullptr || shard_group == nullptr) {
    return absl::InvalidArgumentError(
        "allocator and shard_group: must not be null");
  }
  const int world = plan.mesh().dp_shard();
  if (shard_group->world_size() != world ||
      shard_group->rank() != options.shard_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_group: must have mesh.dp_shard (", world,
                     ") ranks with this rank at shard_rank (",
                     options.shard_rank, "), got rank ", shard_group->rank(),
                     " of ", shard_group->world_size()));
  }
  SHARDD_ASSIGN_OR_RETURN(std::vector<UnitLayout> layouts,
                          ComputeUnitLayouts(plan, options.shard_rank));
  auto store = absl::WrapUnique(new DeviceShardStore(
      allocator, compute_stream, shard_group, replicas, slice_groups, options));
  store->ep_shard_ = ep_shard;
  store->gather_stream_ = shard_group->all_gather_stream();
  store->reduce_stream_ = shard_group->reduce_scatter_stream();
  SHARDD_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(shard_group->device()),
                                    "cudaSetDevice (shard store)"));
  SHARDD_RETURN_IF_ERROR(CudaStatus(
      cudaEventCreateWithFlags(&store->edge_event_, cudaEventDisableTiming),
      "cudaEventCreate (shard store)"));

  // The CPU store's initial values, computed on the host.
  std::vector<std::vector<float>> host(plan.units_size());
  std::vector<float*> host_ptrs;
  for (int u = 0; u < plan.units_size(); ++u) {
    host[u].assign(plan.units(u).shard_numel(), 0.0f);
    host_ptrs.push_back(host[u].data());
  }
  SHARDD_RETURN_IF_ERROR(InitMasterShards(plan, model, options.shard_rank,
                                          options.seed, host_ptrs,
                                          options.initial_values));

  store->units_.resize(plan.units_size());
  const cudaStream_t home = compute_stream;
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    UnitState& state = store->units_[u];
    state.compute = unit.precision().compute_dtype();
    state.reduce = unit.precision().reduce_dtype();
    // The ranks the unit is gathered over: the shard group, or for an
    // expert-parallel block its ep_shard group (layout/shard_layout.h).
    const UnitLayout& layout = layouts[u];
    state.ep = layout.ep;
    state.group = layout.ep > 1 ? ep_shard : shard_group;
    state.group_rank = options.shard_rank % layout.world;
    if (state.group == nullptr || state.group->world_size() != layout.world ||
        state.group->rank() != state.group_rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit '", unit.name(), "' is gathered over ", layout.world,
          " ranks with this rank at ", state.group_rank,
          layout.ep > 1 ? " (an expert-parallel block: the ep_shard group)"
                        : "",
          ", and the store has no such group"));
    }
    if (!Supported(state.compute) || !Supported(state.reduce)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit '", unit.name(),
          "': the GPU worker computes and reduces in float32 or bfloat16, "
          "got compute ",
          DTypeName(state.compute), " and reduce ", DTypeName(state.reduce)));
    }
    const int64_t n = unit.shard_numel();
    const int64_t bytes = n * 4;
    state.state_numel =
        options.trim_frozen_state ? TrainableEnd(layouts[u]) : n;
    const int64_t state_bytes = state.state_numel * 4;
    SHARDD_ASSIGN_OR_RETURN(
        state.master, Alloc(allocator, bytes, MemoryKind::kShardParams, home));
    SHARDD_ASSIGN_OR_RETURN(state.grads, Alloc(allocator, state_bytes,
                                               MemoryKind::kShardGrads, home));
    SHARDD_ASSIGN_OR_RETURN(
        state.exp_avg,
        Alloc(allocator, state_bytes, MemoryKind::kOptimizerState, home));
    SHARDD_ASSIGN_OR_RETURN(
        state.exp_avg_sq,
        Alloc(allocator, state_bytes, MemoryKind::kOptimizerState, home));
    if (n > 0) {
      SHARDD_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(state.master.data(), host[u].data(), bytes,
                                     cudaMemcpyHostToDevice, home),
                     "copying the initial master shard"));
    }
    if (state_bytes > 0) {
      for (DeviceBuffer* b :
           {&state.grads, &state.exp_avg, &state.exp_avg_sq}) {
        SHARDD_RETURN_IF_ERROR(
            CudaStatus(cudaMemsetAsync(b->data(), 0, state_bytes, home),
                       "zeroing shard state"));
      }
    }
    if (unit.precision().keep_compute_shard() && state.compute != v1::FLOAT32 &&
        n > 0) {
      SHARDD_ASSIGN_OR_RETURN(state.compute_shard,
                              Alloc(allocator, n * DTypeBytes(state.compute),
                                    MemoryKind::kShardParams, home));
      SHARDD_RETURN_IF_ERROR(kernels::cuda::CastFp32ToBf16(
          state.master.as<const float>(), state.compute_shard.as<uint16_t>(), n,
          home));
    }
    state.copies.resize(unit.params_size());
    state.grad_temps.resize(unit.params_size());
    for (const ParamPlacement& p : layouts[u].params) {
      store->params_[p.name] = ParamRef{u, p.index};
    }
  }
  store->layouts_ = std::move(layouts);
  // The host vectors go out of scope: wait for the copies once, here.
  SHARDD_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(home),
                                    "initialising the device shards"));
  return store;
}

absl::StatusOr<DeviceShardStore::UnitState*> DeviceShardStore::Unit(int unit) {
  if (unit < 0 || unit >= num_units()) {
    return absl::NotFoundError(
        absl::StrCat("unit ", unit, ": the plan has ", num_units(), " units"));
  }
  return &units_[unit];
}

absl::StatusOr<DeviceShardStore::ParamRef> DeviceShardStore::Find(
    const std::string& name) const {
  auto it = params_.find(name);
  if (it == params_.end()) {
    return absl::NotFoundError(
        absl::StrCat("parameter '", name, "' is not in the plan"));
  }
  return it->second;
}

absl::Status DeviceShardStore::StreamWaitStream(cudaStream_t waiter,
                                                cudaStream_t signaler) {
  if (waiter == signaler) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(edge_event_, signaler),
                                    "cudaEventRecord (stream edge)"));
  return CudaStatus(cudaStreamWaitEvent(waiter, edge_event_, 0),
                    "cudaStreamWaitEvent (stream edge)");
}

bool DeviceShardStore::gathered(int unit) const {
  return unit >= 0 && unit < num_units() && !units_[unit].gathered.empty();
}

bool DeviceShardStore::grad_allocated(int unit) const {
  return unit >= 0 && unit < num_units() &&
         !units_[unit].unsharded_grad.empty();
}

int DeviceShardStore::slice_group_size(int unit) const {
  return unit >= 0 && unit < num_units() ? units_[unit].slice_group : 0;
}

absl::Status DeviceShardStore::Unshard(int unit) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (!state->gathered.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Unshard: unit ", unit, " is already gathered"));
  }
  const UnitLayout& layout = layouts_[unit];
  const int64_t elem = DTypeBytes(state->compute);
  const absl::Duration timeout = options_.collective_timeout;
  const cudaStream_t gather_stream = state->group->all_gather_stream();
  if (state->slice_group > 1) {
    const int g = state->slice_group;
    auto it = slice_groups_.find(g);
    NcclCommunicator* group = it == slice_groups_.end() ? nullptr : it->second;
    if (group == nullptr || group->world_size() != g ||
        group->rank() != options_.shard_rank % g) {
      return absl::InvalidArgumentError(
          absl::StrCat("Unshard: unit ", unit, " holds a 1/", g,
                       " slice and needs a slice group of ", g,
                       " ranks with this rank at ", options_.shard_rank % g));
    }
    SHARDD_ASSIGN_OR_RETURN(state->gathered,
                            Alloc(allocator_, layout.gathered_numel * elem,
                                  MemoryKind::kGatheredParams, gather_stream));
    // The slice group's own stream runs the gather: it waits for the home
    // stream, where the slice was written and the buffer last freed.
    absl::StatusOr<NcclWork> work = group->AllGatherAsync(
        state->slice.data(), state->gathered.data(), layout.gathered_numel / g,
        state->compute, NcclWaitFor::Stream(gather_stream), timeout);
    if (!work.ok()) {
      state->gathered.Reset();
      return work.status();
    }
    // Consumed; DropSlice frees it once the gather is waited for.
    state->gather = std::move(*work);
    state->slice_group = 0;
    state->slice_consumed = true;
    return absl::OkStatus();
  }
  SHARDD_ASSIGN_OR_RETURN(state->gathered,
                          Alloc(allocator_, layout.gathered_numel * elem,
                                MemoryKind::kGatheredParams, gather_stream));
  // The optimizer of the last step wrote the master (or its bf16 copy) on
  // the compute stream.
  absl::Status status = StreamWaitStream(gather_stream, compute_stream_);
  const void* input = nullptr;
  char* slot = state->gathered.as<char>() +
               state->group_rank * layout.shard_numel * elem;
  if (status.ok()) {
    if (!state->compute_shard.empty()) {
      input = state->compute_shard.data();
    } else if (state->compute == v1::BFLOAT16) {
      status = kernels::cuda::CastFp32ToBf16(state->master.as<const float>(),
                                             reinterpret_cast<uint16_t*>(slot),
                                             layout.shard_numel, gather_stream);
      input = slot;
    } else {
      input = state->master.data();
    }
  }
  if (status.ok()) {
    absl::StatusOr<NcclWork> work = state->group->AllGatherAsync(
        input, state->gathered.data(), layout.shard_numel, state->compute,
        NcclWaitFor::Nothing(), timeout);
    if (work.ok()) {
      state->gather = std::move(*work);
      return absl::OkStatus();
    }
    status = work.status();
  }
  state->gathered.Reset();
  return status;
}

absl::Status DeviceShardStore::Reshard(int unit, int group_size) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (state->gathered.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Reshard: unit ", unit, " is not gathered"));
  }
  const UnitLayout& layout = layouts_[unit];
  SHARDD_RETURN_IF_ERROR(CheckSliceGroupSize(group_size, layout.world));
  const int g = group_size;
  // The home stream waits for the gather (it may have run on a slice
  // group's stream) and for the last reader (compute).
  if (state->gather.valid()) {
    SHARDD_RETURN_IF_ERROR(
        state->gather.StreamWait(state->group->all_gather_stream()));
  }
  SHARDD_RETURN_IF_ERROR(
      StreamWaitStream(state->group->all_gather_stream(), compute_stream_));
  if (g != 0) {
    const int64_t elem = DTypeBytes(state->compute);
    const int64_t slice_bytes = layout.gathered_numel / g * elem;
    SHARDD_ASSIGN_OR_RETURN(
        state->slice,
        Alloc(allocator_, slice_bytes, MemoryKind::kGatheredParams,
              state->group->all_gather_stream()));
    SHARDD_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(state->slice.data(),
                                   state->gathered.as<char>() +
                                       (options_.shard_rank % g) * slice_bytes,
                                   slice_bytes, cudaMemcpyDeviceToDevice,
                                   state->group->all_gather_stream()),
                   "copying the post-forward slice"));
    state->slice_group = g;
  }
  // Copy-outs live on the compute stream, their only user.
  for (DeviceBuffer& copy : state->copies) copy.Reset();
  state->gathered.Reset();
  state->gather = NcclWork();
  return absl::OkStatus();
}

absl::Status DeviceShardStore::DropSlice(int unit) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (!state->slice_consumed) return absl::OkStatus();
  // The re-gather that read the slice ran on the slice group's stream.
  if (state->gather.valid()) {
    SHARDD_RETURN_IF_ERROR(
        state->gather.StreamWait(state->group->all_gather_stream()));
  }
  state->slice.Reset();
  state->slice_consumed = false;
  return absl::OkStatus();
}

absl::Status DeviceShardStore::AllocGrad(int unit) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (!state->unsharded_grad.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("AllocGrad: unit ", unit, " already has a gradient"));
  }
  const UnitLayout& layout = layouts_[unit];
  if (layout.grad_chunk_numel == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("AllocGrad: unit ", unit, " has no trainable parameters"));
  }
  const int64_t bytes =
      layout.grad_chunk_numel * layout.world * DTypeBytes(state->reduce);
  SHARDD_ASSIGN_OR_RETURN(state->unsharded_grad,
                          Alloc(allocator_, bytes, MemoryKind::kUnshardedGrads,
                                state->group->reduce_scatter_stream()));
  absl::Status status =
      CudaStatus(cudaMemsetAsync(state->unsharded_grad.data(), 0, bytes,
                                 state->group->reduce_scatter_stream()),
                 "zeroing the unsharded gradient");
  // The model adds into it on the compute stream.
  if (status.ok())
    status = StreamWaitStream(compute_stream_,
                              state->group->reduce_scatter_stream());
  if (!status.ok()) state->unsharded_grad.Reset();
  return status;
}

absl::Status DeviceShardStore::ReduceScatter(int unit) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (state->unsharded_grad.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ReduceScatter: unit ", unit, " has no gradient"));
  }
  const UnitLayout& layout = layouts_[unit];
  const bool reduce_bf16 = state->reduce == v1::BFLOAT16;
  const int64_t elem = DTypeBytes(state->reduce);
  char* base = state->unsharded_grad.as<char>();
  // Fold copied-out gradients into the buffer, where they were written.
  for (const ParamPlacement& param : layout.params) {
    DeviceBuffer& temp = state->grad_temps[param.index];
    if (temp.empty()) continue;
    const cudaStream_t stream = static_cast<cudaStream_t>(temp.stream());
    for (const CopySegment& s : param.grad) {
      SHARDD_RETURN_IF_ERROR(CudaStatus(
          device_kernels::LaunchAddInto(temp.as<float>() + s.src, false,
                                        base + s.dst * elem, reduce_bf16,
                                        s.count, stream),
          "folding a parameter gradient"));
    }
    SHARDD_RETURN_IF_ERROR(StreamWaitStream(compute_stream_, stream));
    temp.Reset();
  }
  const int64_t chunk = layout.grad_chunk_numel;
  char* out = base + state->group_rank * chunk * elem;
  const absl::Duration timeout = options_.collective_timeout;
  SHARDD_ASSIGN_OR_RETURN(NcclWork reduced,
                          state->group->ReduceScatterAsync(
                              base, out, chunk, state->reduce, ReduceOp::kAvg,
                              NcclWaitFor::Stream(compute_stream_), timeout));
  if (replicas_ != nullptr && replicas_->world_size() > 1) {
    SHARDD_ASSIGN_OR_RETURN(NcclWork averaged,
                            replicas_->AllReduceAsync(
                                out, chunk, state->reduce, ReduceOp::kAvg,
                                NcclWaitFor::Event(reduced.event()), timeout));
    SHARDD_RETURN_IF_ERROR(
        averaged.StreamWait(state->group->reduce_scatter_stream()));
  }
  // An expert-parallel block's gradient holds the rows of its ep ranks'
  // tokens: 1/ep more makes it the dp_shard average (as the host store).
  const float scale = 1.0f / static_cast<float>(state->ep);
  float* grads = state->grads.as<float>();
  for (const CopySegment& s : layout.shard_grad) {
    SHARDD_RETURN_IF_ERROR(
        CudaStatus(device_kernels::LaunchAddInto(
                       out + s.src * elem, reduce_bf16, grads + s.dst, false,
                       s.count, state->group->reduce_scatter_stream(), scale),
                   "accumulating the sharded gradient"));
  }
  // Home stream: everything that used the buffer is ordered before this.
  state->unsharded_grad.Reset();
  return absl::OkStatus();
}

absl::Status DeviceShardStore::WaitForGather(int unit, cudaStream_t stream) {
  SHARDD_ASSIGN_OR_RETURN(UnitState * state, Unit(unit));
  if (state->gathered.empty() || !state->gather.valid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("unit ", unit, " is not gathered"));
  }
  return state->gather.StreamWait(stream);
}

absl::Status DeviceShardStore::WaitForCollectives(cudaStream_t stream) {
  SHARDD_RETURN_IF_ERROR(StreamWaitStream(stream, reduce_stream_));
  SHARDD_RETURN_IF_ERROR(StreamWaitStream(stream, gather_stream_));
  if (ep_shard_ != nullptr) {
    SHARDD_RETURN_IF_ERROR(
        StreamWaitStream(stream, ep_shard_->reduce_scatter_stream()));
    SHARDD_RETURN_IF_ERROR(
        StreamWaitStream(stream, ep_shard_->all_gather_stream()));
  }
  for (const auto& [g, group] : slice_groups_) {
    SHARDD_RETURN_IF_ERROR(
        StreamWaitStream(stream, group->all_gather_stream()));
  }
  if (replicas_ != nullptr) {
    SHARDD_RETURN_IF_ERROR(
        StreamWaitStream(stream, replicas_->reduce_scatter_stream()));
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceTensor> DeviceShardStore::Param(const std::string& name,
                                                     void* stream) {
  SHARDD_ASSIGN_OR_RETURN(const ParamRef ref, Find(name));
  UnitState& state = units_[ref.unit];
  if (state.gathered.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "parameter '", name, "': unit ", ref.unit, " is not gathered"));
  }
  const cudaStream_t s = ToCuda(stream);
  if (state.gather.valid()) SHARDD_RETURN_IF_ERROR(state.gather.StreamWait(s));
  const ParamPlacement& param = layouts_[ref.unit].params[ref.index];
  const int64_t elem = DTypeBytes(state.compute);
  DeviceTensor tensor;
  tensor.dtype = state.compute == v1::BFLOAT16 ? DeviceDType::kBFloat16
                                               : DeviceDType::kFloat32;
  tensor.numel = param.numel;
  const char* gathered = state.gathered.as<const char>();
  if (IsContiguous(param.gathered, param.numel)) {
    tensor.data = gathered + param.gathered[0].src * elem;
    return tensor;
  }
  DeviceBuffer& copy = state.copies[param.index];
  if (copy.empty()) {
    SHARDD_ASSIGN_OR_RETURN(
        copy, Alloc(allocator_, param.numel * elem, MemoryKind::kWorkspace, s));
    for (const CopySegment& seg : param.gathered) {
      const absl::Status status = CudaStatus(
          cudaMemcpyAsync(copy.as<char>() + seg.dst * elem,
                          gathered + seg.src * elem, seg.count * elem,
                          cudaMemcpyDeviceToDevice, s),
          "copying out a parameter");
      if (!status.ok()) {
        copy.Reset();
        return status;
      }
    }
  } else if (s != static_cast<cudaStream_t>(copy.stream())) {
    SHARDD_RETURN_IF_ERROR(
        StreamWaitStream(s, static_cast<cudaStream_t>(copy.stream())));
  }
  tensor.data = copy.data();
  return tensor;
}

absl::StatusOr<float*> DeviceShardStore::Grad(const std::string& name,
                                              void* stream) {
  SHARDD_ASSIGN_OR_RETURN(const ParamRef ref, Find(name));
  const ParamPlacement& param = layouts_[ref.unit].params[ref.index];
  if (param.frozen) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter '", name, "' is frozen: it has no gradient"));
  }
  UnitState& state = units_[ref.unit];
  if (state.unsharded_grad.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter '", name, "': unit ", ref.unit,
                     " has no gradient buffer (ALLOC_GRAD missing)"));
  }
  const cudaStream_t s = ToCuda(stream);
  if (s != compute_stream_) {
    SHARDD_RETURN_IF_ERROR(
        StreamWaitStream(s, state.group->reduce_scatter_stream()));
  }
  if (state.reduce == v1::FLOAT32 && IsContiguous(param.grad, param.numel)) {
    return state.unsharded_grad.as<float>() + param.grad[0].dst;
  }
  DeviceBuffer& temp = state.grad_temps[param.index];
  if (temp.empty()) {
    SHARDD_ASSIGN_OR_RETURN(
        temp, Alloc(allocator_, param.numel * 4, MemoryKind::kWorkspace, s));
    const absl::Status status =
        CudaStatus(cudaMemsetAsync(temp.data(), 0, param.numel * 4, s),
                   "zeroing a parameter gradient");
    if (!status.ok()) {
      temp.Reset();
      return status;
    }
  }
  return temp.as<float>();
}

DeviceShardStore::UnitShard DeviceShardStore::shard(int unit) const {
  UnitShard out;
  if (unit < 0 || unit >= num_units()) return out;
  const UnitState& state = units_[unit];
  out.params = state.master.as<float>();
  out.grads = state.grads.as<float>();
  out.exp_avg = state.exp_avg.as<float>();
  out.exp_avg_sq = state.exp_avg_sq.as<float>();
  out.compute_bf16 = state.compute_shard.as<uint16_t>();
  out.numel = layouts_[unit].shard_numel;
  out.state_numel = state.state_numel;
  return out;
}

absl::Status DeviceShardStore::ZeroShardGrads() {
  for (int u = 0; u < num_units(); ++u) {
    const UnitState& state = units_[u];
    if (state.grads.empty()) continue;
    SHARDD_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(state.grads.data(), 0, state.grads.bytes(),
                                   compute_stream_),
                   "zeroing the sharded gradients"));
  }
  return absl::OkStatus();
}

void DeviceShardStore::ReleaseStepBuffers() {
  // Order every home stream after everything enqueued anywhere, so the
  // freed blocks are not reused under work still in flight.
  const absl::Status waited = WaitForCollectives(compute_stream_);
  if (!waited.ok()) {
    SHARDD_LOG(WARNING) << "releasing step buffers: " << waited.ToString();
  }
  StreamWaitStream(gather_stream_, compute_stream_).IgnoreError();
  StreamWaitStream(reduce_stream_, compute_stream_).IgnoreError();
  if (ep_shard_ != nullptr) {
    StreamWaitStream(ep_shard_->all_gather_stream(), compute_stream_)
        .IgnoreError();
    StreamWaitStream(ep_shard_->reduce_scatter_stream(), compute_stream_)
        .IgnoreError();
  }
  for (UnitState& state : units_) {
    for (DeviceBuffer& copy : state.copies) copy.Reset();
    for (DeviceBuffer& temp : state.grad_temps) temp.Reset();
    state.gathered.Reset();
    state.gather = NcclWork();
    state.slice.Reset();
    state.slice_group = 0;
    state.slice_consumed = false;
    state.unsharded_grad.Reset();
  }
}

ShardBuffers DeviceShardStore::buffers(int unit) const {
  const UnitShard shard = this->shard(unit);
  ShardBuffers out;
  out.params = shard.params;
  out.grads = shard.grads;
  out.exp_avg = shard.exp_avg;
  out.exp_avg_sq = shard.exp_avg_sq;
  out.numel = shard.numel;
  out.state_numel = shard.state_numel;
  return out;
}

absl::Status DeviceShardStore::CopyToHost(const float* from, int64_t n,
                                          float* to) const {
  if (n <= 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(compute_stream_),
                                    "waiting for the compute stream"));
  return CudaStatus(
      cudaMemcpy(to, from, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost),
      "copying shard state to the host");
}

absl::Status DeviceShardStore::CopyFromHost(const float* from, int64_t n,
                                            float* to) {
  if (n <= 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(to, from, static_cast<size_t>(n) * 4,
                                 cudaMemcpyHostToDevice, compute_stream_),
                 "copying shard state to the device"));
  // The host memory is the caller's: done with it before returning.
  return CudaStatus(cudaStreamSynchronize(compute_stream_),
                    "copying shard state to the device");
}

absl::Status DeviceShardStore::Synchronize() {
  return CudaStatus(cudaStreamSynchronize(compute_stream_),
                    "waiting for the compute stream");
}

absl::Status DeviceShardStore::ResetUnit(int unit) {
  if (unit < 0 || unit >= num_units()) {
    return absl::NotFoundError(
        absl::StrCat("unit ", unit, ": the plan has ", num_units(), " units"));
  }
  UnitState& state = units_[unit];
  const int64_t n = layouts_[unit].shard_numel;
  if (n == 0) return absl::OkStatus();
  if (!state.grads.empty()) {
    SHARDD_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(state.grads.data(), 0, state.grads.bytes(),
                                   compute_stream_),
                   "zeroing a restored unit's gradient"));
  }
  if (!state.compute_shard.empty()) {
    SHARDD_RETURN_IF_ERROR(kernels::cuda::CastFp32ToBf16(
        state.master.as<const float>(), state.compute_shard.as<uint16_t>(), n,
        compute_stream_));
  }
  return absl::OkStatus();
}

absl::Status DeviceShardStore::CopyOwnedParamSlice(const std::string& name,
                                                   float* out) const {
  SHARDD_ASSIGN_OR_RETURN(const ParamRef ref, Find(name));
  const UnitLayout& layout = layouts_[ref.unit];
  std::vector<float> master(static_cast<size_t>(layout.shard_numel));
  SHARDD_RETURN_IF_ERROR(CopyToHost(units_[ref.unit].master.as<const float>(),
                                    layout.shard_numel, master.data()));
  // The elements this rank owns, as the host store copies them.
  for (const OwnedRange& run : layout.params[ref.index].owned) {
    std::memcpy(out + run.begin, master.data() + run.shard_offset,
                static_cast<size_t>(run.end - run.begin) * sizeof(float));
  }
  return absl::OkStatus();
}

}  // namespace shardd
