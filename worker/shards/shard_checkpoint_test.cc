#include "worker/shards/shard_checkpoint.h"

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_size.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/plan_index.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "layout/shard_ranges.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "program/step_program.h"
#include "testing/model_builder.h"
#include "testing/numerics.h"
#include "testing/shard_state.h"
#include "testing/staged_shard_state.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/step_executor.h"
#include "worker/memory/memory_tracker.h"
#include "worker/shards/shard_store.h"

namespace shardd {
namespace {

using ::shardd::testing_util::AddChild;
using ::shardd::testing_util::AddParam;
using ::testing::AllOf;
using ::testing::HasSubstr;

// The model of step_executor_test.cc: vocab 30 and hidden 16 pad dim 0 over
// 3 and 4 ranks, 4 experts pad over 3.
constexpr int64_t kVocab = 30, kDim = 16, kExperts = 4, kInter = 8, kMlp = 12,
                  kSeq = 8;
constexpr uint64_t kSeed = 7;
constexpr char kFrozen[] = "model.layers.0.moe.gate.weight";

// The shared tiny MoE (testing/model_builder.h) with a dense MLP of `mlp`
// units. `freeze` freezes layer 0's router (kFrozen).
v1::ModelSpec TinyMoe(bool freeze, int64_t mlp = kMlp) {
  testing_util::TinyMoeShape shape;
  shape.vocab = kVocab;
  shape.dim = kDim;
  shape.experts = kExperts;
  shape.inter = kInter;
  shape.mlp = mlp;
  shape.freeze_router0 = freeze;
  return testing_util::TinyMoeSpec(shape);
}

absl::StatusOr<v1::ShardingPlan> TryPlan(const v1::ModelSpec& model,
                                         const std::string& strategy,
                                         int dp_shard, int reshard_group = 0,
                                         const std::string& placement = "",
                                         int ep = 0) {
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.set_strategy(strategy);
  options.mutable_mesh()->set_dp_shard(dp_shard);
  options.mutable_mesh()->set_dp_replicate(1);
  options.mutable_mesh()->set_ep(ep);
  options.set_mixed_precision(false);  // fp32 end to end: tight comparisons.
  if (reshard_group > 0) {
    options.mutable_reshard_after_forward()->set_group_size(reshard_group);
  }
  // Several buckets per rank and parameters straddling ranks.
  options.set_bucket_elements(700);
  options.set_shard_placement(placement);
  return planner.Plan(model, options);
}

v1::ShardingPlan MakePlan(const v1::ModelSpec& model,
                          const std::string& strategy, int dp_shard) {
  absl::StatusOr<v1::ShardingPlan> plan = TryPlan(model, strategy, dp_shard);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardingPlan();
}

// A fresh checkpoint root under the test's temporary directory.
std::string NewRoot(const std::string& name) {
  static std::atomic<int> counter{0};
  const char* tmp = getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name, "-",
                      counter.fetch_add(1));
}

// ---- Store-level round trips (no training) ----------------------------------

// One rank's ShardStore of a plan, with its tracker.
struct RankStore {
  MemoryTracker tracker;
  std::unique_ptr<ShardStore> store;
};

std::vector<std::unique_ptr<RankStore>> MakeStores(const v1::ShardingPlan& plan,
                                                   const v1::ModelSpec& model) {
  std::vector<std::unique_ptr<RankStore>> stores;
  for (int r = 0; r < plan.mesh().dp_shard(); ++r) {
    auto rank = std::make_unique<RankStore>();
    ShardStoreOptions options;
    options.shard_rank = r;
    options.seed = kSeed;
    auto store = ShardStore::Create(plan, model, options, &rank->tracker);
    EXPECT_TRUE(store.ok()) << store.status();
    if (!store.ok()) return {};
    rank->store = *std::move(store);
    stores.push_back(std::move(rank));
  }
  return stores;
}

// A value for every (tensor kind, parameter, global element) that does not
// depend on the layout: 0 = master, 1 = exp_avg, 2 = exp_avg_sq.
float Pattern(int kind, const std::string& name, int64_t element, int salt) {
  const size_t h = std::hash<std::string>()(name) % 1000;
  return static_cast<float>(kind * 10000 + salt * 1000) +
         static_cast<float>(h) * 0.5f + static_cast<float>(element) * 1e-3f;
}

// Writes Pattern into every owned element of a rank's shards (moments of
// frozen parameters too: they must not be saved).
void FillPattern(const v1::ShardingPlan& plan, int shard_rank, int salt,
                 ShardStore* store) {
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    const ShardStore::UnitShard shard = store->shard(u);
    for (const v1::ParamLayout& param : unit.params()) {
      SHARDD_ASSERT_OK_AND_ASSIGN(
          const std::vector<checkpoint::OwnedRange> ranges,
          checkpoint::OwnedElementRanges(param, unit.shard_numel(),
                                         shard_rank));
      for (const checkpoint::OwnedRange& r : ranges) {
        for (int64_t e = r.begin; e < r.end; ++e) {
          const int64_t i = r.shard_offset + (e - r.begin);
          shard.params[i] = Pattern(0, param.name(), e, salt);
          shard.exp_avg[i] = Pattern(1, param.name(), e, salt);
          shard.exp_avg_sq[i] = Pattern(2, param.name(), e, salt);
        }
      }
    }
  }
}

// Every element of a rank's shards: owned elements hold Pattern (moments of
// frozen parameters 0), everything else (padding) exactly 0. Returns the
// number of mismatches (reporting the first few).
int CheckPattern(const v1::ShardingPlan& plan, int shard_rank, int salt,
                 const ShardStore& store) {
  int bad = 0;
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    const ShardStore::UnitShard shard = store.shard(u);
    std::vector<float> want[3];
    for (auto& w : want) w.assign(shard.numel, 0.0f);
    for (const v1::ParamLayout& param : unit.params()) {
      auto ranges =
          checkpoint::OwnedElementRanges(param, unit.shard_numel(), shard_rank);
      EXPECT_TRUE(ranges.ok()) << ranges.status();
      if (!ranges.ok()) return 1;
      for (const checkpoint::OwnedRange& r : *ranges) {
        for (int64_t e = r.begin; e < r.end; ++e) {
          const int64_t i = r.shard_offset + (e - r.begin);
          want[0][i] = Pattern(0, param.name(), e, salt);
          if (param.frozen()) continue;
          want[1][i] = Pattern(1, param.name(), e, salt);
          want[2][i] = Pattern(2, param.name(), e, salt);
        }
      }
    }
    const float* got[3] = {shard.params, shard.exp_avg, shard.exp_avg_sq};
    for (int k = 0; k < 3; ++k) {
      for (int64_t i = 0; i < shard.numel; ++i) {
        if (got[k][i] != want[k][i] && ++bad <= 5) {
          ADD_FAILURE() << "rank " << shard_rank << " unit " << unit.name()
                        << " tensor kind " << k << " element " << i << ": "
                        << got[k][i] << " vs " << want[k][i];
        }
      }
    }
  }
  return bad;
}

// Saves every rank's stores of `plan` as checkpoint `step` under `root`.
absl::StatusOr<std::string> SaveStores(
    const v1::ShardingPlan& plan,
    const std::vector<std::unique_ptr<RankStore>>& stores,
    const std::string& root, int64_t step) {
  SHARDD_ASSIGN_OR_RETURN(const std::string tmp,
                          checkpoint::BeginCheckpoint(root, step));
  std::vector<checkpoint::RankFile> files;
  for (size_t r = 0; r < stores.size(); ++r) {
    SHARDD_ASSIGN_OR_RETURN(
        checkpoint::RankFile file,
        SaveRankShards(plan, *stores[r]->store, tmp, static_cast<int>(r)));
    files.push_back(std::move(file));
  }
  SHARDD_ASSIGN_OR_RETURN(const checkpoint::CheckpointIndex index,
                          checkpoint::BuildIndex(plan, step, files));
  return checkpoint::CommitCheckpoint(root, tmp, index);
}

// Loads checkpoint `dir` into every rank of `plan` (each rank its own
// reader, as separate processes would): each holds step `step` and the
// pattern FillPattern wrote with `salt`, and every element is read once (3
// fp32 tensors per trainable parameter, one per frozen one).
void ExpectLoadsEveryRank(const v1::ModelSpec& model,
                          const v1::ShardingPlan& plan, const std::string& dir,
                          int salt, int64_t step) {
  auto targets = MakeStores(plan, model);
  ASSERT_EQ(targets.size(), static_cast<size_t>(plan.mesh().dp_shard()));
  int64_t read = 0;
  for (int r = 0; r < plan.mesh().dp_shard(); ++r) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<checkpoint::CheckpointReader> reader,
        checkpoint::CheckpointReader::Open(dir));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const int64_t loaded,
        LoadRankShards(plan, targets[r]->store.get(), reader.get(), r));
    EXPECT_EQ(loaded, step);
    EXPECT_EQ(CheckPattern(plan, r, salt, *targets[r]->store), 0)
        << "rank " << r;
    read += reader->data_bytes_read();
  }
  int64_t want_bytes = 0;
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      want_bytes += param.numel() * 4 * (param.frozen() ? 1 : 3);
    }
  }
  EXPECT_EQ(read, want_bytes);
}

TEST(ShardCheckpointTest, RoundTripsIntoEveryLayoutWithPaddingZero) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  const v1::ShardingPlan saved = MakePlan(model, "diffusion_gemma", 4);
  auto stores = MakeStores(saved, model);
  ASSERT_EQ(stores.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    FillPattern(saved, r, /*salt=*/1, stores[r]->store.get());
  }
  const std::string root = NewRoot("roundtrip");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string dir,
                              SaveStores(saved, stores, root, 5));

  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<checkpoint::CheckpointReader> ck,
                              checkpoint::CheckpointReader::Open(dir));
  SHARDD_ASSERT_OK(ck->VerifyAll());
  const checkpoint::CheckpointIndex& index = ck->index();
  EXPECT_EQ(index.step, 5);
  EXPECT_EQ(index.data_position, (std::map<std::string, int64_t>{{"step", 5}}));
  EXPECT_EQ(index.saved_by.strategy, saved.strategy());
  EXPECT_EQ(index.saved_by.world_size, 4);
  EXPECT_EQ(index.saved_by.mesh.at("dp_shard"), 4);
  EXPECT_EQ(index.files.size(), 4u);
  // Frozen parameters: the parameter, no optimizer state.
  ASSERT_NE(ck->FindTensor(kFrozen), nullptr);
  EXPECT_EQ(ck->FindTensor(absl::StrCat(kFrozen, checkpoint::kExpAvgSuffix)),
            nullptr);
  const checkpoint::TensorRecord* embed =
      ck->FindTensor("model.embed_tokens.weight/exp_avg_sq");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->dtype, "F32");
  EXPECT_EQ(embed->shape, (std::vector<int64_t>{kVocab, kDim}));

  struct Target {
    std::string strategy;
    int world;
  };
  for (const Target& t : std::vector<Target>{{"default", 2},
                                             {"default", 3},
                                             {"megatron_fsdp", 2},
                                             {"megatron_fsdp", 3},
                                             {"diffusion_gemma", 4},
                                             {"default", 1}}) {
    SCOPED_TRACE(absl::StrCat(t.strategy, " at ", t.world, " ranks"));
    ExpectLoadsEveryRank(model, MakePlan(model, t.strategy, t.world), dir,
                         /*salt=*/1, /*step=*/5);
  }
}

// A store outside host memory (a GPU store) saves and loads through one
// host copy of its state: the same files, the same loaded values.
TEST(ShardCheckpointTest, StateOutsideHostMemorySavesAndLoadsTheSame) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  const v1::ShardingPlan plan = MakePlan(model, "default", 2);
  auto stores = MakeStores(plan, model);
  ASSERT_EQ(stores.size(), 2u);
  const std::string root = NewRoot("staged");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string tmp,
                              checkpoint::BeginCheckpoint(root, 3));
  std::vector<checkpoint::RankFile> files;
  for (int r = 0; r < 2; ++r) {
    FillPattern(plan, r, /*salt=*/4, stores[r]->store.get());
    testing_util::StagedShardState device(stores[r]->store.get());
    SHARDD_ASSERT_OK_AND_ASSIGN(checkpoint::RankFile file,
                                SaveRankShards(plan, device, tmp, r));
    EXPECT_GT(device.copies_to_host(), 0);
    files.push_back(std::move(file));
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(const checkpoint::CheckpointIndex index,
                              checkpoint::BuildIndex(plan, 3, files));
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string dir,
                              checkpoint::CommitCheckpoint(root, tmp, index));
  // Loaded into device stores of another world, and into host stores.
  const v1::ShardingPlan other = MakePlan(model, "default", 3);
  auto targets = MakeStores(other, model);
  ASSERT_EQ(targets.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<checkpoint::CheckpointReader> reader,
        checkpoint::CheckpointReader::Open(dir));
    testing_util::StagedShardState device(targets[r]->store.get());
    SHARDD_ASSERT_OK_AND_ASSIGN(const int64_t step,
                                LoadRankShards(other, &device, reader.get(), r));
    EXPECT_EQ(step, 3);
    EXPECT_GT(device.copies_from_host(), 0);
    SHARDD_ASSERT_OK(device.Flush());
    EXPECT_EQ(CheckPattern(other, r, /*salt=*/4, *targets[r]->store), 0)
        << "rank " << r;
  }
  ExpectLoadsEveryRank(model, other, dir, /*salt=*/4, /*step=*/3);
}

// Stacked experts split by elements (4 experts on 3 ranks, the default
// placement) save global-shape tensors that load into dim-0 layouts, flat
// buckets and element splits of other worlds, each element read once.
// checkpoint::PlanCheckpointBytes against the files SaveRankShards
// writes: the data bytes exactly, the file within the header bound.
TEST(ShardCheckpointTest, ThePlansCheckpointSizeBoundsTheFiles) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  for (const auto& [strategy, world] :
       std::vector<std::pair<std::string, int>>{{"default", 1},
                                                {"default", 3},
                                                {"megatron_fsdp", 2},
                                                {"diffusion_gemma", 4}}) {
    SCOPED_TRACE(absl::StrCat(strategy, " at ", world, " ranks"));
    const v1::ShardingPlan plan = MakePlan(model, strategy, world);
    SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<checkpoint::CheckpointBytes>
                                    sizes,
                                checkpoint::PlanCheckpointBytes(plan));
    ASSERT_EQ(sizes.size(), static_cast<size_t>(world));
    auto stores = MakeStores(plan, model);
    const std::string root = NewRoot(absl::StrCat("size-", strategy, world));
    SHARDD_ASSERT_OK_AND_ASSIGN(const std::string tmp,
                                checkpoint::BeginCheckpoint(root, 1));
    int64_t data = 0;
    for (int r = 0; r < world; ++r) {
      SHARDD_ASSERT_OK_AND_ASSIGN(
          const checkpoint::RankFile file,
          SaveRankShards(plan, *stores[r]->store, tmp, r));
      int64_t rank_data = 0;
      for (const checkpoint::TensorChunk& c : file.chunks) {
        rank_data += (c.chunk.end - c.chunk.begin) * 4;
      }
      EXPECT_EQ(rank_data, sizes[r].params + sizes[r].optimizer) << r;
      EXPECT_LE(file.file.size_bytes, sizes[r].total()) << r;
      // The bound is a bound, not a guess: within 2 KiB + 300 bytes per
      // tensor entry of the file.
      EXPECT_GE(file.file.size_bytes + 2048 + 300 * int64_t(file.chunks.size()),
                sizes[r].total())
          << r;
      data += rank_data;
    }
    const checkpoint::CheckpointBytes sum =
        checkpoint::SumCheckpointBytes(sizes);
    EXPECT_EQ(sum.params + sum.optimizer, data);
    int64_t want = 0;
    for (const v1::FsdpUnit& unit : plan.units()) {
      for (const v1::ParamLayout& param : unit.params()) {
        want += param.numel() * 4 * (param.frozen() ? 1 : 3);
      }
    }
    EXPECT_EQ(data, want);
    EXPECT_LT(sum.without_optimizer(), sum.total());
  }
}

TEST(ShardCheckpointTest, ElementSplitExpertsReshardAcrossPlacements) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  const v1::ShardingPlan saved = MakePlan(model, "diffusion_gemma", 3);
  ASSERT_GT(ElementSplitParams(saved), 0);
  auto stores = MakeStores(saved, model);
  ASSERT_EQ(stores.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    FillPattern(saved, r, /*salt=*/7, stores[r]->store.get());
  }
  const std::string root = NewRoot("elements");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string dir,
                              SaveStores(saved, stores, root, 2));
  // The experts are saved with their global shape, in element-range
  // chunks.
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<checkpoint::CheckpointReader> ck,
                              checkpoint::CheckpointReader::Open(dir));
  SHARDD_ASSERT_OK(ck->VerifyAll());
  struct Target {
    std::string strategy;
    int world;
    std::string placement;
  };
  for (const Target& t : std::vector<Target>{{"diffusion_gemma", 3, "dim0"},
                                             {"default", 2, "dim0"},
                                             {"default", 8, "auto"},
                                             {"megatron_fsdp", 3, ""},
                                             {"default", 1, "auto"}}) {
    SCOPED_TRACE(
        absl::StrCat(t.strategy, " at ", t.world, " ranks, ", t.placement));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const v1::ShardingPlan plan,
        TryPlan(model, t.strategy, t.world, 0, t.placement));
    ExpectLoadsEveryRank(model, plan, dir, /*salt=*/7, /*step=*/2);
  }
}

// Expert parallelism (issue 31 item 4): checkpoints hold global tensors,
// so they reshard between EP layouts bit for bit: EP=4 -> EP=2 -> no EP
// (2 ranks) -> EP=4, each a save of what the previous one loaded, every
// element where the pattern put it (the 4 experts in blocks of 1 and 2,
// over 1 and 2 ranks).
TEST(ShardCheckpointTest, ReshardsBetweenExpertParallelLayouts) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  struct Layout {
    int world, ep;
  };
  const std::vector<Layout> chain = {{4, 4}, {4, 2}, {2, 0}, {4, 4}};
  std::string dir;
  for (size_t i = 0; i < chain.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("world ", chain[i].world, " ep ", chain[i].ep));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const v1::ShardingPlan plan,
        TryPlan(model, "default", chain[i].world, 0, "", chain[i].ep));
    EXPECT_EQ(plan.mesh().ep(), chain[i].ep > 1 ? chain[i].ep : 0);
    auto stores = MakeStores(plan, model);
    ASSERT_EQ(stores.size(), static_cast<size_t>(chain[i].world));
    if (i == 0) {
      for (int r = 0; r < chain[i].world; ++r) {
        FillPattern(plan, r, /*salt=*/3, stores[r]->store.get());
      }
    } else {
      ExpectLoadsEveryRank(model, plan, dir, /*salt=*/3,
                           /*step=*/static_cast<int64_t>(i));
      for (int r = 0; r < chain[i].world; ++r) {
        SHARDD_ASSERT_OK_AND_ASSIGN(
            std::unique_ptr<checkpoint::CheckpointReader> reader,
            checkpoint::CheckpointReader::Open(dir));
        SHARDD_ASSERT_OK(
            LoadRankShards(plan, stores[r]->store.get(), reader.get(), r)
                .status());
      }
    }
    SHARDD_ASSERT_OK_AND_ASSIGN(
        dir, SaveStores(plan, stores, NewRoot("ep-chain"),
                        static_cast<int64_t>(i + 1)));
  }
}

TEST(ShardCheckpointTest, BuildIndexRefusesAMissingRankFile) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  const v1::ShardingPlan plan = MakePlan(model, "default", 4);
  auto stores = MakeStores(plan, model);
  ASSERT_EQ(stores.size(), 4u);
  const std::string root = NewRoot("missing-rank");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string tmp,
                              checkpoint::BeginCheckpoint(root, 1));
  std::vector<checkpoint::RankFile> files;
  for (int r = 0; r < 3; ++r) {  // Rank 3's file left out.
    SHARDD_ASSERT_OK_AND_ASSIGN(
        checkpoint::RankFile file,
        SaveRankShards(plan, *stores[r]->store, tmp, r));
    files.push_back(std::move(file));
  }
  EXPECT_THAT(checkpoint::BuildIndex(plan, 1, files),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(checkpoint::BuildIndex(plan, -1, files),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step")));
  EXPECT_THAT(
      SaveRankShards(plan, *stores[0]->store, tmp, 4),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard_rank 4")));
}

TEST(ShardCheckpointTest, CorruptedFileIsDetectedAndThePreviousOneLoads) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  const v1::ShardingPlan plan = MakePlan(model, "diffusion_gemma", 2);
  auto stores = MakeStores(plan, model);
  ASSERT_EQ(stores.size(), 2u);
  const std::string root = NewRoot("corrupt");
  for (int step : {1, 2}) {
    for (int r = 0; r < 2; ++r) {
      FillPattern(plan, r, /*salt=*/step, stores[r]->store.get());
    }
    SHARDD_ASSERT_OK(SaveStores(plan, stores, root, step).status());
  }
  // Flip one byte in the middle of the newest checkpoint's rank-1 file.
  const std::string victim =
      absl::StrCat(root, "/", checkpoint::CheckpointDirName(2), "/",
                   checkpoint::RankFileName(1));
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good()) << victim;
    f.seekg(0, std::ios::end);
    const std::streamoff size = f.tellg();
    ASSERT_GT(size, 64);
    f.seekg(size - 40);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(size - 40);
    f.write(&c, 1);
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<checkpoint::CheckpointInfo> all,
                              checkpoint::ListCheckpoints(root));
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].step, 2);
  // The restore path: the newest checkpoint whose files verify.
  std::unique_ptr<checkpoint::CheckpointReader> chosen;
  for (const checkpoint::CheckpointInfo& info : all) {
    SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<checkpoint::CheckpointReader> r,
                                checkpoint::CheckpointReader::Open(info.path));
    const absl::Status verified = r->VerifyAll();
    if (info.step == 2) {
      EXPECT_THAT(verified, StatusIs(absl::StatusCode::kDataLoss,
                                     HasSubstr(checkpoint::RankFileName(1))));
    }
    if (verified.ok()) {
      chosen = std::move(r);
      break;
    }
  }
  ASSERT_NE(chosen, nullptr);
  EXPECT_EQ(chosen->index().step, 1);
  const v1::ShardingPlan target = MakePlan(model, "megatron_fsdp", 3);
  auto loaded = MakeStores(target, model);
  ASSERT_EQ(loaded.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const int64_t step,
        LoadRankShards(target, loaded[r]->store.get(), chosen.get(), r));
    EXPECT_EQ(step, 1);
    EXPECT_EQ(CheckPattern(target, r, /*salt=*/1, *loaded[r]->store), 0);
  }
}

TEST(ShardCheckpointTest, RefusesAnotherModelsShapesWithoutTouchingTheShards) {
  const v1::ModelSpec saved_model = TinyMoe(/*freeze=*/false, /*mlp=*/kMlp);
  const v1::ShardingPlan saved = MakePlan(saved_model, "default", 2);
  auto stores = MakeStores(saved, saved_model);
  ASSERT_EQ(stores.size(), 2u);
  const std::string root = NewRoot("shape");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string dir,
                              SaveStores(saved, stores, root, 3));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<checkpoint::CheckpointReader> ck,
                              checkpoint::CheckpointReader::Open(dir));

  const v1::ModelSpec other = TinyMoe(/*freeze=*/false, /*mlp=*/10);
  const v1::ShardingPlan plan = MakePlan(other, "megatron_fsdp", 2);
  auto targets = MakeStores(plan, other);
  ASSERT_EQ(targets.size(), 2u);
  const ShardStore::UnitShard before = targets[0]->store->shard(0);
  const std::vector<float> first(before.params, before.params + before.numel);
  EXPECT_THAT(LoadRankShards(plan, targets[0]->store.get(), ck.get(), 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model.layers.0.mlp.gate_proj.weight"),
                             HasSubstr("[12, 16]"), HasSubstr("[10, 16]"))));
  const ShardStore::UnitShard after = targets[0]->store->shard(0);
  EXPECT_EQ(std::vector<float>(after.params, after.params + after.numel),
            first);
  // Nothing was read.
  EXPECT_EQ(ck->data_bytes_read(), 0);
}

TEST(ShardCheckpointTest, TrainableParameterSavedFrozenNeedsItsOptimizerState) {
  const v1::ModelSpec frozen_model = TinyMoe(/*freeze=*/true);
  const v1::ShardingPlan saved = MakePlan(frozen_model, "default", 2);
  auto stores = MakeStores(saved, frozen_model);
  ASSERT_EQ(stores.size(), 2u);
  const std::string root = NewRoot("frozen");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string dir,
                              SaveStores(saved, stores, root, 2));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<checkpoint::CheckpointReader> ck,
                              checkpoint::CheckpointReader::Open(dir));
  const v1::ModelSpec trainable = TinyMoe(/*freeze=*/false);
  const v1::ShardingPlan plan = MakePlan(trainable, "default", 2);
  auto targets = MakeStores(plan, trainable);
  ASSERT_EQ(targets.size(), 2u);
  EXPECT_THAT(
      LoadRankShards(plan, targets[1]->store.get(), ck.get(), 1),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr(absl::StrCat(kFrozen, checkpoint::kExpAvgSuffix))));
  EXPECT_THAT(
      LoadRankShards(plan, targets[1]->store.get(), ck.get(), 2),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard_rank 2")));
  // The other way round is fine: a parameter frozen now ignores its state.
}

TEST(ShardCheckpointTest, AWorldTheStrategyCannotServeIsThePlannersError) {
  // Saved with FSDP2's reshard_after_forward to pairs at 4 ranks; the same
  // options cannot be planned at 3 ranks.
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  SHARDD_ASSERT_OK(TryPlan(model, "default", 4, /*reshard_group=*/2).status());
  EXPECT_THAT(TryPlan(model, "default", 3, /*reshard_group=*/2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("reshard_after_forward.group_size"),
                             HasSubstr("dp_shard (3)"))));
}

// ---- Executor level: train, save at 4 ranks, resume at 2 and 3 --------------

struct RankCtx {
  int shard_rank = 0;
  int data_rank = 0;
  Communicator* shard = nullptr;
  MemoryTracker* tracker = nullptr;
};

// Runs body(ctx) on one thread per rank of the plan's (dp_shard only) mesh,
// each with its own Gloo shard group over loopback.
template <typename Fn>
void RunWorld(const v1::ShardingPlan& plan, Fn body) {
  const int dp = plan.mesh().dp_shard();
  static std::atomic<int> generation{0};
  const std::string prefix =
      absl::StrCat("shard-checkpoint-test/", generation.fetch_add(1));
  InMemoryKeyValueClient kv;
  std::vector<std::thread> threads;
  for (int s = 0; s < dp; ++s) {
    threads.emplace_back([&, s] {
      KvGlooStore store(&kv, absl::Seconds(20));
      auto shard =
          GlooCommunicator::Create(&store, absl::StrCat(prefix, "/s"), s, dp,
                                   "127.0.0.1", absl::Seconds(20));
      ASSERT_TRUE(shard.ok()) << shard.status();
      MemoryTracker tracker;
      RankCtx ctx;
      ctx.shard_rank = s;
      ctx.data_rank = s;
      ctx.shard = shard->get();
      ctx.tracker = &tracker;
      body(ctx);
    });
  }
  for (std::thread& t : threads) t.join();
}

data::BatchSampler MakeSampler(const v1::ShardingPlan& plan,
                               int64_t global_batch) {
  data::DataSourceOptions source_options;
  source_options.model_vocab_size = kVocab;
  source_options.seed = kSeed;
  auto source = data::CreateDataSource(source_options);
  EXPECT_TRUE(source.ok()) << source.status();
  data::BatchSamplerOptions options;
  options.global_batch = global_batch;
  options.seq_len = kSeq;
  options.microbatches = plan.step().microbatches();
  options.ranks = plan.mesh().dp_shard();
  options.model_vocab_size = kVocab;
  auto sampler = data::BatchSampler::Create(*source, options);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  return *std::move(sampler);
}

StepExecutorOptions TrainOptions() {
  StepExecutorOptions options;
  options.seed = kSeed;
  options.collective_timeout = absl::Seconds(20);
  options.adamw.lr = 1e-2;
  options.adamw.weight_decay = 0.1;
  options.max_grad_norm = 0.05;  // Clips every step: the norm is global.
  return options;
}

using ::shardd::testing_util::BoundUse;
using ::shardd::testing_util::CollectOwnedState;
using ::shardd::testing_util::ExpectRelativelyNear;
using ::shardd::testing_util::ParamMap;
using ::shardd::testing_util::TrainingStateMaps;
using ::shardd::testing_util::WriteOwnedState;

struct PhaseRun {
  // Global (token-weighted) loss and gradient norm of each step run.
  std::vector<double> losses;
  std::vector<double> grad_norms;
  // The state reassembled from every rank's shards before the first step
  // (after a load), and after each step.
  TrainingStateMaps start;
  std::vector<TrainingStateMaps> after;
  const ParamMap& final() const { return after.back().params; }
};

// Runs steps [first, last) of `plan` on every rank. With `load_dir`, each
// rank first loads its shards from that checkpoint and restores the
// optimizer steps; with `save_tmp`, each rank saves its shards there at the
// end (into (*rank_files)[shard_rank]). With `restart` (a run from step 0),
// every step s > first starts from restart's state after step s - 1.
PhaseRun RunPhase(const v1::ModelSpec& model, const v1::ShardingPlan& plan,
                  int first, int last, int64_t global_batch,
                  const std::string& load_dir, const std::string& save_tmp,
                  std::vector<checkpoint::RankFile>* rank_files,
                  const PhaseRun* restart = nullptr,
                  const StepExecutorOptions& base = TrainOptions()) {
  const int dp = plan.mesh().dp_shard();
  absl::StatusOr<v1::StepProgram> compiled = CompileStepProgram(plan);
  EXPECT_TRUE(compiled.ok()) << compiled.status();
  const v1::StepProgram program = compiled.ok() ? *compiled : v1::StepProgram();
  const data::BatchSampler sampler = MakeSampler(plan, global_batch);
  PhaseRun run;
  run.losses.assign(last - first, 0.0);
  run.grad_norms.assign(last - first, 0.0);
  // Per data rank, summed in rank order after the run: adding as threads
  // finish would make the global loss depend on their timing in its last
  // bits.
  std::vector<std::vector<double>> rank_loss(
      dp, std::vector<double>(last - first, 0.0));
  std::vector<std::vector<double>> rank_tokens(
      dp, std::vector<double>(last - first, 0.0));
  if (rank_files != nullptr) rank_files->assign(dp, checkpoint::RankFile());
  run.after.resize(last - first);
  absl::Mutex mu;
  RunWorld(plan, [&](const RankCtx& ctx) {
    StepExecutorOptions options = base;
    options.shard_rank = ctx.shard_rank;
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<StepExecutor> executor,
        StepExecutor::Create(plan, model, options, ctx.shard, nullptr,
                             ctx.tracker));
    if (!load_dir.empty()) {
      SHARDD_ASSERT_OK_AND_ASSIGN(
          std::unique_ptr<checkpoint::CheckpointReader> reader,
          checkpoint::CheckpointReader::Open(load_dir));
      SHARDD_ASSERT_OK_AND_ASSIGN(
          const int64_t step, LoadRankShards(plan, executor->mutable_shards(),
                                             reader.get(), ctx.shard_rank));
      EXPECT_EQ(step, first);
      SHARDD_ASSERT_OK(executor->RestoreOptimizerSteps(step));
    }
    {
      absl::MutexLock lock(&mu);
      CollectOwnedState(plan, executor->shards(), &run.start);
    }
    for (int s = first; s < last; ++s) {
      if (restart != nullptr && s > first) {
        WriteOwnedState(plan, restart->after[s - 1],
                        executor->mutable_shards());
      }
      v1::StepProgram step_program = program;
      step_program.set_step(s);
      std::vector<data::MicroBatch> batches;
      for (int m = 0; m < sampler.options().microbatches; ++m) {
        SHARDD_ASSERT_OK_AND_ASSIGN(data::MicroBatch batch,
                                    sampler.Get(s, ctx.data_rank, m));
        batches.push_back(std::move(batch));
      }
      SHARDD_ASSERT_OK_AND_ASSIGN(const StepResult result,
                                  executor->Execute(step_program, batches));
      EXPECT_EQ(result.optimizer_steps, s + 1);
      absl::MutexLock lock(&mu);
      CollectOwnedState(plan, executor->shards(), &run.after[s - first]);
      rank_loss[ctx.data_rank][s - first] = result.loss * result.tokens;
      rank_tokens[ctx.data_rank][s - first] = result.tokens;
      if (ctx.shard_rank == 0) run.grad_norms[s - first] = result.grad_norm;
    }
    if (!save_tmp.empty()) {
      SHARDD_ASSERT_OK_AND_ASSIGN(
          checkpoint::RankFile file,
          SaveRankShards(plan, executor->shards(), save_tmp, ctx.shard_rank));
      absl::MutexLock lock(&mu);
      (*rank_files)[ctx.shard_rank] = std::move(file);
    }
  });
  for (size_t i = 0; i < run.losses.size(); ++i) {
    double tokens = 0.0;
    for (int r = 0; r < dp; ++r) {
      run.losses[i] += rank_loss[r][i];
      tokens += rank_tokens[r][i];
    }
    if (tokens > 0) run.losses[i] /= tokens;
  }
  return run;
}

TEST(ShardCheckpointTrainingTest, ResumingAtOtherWorldsAndStrategiesMatches) {
  constexpr int kSteps = 2;             // K before and K after the save.
  constexpr int64_t kGlobalBatch = 12;  // Divisible by 4, 3 and 2 ranks.
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  const v1::ShardingPlan original = MakePlan(model, "diffusion_gemma", 4);

  // The uninterrupted run: 2K steps at 4 ranks.
  const PhaseRun full =
      RunPhase(model, original, 0, 2 * kSteps, kGlobalBatch, "", "", nullptr);
  ASSERT_EQ(full.losses.size(), static_cast<size_t>(2 * kSteps));

  // K steps, then every rank saves; BuildIndex + commit.
  const std::string root = NewRoot("train");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string tmp,
                              checkpoint::BeginCheckpoint(root, kSteps));
  std::vector<checkpoint::RankFile> files;
  const PhaseRun before =
      RunPhase(model, original, 0, kSteps, kGlobalBatch, "", tmp, &files);
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(before.losses[s], full.losses[s]) << "step " << s;
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(const checkpoint::CheckpointIndex index,
                              checkpoint::BuildIndex(original, kSteps, files));
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string dir,
                              checkpoint::CommitCheckpoint(root, tmp, index));
  {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<checkpoint::CheckpointReader> reader,
        checkpoint::CheckpointReader::Open(dir));
    SHARDD_ASSERT_OK(reader->VerifyAll());
    EXPECT_EQ(reader->index().step, kSteps);
  }

  // Resuming must restore the saved state exactly (bitwise: the shards only
  // move), and each step after it must be the uninterrupted run's step
  // within fp32 rounding: another world size or strategy sums in another
  // order (testing/numerics.h). Steps after the first start from the
  // uninterrupted run's state, as in step_executor_test, since AdamW
  // amplifies last-bit differences where a gradient is near zero.
  const testing_util::StepTolerances tol = testing_util::MoeStepTolerances(
      model.dims(), kGlobalBatch * kSeq, /*world=*/4);
  const std::set<std::string> frozen = {kFrozen};
  struct Target {
    std::string strategy;
    int world;
  };
  for (const Target& t : std::vector<Target>{{"default", 2},
                                             {"default", 3},
                                             {"megatron_fsdp", 2},
                                             {"megatron_fsdp", 3},
                                             {"diffusion_gemma", 4}}) {
    SCOPED_TRACE(absl::StrCat(t.strategy, " at ", t.world, " ranks"));
    const v1::ShardingPlan plan = MakePlan(model, t.strategy, t.world);
    const PhaseRun resumed = RunPhase(model, plan, kSteps, 2 * kSteps,
                                      kGlobalBatch, dir, "", nullptr, &full);
    const TrainingStateMaps& saved = full.after[kSteps - 1];
    EXPECT_EQ(resumed.start.params, saved.params);
    EXPECT_EQ(resumed.start.exp_avg, saved.exp_avg);
    EXPECT_EQ(resumed.start.exp_avg_sq, saved.exp_avg_sq);
    BoundUse use;
    for (int i = 0; i < kSteps; ++i) {
      const int s = kSteps + i;
      SCOPED_TRACE(absl::StrCat("step ", s));
      use.loss = std::max(
          use.loss,
          ExpectRelativelyNear(resumed.losses[i], full.losses[s], tol.loss));
      use.grad_norm = std::max(
          use.grad_norm, ExpectRelativelyNear(resumed.grad_norms[i],
                                              full.grad_norms[s], tol.grad));
      testing_util::ExpectStepWithinRounding(
          frozen, TrainOptions().adamw, s, tol, full.after[s - 1].view(),
          full.after[s].view(), resumed.after[i].view(), &use);
    }
    std::printf(
        "[resume] diffusion_gemma@4 -> %-15s@%d: share of each bound used: "
        "%s\n",
        t.strategy.c_str(), t.world, use.ToString().c_str());
  }
}

// Muon keeps its momentum in exp_avg (exp_avg_sq stays zero), so its state
// saves and reshards like AdamW's: saved at 2 ranks, resumed at 2 (bitwise
// the uninterrupted run), 1 and 3 (the state bitwise, each step's loss
// within the fp32 rounding of another world's sums, from the same state).
TEST(ShardCheckpointTrainingTest, MuonStateResumesAtOtherWorlds) {
  constexpr int kSteps = 2;
  constexpr int64_t kGlobalBatch = 12;
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  const v1::ShardingPlan original = MakePlan(model, "default", 2);
  StepExecutorOptions muon = TrainOptions();
  muon.optimizer.name = kMuonOptimizer;
  const PhaseRun full = RunPhase(model, original, 0, 2 * kSteps, kGlobalBatch,
                                 "", "", nullptr, nullptr, muon);
  const std::string root = NewRoot("muon");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string tmp,
                              checkpoint::BeginCheckpoint(root, kSteps));
  std::vector<checkpoint::RankFile> files;
  RunPhase(model, original, 0, kSteps, kGlobalBatch, "", tmp, &files, nullptr,
           muon);
  SHARDD_ASSERT_OK_AND_ASSIGN(const checkpoint::CheckpointIndex index,
                              checkpoint::BuildIndex(original, kSteps, files));
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string dir,
                              checkpoint::CommitCheckpoint(root, tmp, index));
  const TrainingStateMaps& saved = full.after[kSteps - 1];
  // Muon's parameters: momentum saved, second moment zero.
  const std::string experts = "model.layers.1.moe.experts.down_projs";
  EXPECT_NE(saved.exp_avg.at(experts),
            std::vector<float>(saved.exp_avg.at(experts).size(), 0.0f));
  EXPECT_EQ(saved.exp_avg_sq.at(experts),
            std::vector<float>(saved.exp_avg_sq.at(experts).size(), 0.0f));

  const PhaseRun same = RunPhase(model, original, kSteps, 2 * kSteps,
                                 kGlobalBatch, dir, "", nullptr, nullptr, muon);
  EXPECT_EQ(same.final(), full.final());
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_EQ(same.losses[i], full.losses[kSteps + i]);
  }
  const testing_util::StepTolerances tol = testing_util::MoeStepTolerances(
      model.dims(), kGlobalBatch * kSeq, /*world=*/3);
  for (int world : {1, 3}) {
    SCOPED_TRACE(absl::StrCat("resumed at ", world, " ranks"));
    const v1::ShardingPlan plan = MakePlan(model, "default", world);
    const PhaseRun resumed =
        RunPhase(model, plan, kSteps, 2 * kSteps, kGlobalBatch, dir, "",
                 nullptr, &full, muon);
    EXPECT_EQ(resumed.start.params, saved.params);
    EXPECT_EQ(resumed.start.exp_avg, saved.exp_avg);
    EXPECT_EQ(resumed.start.exp_avg_sq, saved.exp_avg_sq);
    double used = 0;
    for (int i = 0; i < kSteps; ++i) {
      used = std::max(
          used, ExpectRelativelyNear(resumed.losses[i], full.losses[kSteps + i],
                                     tol.loss));
    }
    std::printf("[muon resume] default@2 -> default@%d: loss bound used %.3g\n",
                world, used);
  }
}

TEST(ShardCheckpointTrainingTest, OptimizerStepCountIsRestored) {
  // Loading without RestoreOptimizerSteps restarts AdamW's bias correction
  // and diverges from the uninterrupted run: the count is what keeps the
  // resumed run equal.
  constexpr int64_t kGlobalBatch = 4;
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  const v1::ShardingPlan plan = MakePlan(model, "default", 2);
  const std::string root = NewRoot("steps");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string tmp,
                              checkpoint::BeginCheckpoint(root, 1));
  std::vector<checkpoint::RankFile> files;
  RunPhase(model, plan, 0, 1, kGlobalBatch, "", tmp, &files);
  SHARDD_ASSERT_OK_AND_ASSIGN(const checkpoint::CheckpointIndex index,
                              checkpoint::BuildIndex(plan, 1, files));
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string dir,
                              checkpoint::CommitCheckpoint(root, tmp, index));
  const PhaseRun full =
      RunPhase(model, plan, 0, 2, kGlobalBatch, "", "", nullptr);
  const PhaseRun resumed =
      RunPhase(model, plan, 1, 2, kGlobalBatch, dir, "", nullptr);
  EXPECT_EQ(resumed.final(), full.final());  // Same layout: bitwise.

  // Without the restored count (step 1 again instead of 2).
  ParamMap restarted;
  RunWorld(plan, [&](const RankCtx& ctx) {
    StepExecutorOptions options = TrainOptions();
    options.shard_rank = ctx.shard_rank;
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<StepExecutor> executor,
        StepExecutor::Create(plan, model, options, ctx.shard, nullptr,
                             ctx.tracker));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<checkpoint::CheckpointReader> reader,
        checkpoint::CheckpointReader::Open(dir));
    SHARDD_ASSERT_OK(LoadRankShards(plan, executor->mutable_shards(),
                                    reader.get(), ctx.shard_rank)
                         .status());
    EXPECT_THAT(executor->RestoreOptimizerSteps(-1),
                StatusIs(absl::StatusCode::kInvalidArgument));
    SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                                CompileStepProgram(plan));
    const data::BatchSampler sampler = MakeSampler(plan, kGlobalBatch);
    v1::StepProgram step_program = program;
    step_program.set_step(1);
    SHARDD_ASSERT_OK_AND_ASSIGN(data::MicroBatch batch,
                                sampler.Get(1, ctx.data_rank, 0));
    SHARDD_ASSERT_OK_AND_ASSIGN(const StepResult result,
                                executor->Execute(step_program, {batch}));
    EXPECT_EQ(result.optimizer_steps, 1);
    if (ctx.shard_rank == 0) {
      for (const v1::FsdpUnit& unit : plan.units()) {
        for (const v1::ParamLayout& param : unit.params()) {
          std::vector<float>& values = restarted[param.name()];
          values.resize(param.numel(), 0.0f);
          SHARDD_EXPECT_OK(executor->shards().CopyOwnedParamSlice(
              param.name(), values.data()));
        }
      }
    }
  });
  // Rank 0's rows differ from the uninterrupted run's.
  int differing = 0;
  for (const auto& [name, values] : restarted) {
    const std::vector<float>& want = full.final().at(name);
    for (size_t i = 0; i < values.size(); ++i) {
      if (values[i] != 0.0f &&
          std::fabs(values[i] - want[i]) > 1e-5 * std::fabs(want[i]) + 1e-7) {
        ++differing;
      }
    }
  }
  EXPECT_GT(differing, 0);
}

}  // namespace
}  // namespace shardd
