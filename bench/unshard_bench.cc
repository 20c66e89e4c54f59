// ShardStore::Unshard + Reshard (copy-in, all-gather into the unit's
// gathered buffer, free to the BufferCache) against a raw
// GlooCommunicator::AllGather of the same bytes, W ranks as threads of this
// process over loopback Gloo.
//
// For every (world, gathered elements, dtype) the three variants run
// interleaved, kReps times each, between barriers:
//   unshard    ShardStore::Unshard(u) then Reshard(u) (the full path);
//   raw_inplace  AllGather in place into one preallocated output buffer
//              whose own slot already holds the data (no input copy at
//              all; the best case of a bare all-gather);
//   raw_oop    AllGather from a separate, persistent input buffer already in
//              the gather dtype into the same preallocated output: what an
//              all-gather from a sharded parameter costs (Gloo copies the
//              input into its slot), i.e. "a raw Gloo all-gather of the same
//              bytes" from a shard.
// With --no_mmap the process first sets glibc's malloc to one arena, no
// mmap'ed chunks and a 1 GiB trim threshold (mallopt).
// Times are rank 0's, from just after a barrier to the op's return; the
// table shows medians. GB/s = gathered bytes (the whole output buffer) / time.
//
// Run: bazel run -c opt //bench:unshard_bench [-- --no_mmap]

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bench/local_gloo_group.h"
#include "common/dtype.h"
#include "kernels/cpu/bf16.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/memory/memory_tracker.h"
#include "worker/shards/shard_store.h"

namespace shardd {
namespace {

constexpr int kReps = 15;
constexpr int64_t kCols = 1024;
constexpr absl::Duration kTimeout = absl::Seconds(60);

v1::ModuleSpec* AddChild(v1::ModuleSpec* m, const std::string& name,
                         v1::ModuleKind kind) {
  v1::ModuleSpec* c = m->add_children();
  c->set_name(name);
  c->set_kind(kind);
  return c;
}

// One decoder layer whose MLP holds `params` weights of [rows, kCols], so the
// layer's unit gathers params * rows * kCols elements.
v1::ModelSpec OneLayerModel(int64_t rows, int params) {
  v1::ModelSpec spec;
  spec.set_architecture("ShardMoEForCausalLM");
  spec.set_dtype(v1::FLOAT32);
  v1::ModuleSpec* root = spec.mutable_root();
  root->set_kind(v1::MODULE_MODEL);
  v1::ModuleSpec* model = AddChild(root, "model", v1::MODULE_GENERIC);
  v1::ModuleSpec* layers = AddChild(model, "layers", v1::MODULE_LAYER_LIST);
  v1::ModuleSpec* layer = AddChild(layers, "0", v1::MODULE_DECODER_LAYER);
  v1::ModuleSpec* mlp = AddChild(layer, "mlp", v1::MODULE_MLP);
  for (int p = 0; p < params; ++p) {
    v1::TensorSpec* t =
        AddChild(mlp, absl::StrCat("proj", p), v1::MODULE_GENERIC)
            ->add_params();
    t->set_name("weight");
    t->add_shape(rows);
    t->add_shape(kCols);
    t->set_dtype(v1::FLOAT32);
  }
  return spec;
}

double Seconds(std::chrono::steady_clock::time_point a,
               std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Row {
  int world;
  int64_t gathered;
  int params;
  bool mixed;
  bool keep = false;  // keep_compute_shard (bf16 copies beside the master).
  int64_t bytes = 0;
  double unshard = 0, warm = 0, oop = 0;  // Median seconds.
  double copy_in = 0;  // Median seconds of the copy-in alone.
};

bool RunCase(Row* row) {
  const int world = row->world;
  const int64_t rows = row->gathered / row->params / kCols;
  const v1::ModelSpec model = OneLayerModel(rows, row->params);
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(world);
  options.set_mixed_precision(row->mixed);
  options.set_keep_compute_shard(row->keep);
  absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(model, options);
  if (!plan.ok()) {
    std::fprintf(stderr, "plan: %s\n", plan.status().ToString().c_str());
    return false;
  }
  int unit = 0;
  for (int u = 0; u < plan->units_size(); ++u) {
    if (plan->units(u).gathered_numel() > plan->units(unit).gathered_numel()) {
      unit = u;
    }
  }
  const v1::FsdpUnit& fsdp = plan->units(unit);
  const v1::DType dtype = row->mixed ? v1::BFLOAT16 : v1::FLOAT32;
  const int64_t elem = DTypeBytes(dtype);
  const int64_t shard_numel = fsdp.shard_numel();
  row->gathered = fsdp.gathered_numel();
  row->bytes = row->gathered * elem;

  static int generation = 0;
  const std::string prefix = absl::StrCat("unshard-bench/", ++generation);
  std::vector<double> t_unshard, t_warm, t_oop, t_copy;
  const bool ok = RunOnLocalGlooGroup(
      world, prefix, kTimeout, [&](int r, GlooCommunicator* c) -> absl::Status {
        MemoryTracker tracker;
        ShardStoreOptions store_options;
        store_options.shard_rank = r;
        store_options.seed = 1;
        store_options.collective_timeout = kTimeout;
        auto shards = ShardStore::Create(*plan, model, store_options, &tracker);
        if (!shards.ok()) return shards.status();
        // The raw baseline's preallocated output, with this rank's slot
        // filled like Unshard's copy-in and every page touched once.
        std::vector<char> warm(static_cast<size_t>(row->bytes), 1);
        // raw_oop's input: this rank's shard in the gather dtype.
        std::vector<char> input(static_cast<size_t>(shard_numel * elem), 2);
        const size_t slot = static_cast<size_t>(r * shard_numel * elem);
        for (int rep = -1; rep < kReps; ++rep) {  // rep -1: warm-up.
          absl::Status s = c->Barrier(kTimeout);
          auto t0 = std::chrono::steady_clock::now();
          if (s.ok()) s = (*shards)->Unshard(unit, c);
          if (s.ok()) s = (*shards)->Reshard(unit);
          auto t1 = std::chrono::steady_clock::now();
          if (s.ok()) s = c->Barrier(kTimeout);
          auto t2 = std::chrono::steady_clock::now();
          if (s.ok()) {
            s = c->AllGather(warm.data() + slot, warm.data(), shard_numel,
                             dtype, kTimeout);
          }
          auto t3 = std::chrono::steady_clock::now();
          if (s.ok()) s = c->Barrier(kTimeout);
          auto t4 = std::chrono::steady_clock::now();
          if (s.ok()) {
            s = c->AllGather(input.data(), warm.data(), shard_numel, dtype,
                             kTimeout);
          }
          auto t5 = std::chrono::steady_clock::now();
          if (!s.ok()) return s;
          // Unshard's copy-in alone (rank 0 only, outside the collectives):
          // the master shard into this rank's slot of a warm buffer.
          double copy_seconds = 0;
          if (r == 0) {
            const float* master = (*shards)->shard(unit).params;
            auto c0 = std::chrono::steady_clock::now();
            if (row->keep) {
              std::memcpy(warm.data() + slot, input.data(),
                          static_cast<size_t>(shard_numel * elem));
            } else if (row->mixed) {
              kernels::Fp32ToBf16Array(
                  master, reinterpret_cast<uint16_t*>(warm.data() + slot),
                  shard_numel);
            } else {
              std::memcpy(warm.data() + slot, master,
                          static_cast<size_t>(shard_numel) * 4);
            }
            copy_seconds = Seconds(c0, std::chrono::steady_clock::now());
          }
          if (r == 0 && rep >= 0) {
            t_unshard.push_back(Seconds(t0, t1));
            t_warm.push_back(Seconds(t2, t3));
            t_oop.push_back(Seconds(t4, t5));
            t_copy.push_back(copy_seconds);
          }
        }
        return absl::OkStatus();
      });
  if (!ok) return false;
  row->unshard = Median(t_unshard);
  row->warm = Median(t_warm);
  row->oop = Median(t_oop);
  row->copy_in = Median(t_copy);
  return true;
}

}  // namespace
}  // namespace shardd

int main(int argc, char** argv) {
  using shardd::Row;
  const bool no_mmap = argc > 1 && std::strcmp(argv[1], "--no_mmap") == 0;
  if (no_mmap) {
    mallopt(M_ARENA_MAX, 1);
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  std::printf("malloc: %s\n\n",
              no_mmap ? "--no_mmap (freed buffers reused)" : "glibc defaults");
  std::printf(
      "| W | gathered elements | params | dtype | MB gathered | unshard GB/s "
      "| raw_inplace GB/s | raw_oop GB/s | unshard / raw_inplace | unshard / "
      "raw_oop | copy-in ms | unshard ms |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  for (int world : {2, 4}) {
    for (int64_t m : {1, 4, 16}) {
      for (int params : {1, 4}) {
        for (int mode : {0, 1, 2}) {
          const bool mixed = mode > 0;
          Row row{world, m << 20, params, mixed, /*keep=*/mode == 2};
          if (!shardd::RunCase(&row)) return 1;
          const double gb = static_cast<double>(row.bytes) / 1e9;
          std::printf(
              "| %d | %lldM | %d | %s | %.0f | %.2f | %.2f | %.2f | %.2f | "
              "%.2f | %.2f | %.2f |\n",
              world, static_cast<long long>(row.gathered >> 20), params,
              mode == 0 ? "fp32" : (mode == 1 ? "bf16" : "bf16 keep"),
              row.bytes / 1048576.0, gb / row.unshard, gb / row.warm,
              gb / row.oop, row.warm / row.unshard, row.oop / row.unshard,
              row.copy_in * 1e3, row.unshard * 1e3);
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}
