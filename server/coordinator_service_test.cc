#include "server/coordinator_service.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/model_util.h"
#include "model/native_spec.h"
#include "planner/sharding_planner.h"
#include "program/step_program.h"
#include "planner/strategy_registry.h"
#include "server/jobs/worker_client.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::SizeIs;

constexpr int64_t kVocab = 16;
constexpr int64_t kHidden = 8;
constexpr int64_t kInter = 12;
constexpr int kLayers = 2;

v1::TensorSpec* AddParam(v1::ModuleSpec* module, const std::string& name,
                         std::vector<int64_t> shape) {
  v1::TensorSpec* tensor = module->add_params();
  tensor->set_name(name);
  for (int64_t d : shape) tensor->add_shape(d);
  tensor->set_dtype(v1::FLOAT32);
  return tensor;
}

v1::ModuleSpec* AddChild(v1::ModuleSpec* parent, const std::string& name,
                         v1::ModuleKind kind) {
  v1::ModuleSpec* child = parent->add_children();
  child->set_name(name);
  child->set_kind(kind);
  return child;
}

// A small dense decoder: embedding [V, D], per layer an MLP up [I, D] and
// down [D, I] and a norm [D], a final norm [D] and an untied head [V, D].
v1::ModelSpec TinySpec() {
  v1::ModelSpec spec;
  spec.set_architecture("TinyTestForCausalLM");
  spec.set_dtype(v1::FLOAT32);
  v1::ModuleSpec* root = spec.mutable_root();
  root->set_kind(v1::MODULE_MODEL);
  v1::ModuleSpec* model = AddChild(root, "model", v1::MODULE_GENERIC);
  AddParam(AddChild(model, "embed_tokens", v1::MODULE_EMBEDDING), "weight",
           {kVocab, kHidden});
  v1::ModuleSpec* layers = AddChild(model, "layers", v1::MODULE_LAYER_LIST);
  for (int i = 0; i < kLayers; ++i) {
    v1::ModuleSpec* layer =
        AddChild(layers, absl::StrCat(i), v1::MODULE_DECODER_LAYER);
    v1::ModuleSpec* mlp = AddChild(layer, "mlp", v1::MODULE_MLP);
    AddParam(mlp, "up", {kInter, kHidden});
    AddParam(mlp, "down", {kHidden, kInter});
    AddParam(AddChild(layer, "norm", v1::MODULE_NORM), "weight", {kHidden});
  }
  AddParam(AddChild(model, "norm", v1::MODULE_NORM), "weight", {kHidden});
  AddParam(AddChild(root, "lm_head", v1::MODULE_LM_HEAD), "weight",
           {kVocab, kHidden});
  return spec;
}

// Closed form of TinySpec's parameter count.
constexpr int64_t kTinyParams = kVocab * kHidden +
                                kLayers * (2 * kInter * kHidden + kHidden) +
                                kHidden + kVocab * kHidden;

v1::PlanOptions Options(int dp) {
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(dp);
  return options;
}

v1::SubmitModelRequest SpecRequest(const v1::ModelSpec& spec, int dp) {
  v1::SubmitModelRequest request;
  *request.mutable_spec() = spec;
  *request.mutable_options() = Options(dp);
  return request;
}

// A settable time source for CoordinatorServiceOptions::clock (the service
// reads it from its own threads too, hence the lock).
class TestClock {
 public:
  std::function<absl::Time()> Source() {
    return [this] {
      absl::MutexLock lock(&mu_);
      return now_;
    };
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

class CoordinatorServiceTest : public ::testing::Test {
 protected:
  CoordinatorServiceTest()
      : registry_(StrategyRegistry::CreateWithBuiltins()) {}

  std::unique_ptr<CoordinatorService> MakeService(
      CoordinatorServiceOptions options = {}) {
    return std::make_unique<CoordinatorService>(registry_.get(),
                                                std::move(options));
  }

  std::unique_ptr<StrategyRegistry> registry_;
};

TEST(ModelIdForTest, DeterministicAndSensitiveToSpecAndOptions) {
  const v1::ModelSpec spec = TinySpec();
  const std::string id = ModelIdFor(spec, Options(4));
  EXPECT_EQ(id, ModelIdFor(TinySpec(), Options(4)));
  ASSERT_THAT(id, SizeIs(2 + 16));
  EXPECT_TRUE(absl::StartsWith(id, "m-"));
  for (char c : id.substr(2)) {
    EXPECT_TRUE((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) << id;
  }
  EXPECT_NE(id, ModelIdFor(spec, Options(8)));
  v1::ModelSpec other = spec;
  other.mutable_root()->mutable_children(1)->mutable_params(0)->set_shape(0,
                                                                          17);
  EXPECT_NE(id, ModelIdFor(other, Options(4)));
}

TEST(ModelIdForTest, EmptyInputsHashToFnvOfTheLengthPrefix) {
  // Both messages serialize to nothing, so the hash covers only "0:".
  // FNV-1a 64 by hand: h = 0xcbf29ce484222325; for each byte: h ^= b;
  // h *= 0x100000001b3.
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char b : std::string("0:")) {
    h ^= b;
    h *= 0x100000001b3ULL;
  }
  char expected[32];
  snprintf(expected, sizeof(expected), "m-%016llx",
           static_cast<unsigned long long>(h));
  EXPECT_EQ(ModelIdFor(v1::ModelSpec(), v1::PlanOptions()), expected);
}

TEST_F(CoordinatorServiceTest, ListStrategiesHasRegistryAndArchitectures) {
  auto service = MakeService();
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ListStrategiesResponse response,
                              service->ListStrategies({}));
  std::vector<std::string> names;
  for (const auto& info : response.strategies()) names.push_back(info.name());
  EXPECT_THAT(names, ::testing::Contains("default"));
  EXPECT_THAT(names, ::testing::Contains("diffusion_gemma"));
  EXPECT_THAT(names, ::testing::IsSupersetOf({"deepseek_v4", "megatron_fsdp"}));
  EXPECT_THAT(response.supported_architectures(),
              ::testing::IsSupersetOf({"MixtralForCausalLM",
                                       "DiffusionGemmaForBlockDiffusion",
                                       "DeepseekV3ForCausalLM"}));
}

TEST_F(CoordinatorServiceTest, SubmitSpecStoresPlanAndSummary) {
  auto service = MakeService();
  const v1::ModelSpec spec = TinySpec();
  v1::SubmitModelRequest request = SpecRequest(spec, 4);
  request.set_name("tiny");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::SubmitModelResponse response,
                              service->SubmitModel(request));
  EXPECT_EQ(response.model_id(), ModelIdFor(spec, Options(4)));
  EXPECT_EQ(response.summary().total_params(), kTinyParams);
  EXPECT_EQ(response.plan().total_params(), kTinyParams);
  EXPECT_EQ(response.plan().model_id(), response.model_id());
  EXPECT_EQ(response.plan().world_size(), 4);
  // Default strategy: one unit per layer plus the root.
  EXPECT_EQ(response.plan().units_size(), kLayers + 1);

  // The stored plan is the planner's plan, stamped with the id.
  ShardingPlanner planner(registry_.get());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan direct,
                              planner.Plan(spec, Options(4)));
  direct.set_model_id(response.model_id());
  EXPECT_EQ(response.plan().SerializeAsString(), direct.SerializeAsString());

  v1::GetPlanRequest get;
  get.set_model_id(response.model_id());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::GetPlanResponse stored,
                              service->GetPlan(get));
  EXPECT_EQ(stored.plan().SerializeAsString(),
            response.plan().SerializeAsString());
  EXPECT_EQ(stored.summary().total_params(), kTinyParams);
}

// With a StateStore, models and plans outlive the service: a new service
// on the reopened store (a restarted coordinator) answers GetPlan and lists
// them in the same order, with the first submission's name.
TEST_F(CoordinatorServiceTest, StoredModelsSurviveARestart) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp",
                                        "/coordinator_state_", getpid(), ".db");
  std::string first_id;
  std::string second_plan;
  {
    SHARDD_ASSERT_OK_AND_ASSIGN(auto state, StateStore::Open(path));
    CoordinatorServiceOptions options;
    options.state = state.get();
    auto service = MakeService(options);
    v1::SubmitModelRequest a = SpecRequest(TinySpec(), 2);
    a.set_name("first");
    SHARDD_ASSERT_OK_AND_ASSIGN(auto ra, service->SubmitModel(a));
    first_id = ra.model_id();
    v1::SubmitModelRequest b = SpecRequest(TinySpec(), 4);
    b.set_name("second");
    SHARDD_ASSERT_OK_AND_ASSIGN(auto rb, service->SubmitModel(b));
    second_plan = rb.plan().SerializeAsString();
    EXPECT_THAT(state->List("models"), IsOkAndHolds(::testing::SizeIs(2)));
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(auto state, StateStore::Open(path));
  CoordinatorServiceOptions options;
  options.state = state.get();
  auto restarted = MakeService(options);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::GetStatusResponse status,
                              restarted->GetStatus(v1::GetStatusRequest()));
  ASSERT_EQ(status.models_size(), 2);
  EXPECT_EQ(status.models(0).model_id(), first_id);
  EXPECT_EQ(status.models(0).name(), "first");
  EXPECT_EQ(status.models(1).name(), "second");
  v1::GetPlanRequest get;
  get.set_model_id(status.models(1).model_id());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::GetPlanResponse plan,
                              restarted->GetPlan(get));
  EXPECT_EQ(plan.plan().SerializeAsString(), second_plan);
  EXPECT_EQ(plan.summary().total_params(), kTinyParams);
  // Submitting the same content again finds the stored entry.
  v1::SubmitModelRequest again = SpecRequest(TinySpec(), 2);
  again.set_name("renamed");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto ragain, restarted->SubmitModel(again));
  EXPECT_EQ(ragain.model_id(), first_id);
  EXPECT_THAT(state->List("models"), IsOkAndHolds(::testing::SizeIs(2)));
}

TEST_F(CoordinatorServiceTest, SameContentTwiceGivesSameIdAndOneEntry) {
  auto service = MakeService();
  v1::SubmitModelRequest first = SpecRequest(TinySpec(), 2);
  first.set_name("first");
  v1::SubmitModelRequest second = first;
  second.set_name("second");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto a, service->SubmitModel(first));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto b, service->SubmitModel(second));
  EXPECT_EQ(a.model_id(), b.model_id());
  SHARDD_ASSERT_OK_AND_ASSIGN(auto status, service->GetStatus({}));
  ASSERT_THAT(status.models(), SizeIs(1));
  EXPECT_EQ(status.models(0).name(), "first");

  SHARDD_ASSERT_OK_AND_ASSIGN(auto c,
                              service->SubmitModel(SpecRequest(TinySpec(), 4)));
  EXPECT_NE(c.model_id(), a.model_id());
}

TEST_F(CoordinatorServiceTest, NativeJsonAndSpecOfSameModelShareTheId) {
  auto service = MakeService();
  const v1::ModelSpec spec = TinySpec();
  v1::SubmitModelRequest native;
  native.set_native_spec_json(ModelSpecToNativeJson(spec));
  *native.mutable_options() = Options(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto from_json, service->SubmitModel(native));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto from_spec,
                              service->SubmitModel(SpecRequest(spec, 2)));
  EXPECT_EQ(from_json.model_id(), from_spec.model_id());
  EXPECT_EQ(from_json.summary().total_params(), kTinyParams);
}

TEST_F(CoordinatorServiceTest, MissingSourceIsInvalidArgument) {
  auto service = MakeService();
  v1::SubmitModelRequest request;
  *request.mutable_options() = Options(2);
  EXPECT_THAT(
      service->SubmitModel(request),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("source: one of hf_config_json, native_spec_json, "
                         "spec is required")));
}

TEST_F(CoordinatorServiceTest, BadInputIsInvalidArgumentNamingTheField) {
  auto service = MakeService();
  v1::SubmitModelRequest malformed;
  malformed.set_hf_config_json("{\"architectures\": [");
  EXPECT_THAT(service->SubmitModel(malformed),
              StatusIs(absl::StatusCode::kInvalidArgument, Not(IsEmpty())));

  v1::SubmitModelRequest unknown_arch;
  unknown_arch.set_hf_config_json(
      R"({"architectures": ["NoSuchModelForCausalLM"], "hidden_size": 8})");
  EXPECT_THAT(service->SubmitModel(unknown_arch),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MixtralForCausalLM")));

  EXPECT_THAT(
      service->SubmitModel(SpecRequest(TinySpec(), 0)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dp_shard")));

  v1::SubmitModelRequest bad_strategy = SpecRequest(TinySpec(), 2);
  bad_strategy.mutable_options()->set_strategy("no_such_strategy");
  EXPECT_THAT(
      service->SubmitModel(bad_strategy),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("strategy")));

  v1::ModelSpec negative = TinySpec();
  negative.mutable_root()->mutable_children(1)->mutable_params(0)->set_shape(
      0, -3);
  EXPECT_THAT(
      service->SubmitModel(SpecRequest(negative, 2)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lm_head")));

  // Nothing was stored by the failures.
  SHARDD_ASSERT_OK_AND_ASSIGN(auto status, service->GetStatus({}));
  EXPECT_THAT(status.models(), SizeIs(0));
}

TEST_F(CoordinatorServiceTest, OversizedModelIsResourceExhausted) {
  CoordinatorServiceOptions options;
  options.max_model_bytes = 64;
  auto service = MakeService(options);
  v1::SubmitModelRequest json;
  json.set_hf_config_json(std::string(65, ' '));
  EXPECT_THAT(service->SubmitModel(json),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("hf_config_json")));
  v1::SubmitModelRequest native;
  native.set_native_spec_json(std::string(65, ' '));
  EXPECT_THAT(service->SubmitModel(native),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("native_spec_json")));
  // TinySpec serializes to well over 64 bytes (names alone exceed it).
  EXPECT_THAT(
      service->SubmitModel(SpecRequest(TinySpec(), 2)),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("spec")));
}

TEST_F(CoordinatorServiceTest, ModelLimitIsResourceExhausted) {
  CoordinatorServiceOptions options;
  options.max_models = 2;
  auto service = MakeService(options);
  SHARDD_EXPECT_OK(service->SubmitModel(SpecRequest(TinySpec(), 1)));
  SHARDD_EXPECT_OK(service->SubmitModel(SpecRequest(TinySpec(), 2)));
  EXPECT_THAT(
      service->SubmitModel(SpecRequest(TinySpec(), 4)),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit is 2")));
  // A stored model can still be submitted again.
  SHARDD_EXPECT_OK(service->SubmitModel(SpecRequest(TinySpec(), 2)));
}

TEST_F(CoordinatorServiceTest, StoredBytesLimitIsResourceExhausted) {
  // Measure one stored entry, then leave room for exactly one.
  auto probe = MakeService();
  SHARDD_ASSERT_OK_AND_ASSIGN(auto first,
                              probe->SubmitModel(SpecRequest(TinySpec(), 1)));
  const size_t one = TinySpec().ByteSizeLong() + first.plan().ByteSizeLong();

  CoordinatorServiceOptions options;
  options.max_stored_bytes = one + 1;
  auto service = MakeService(options);
  SHARDD_EXPECT_OK(service->SubmitModel(SpecRequest(TinySpec(), 1)));
  EXPECT_THAT(service->SubmitModel(SpecRequest(TinySpec(), 2)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("bytes for stored models")));
}

TEST_F(CoordinatorServiceTest, GetPlanErrors) {
  auto service = MakeService();
  EXPECT_THAT(service->GetPlan({}), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("model_id")));
  v1::GetPlanRequest unknown;
  unknown.set_model_id("m-0000000000000000");
  EXPECT_THAT(
      service->GetPlan(unknown),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("m-0000000000000000")));

  SHARDD_ASSERT_OK_AND_ASSIGN(auto submitted,
                              service->SubmitModel(SpecRequest(TinySpec(), 2)));
  v1::GetPlanRequest options_without_replan;
  options_without_replan.set_model_id(submitted.model_id());
  *options_without_replan.mutable_options() = Options(4);
  EXPECT_THAT(
      service->GetPlan(options_without_replan),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("replan")));

  v1::GetPlanRequest bad_replan = options_without_replan;
  bad_replan.set_replan(true);
  bad_replan.mutable_options()->mutable_mesh()->set_dp_shard(-1);
  EXPECT_THAT(
      service->GetPlan(bad_replan),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dp_shard")));
}

TEST_F(CoordinatorServiceTest, ReplanDoesNotChangeTheStoredPlan) {
  auto service = MakeService();
  SHARDD_ASSERT_OK_AND_ASSIGN(auto submitted,
                              service->SubmitModel(SpecRequest(TinySpec(), 2)));
  v1::GetPlanRequest replan;
  replan.set_model_id(submitted.model_id());
  replan.set_replan(true);
  *replan.mutable_options() = Options(4);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto fresh, service->GetPlan(replan));
  EXPECT_EQ(fresh.plan().world_size(), 4);
  EXPECT_EQ(fresh.plan().model_id(), submitted.model_id());
  // Per-rank master shards shrink with more ranks: the layer units of
  // TinySpec have dim 0 of 12, 8 and 8 rows, all divisible by 2 and 4, so
  // each rank holds exactly 1/W of each layer in fp32.
  EXPECT_LT(fresh.plan().memory().sharded_param_bytes(),
            submitted.plan().memory().sharded_param_bytes());

  v1::GetPlanRequest get;
  get.set_model_id(submitted.model_id());
  SHARDD_ASSERT_OK_AND_ASSIGN(auto stored, service->GetPlan(get));
  EXPECT_EQ(stored.plan().world_size(), 2);
  EXPECT_EQ(stored.plan().SerializeAsString(),
            submitted.plan().SerializeAsString());
}

TEST_F(CoordinatorServiceTest, StatusListsModelsInOrderWithUptime) {
  TestClock clock;
  CoordinatorServiceOptions options;
  options.incarnation = 42;
  options.clock = clock.Source();
  auto service = MakeService(options);
  clock.Advance(absl::Milliseconds(1500));
  v1::SubmitModelRequest a = SpecRequest(TinySpec(), 4);
  a.set_name("a");
  v1::SubmitModelRequest b = SpecRequest(TinySpec(), 2);
  b.set_name("b");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto ra, service->SubmitModel(a));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto rb, service->SubmitModel(b));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto status, service->GetStatus({}));
  EXPECT_EQ(status.coordinator_incarnation(), 42u);
  EXPECT_EQ(status.uptime_ms(), 1500);
  EXPECT_THAT(status.workers(), SizeIs(0));
  ASSERT_THAT(status.models(), SizeIs(2));
  EXPECT_EQ(status.models(0).model_id(), ra.model_id());
  EXPECT_EQ(status.models(0).name(), "a");
  EXPECT_EQ(status.models(0).architecture(), "TinyTestForCausalLM");
  EXPECT_EQ(status.models(0).strategy(), "default");
  EXPECT_EQ(status.models(0).total_params(), kTinyParams);
  EXPECT_EQ(status.models(0).world_size(), 4);
  EXPECT_EQ(status.models(1).model_id(), rb.model_id());
  EXPECT_EQ(status.models(1).world_size(), 2);
}

TEST_F(CoordinatorServiceTest, RandomIncarnationIsNonZeroAndDiffers) {
  auto a = MakeService();
  auto b = MakeService();
  EXPECT_NE(a->incarnation(), 0u);
  EXPECT_NE(a->incarnation(), b->incarnation());
}

TEST_F(CoordinatorServiceTest, OnDemandCheckpointsNeedAJobAndADirectory) {
  auto service = MakeService();
  absl::StatusOr<v1::SaveCheckpointResponse> saved;
  service->SaveCheckpointAsync({}, [&](auto r) { saved = std::move(r); });
  EXPECT_THAT(
      saved, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));
  v1::SaveCheckpointRequest save;
  save.set_job_id("j-1");
  service->SaveCheckpointAsync(save, [&](auto r) { saved = std::move(r); });
  EXPECT_THAT(saved, StatusIs(absl::StatusCode::kFailedPrecondition,
                              HasSubstr("--checkpoint-dir")));
  absl::StatusOr<v1::LoadCheckpointResponse> loaded;
  service->LoadCheckpointAsync({}, [&](auto r) { loaded = std::move(r); });
  EXPECT_THAT(loaded, StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("job_id")));
  // ListCheckpoints works once a checkpoint directory is configured.
  EXPECT_THAT(service->ListCheckpoints({}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--checkpoint-dir")));
}

v1::RegisterWorkerRequest WorkerRequest(int port, uint64_t incarnation) {
  v1::RegisterWorkerRequest request;
  request.set_address(absl::StrCat("127.0.0.1:", port));
  request.set_incarnation(incarnation);
  request.set_device("cpu");
  request.set_hostname("h");
  request.set_requested_rank(-1);
  return request;
}

TEST_F(CoordinatorServiceTest, MembershipThroughTheServiceWithAFakeClock) {
  TestClock clock;
  CoordinatorServiceOptions options;
  options.incarnation = 7;
  options.max_workers = 2;
  options.heartbeat_timeout = absl::Seconds(3);
  options.clock = clock.Source();
  auto service = MakeService(options);
  EXPECT_THAT(service->CheckWorkersReady(2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("ranks 0-1 have not registered")));

  SHARDD_ASSERT_OK_AND_ASSIGN(auto r0,
                              service->RegisterWorker(WorkerRequest(5000, 11)));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto r1,
                              service->RegisterWorker(WorkerRequest(5001, 12)));
  EXPECT_EQ(r0.rank(), 0);
  EXPECT_EQ(r1.rank(), 1);
  EXPECT_EQ(r1.world_size(), 2);
  EXPECT_EQ(r1.coordinator_incarnation(), 7u);
  EXPECT_EQ(r1.heartbeat_interval_ms(), 1000);  // 3 s / 3.
  EXPECT_EQ(r1.membership_epoch(), 2u);
  EXPECT_THAT(service->RegisterWorker(WorkerRequest(5002, 13)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("2")));
  SHARDD_EXPECT_OK(service->CheckWorkersReady(2));

  clock.Advance(absl::Seconds(2));
  v1::HeartbeatRequest beat;
  beat.set_rank(0);
  beat.set_incarnation(11);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto hb, service->Heartbeat(beat));
  EXPECT_EQ(hb.coordinator_incarnation(), 7u);
  EXPECT_EQ(hb.membership_epoch(), 2u);
  clock.Advance(absl::Milliseconds(1500));  // Rank 1 silent for 3.5 s.

  SHARDD_ASSERT_OK_AND_ASSIGN(auto status, service->GetStatus({}));
  ASSERT_THAT(status.workers(), SizeIs(2));
  EXPECT_EQ(status.workers(0).rank(), 0);
  EXPECT_EQ(status.workers(0).address(), "127.0.0.1:5000");
  EXPECT_EQ(status.workers(0).device(), "cpu");
  EXPECT_TRUE(status.workers(0).alive());
  EXPECT_EQ(status.workers(0).last_heartbeat_ms_ago(), 1500);
  EXPECT_FALSE(status.workers(1).alive());
  EXPECT_EQ(status.workers(1).last_heartbeat_ms_ago(), 3500);
  EXPECT_THAT(service->CheckWorkersReady(2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::AllOf(HasSubstr("rank 1 is dead"),
                                        HasSubstr("127.0.0.1:5001"))));
  // The dead worker's heartbeat tells it to re-register.
  beat.set_rank(1);
  beat.set_incarnation(12);
  EXPECT_THAT(service->Heartbeat(beat),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("register")));
  beat.set_rank(5);
  EXPECT_THAT(service->Heartbeat(beat),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank 5")));
}

TEST_F(CoordinatorServiceTest, RelayedHeartbeatsCountAsTheirWorkersOwn) {
  TestClock clock;
  CoordinatorServiceOptions options;
  options.incarnation = 7;
  options.heartbeat_timeout = absl::Seconds(3);
  options.heartbeat_relay_group = 2;
  options.clock = clock.Source();
  auto service = MakeService(options);
  for (int i = 0; i < 3; ++i) {
    SHARDD_ASSERT_OK(
        service->RegisterWorker(WorkerRequest(5000 + i, 11 + i)).status());
  }
  // Rank 1's own beat names its relay, rank 0; rank 0's and 2's name none.
  v1::HeartbeatRequest beat;
  beat.set_rank(1);
  beat.set_incarnation(12);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::HeartbeatResponse hb,
                              service->Heartbeat(beat));
  EXPECT_EQ(hb.relay_rank(), 0);
  EXPECT_EQ(hb.relay_address(), "127.0.0.1:5000");
  beat.set_rank(2);
  beat.set_incarnation(13);
  SHARDD_ASSERT_OK_AND_ASSIGN(hb, service->Heartbeat(beat));
  EXPECT_TRUE(hb.relay_address().empty());

  // For 5 s only rank 0 calls, relaying rank 1's beats: rank 1 lives,
  // rank 2 (silent) dies.
  v1::HeartbeatRequest relay;
  relay.set_rank(0);
  relay.set_incarnation(11);
  v1::RelayedHeartbeat* relayed = relay.add_relayed();
  relayed->set_rank(1);
  relayed->set_incarnation(12);
  for (int t = 0; t < 5; ++t) {
    clock.Advance(absl::Seconds(1));
    SHARDD_ASSERT_OK_AND_ASSIGN(hb, service->Heartbeat(relay));
    EXPECT_EQ(hb.relayed_errors_size(), 0);
    EXPECT_TRUE(hb.relay_address().empty());
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(auto status, service->GetStatus({}));
  ASSERT_THAT(status.workers(), SizeIs(3));
  EXPECT_TRUE(status.workers(1).alive());
  EXPECT_EQ(status.workers(1).last_heartbeat_ms_ago(), 0);
  EXPECT_FALSE(status.workers(2).alive());

  // Refusals come back by rank, with the error the worker would have had;
  // the relay's own beat still succeeds.
  relayed = relay.add_relayed();
  relayed->set_rank(2);
  relayed->set_incarnation(13);
  relayed = relay.add_relayed();
  relayed->set_rank(9);
  relayed->set_incarnation(5);
  SHARDD_ASSERT_OK_AND_ASSIGN(hb, service->Heartbeat(relay));
  ASSERT_EQ(hb.relayed_errors_size(), 2);
  EXPECT_EQ(hb.relayed_errors(0).rank(), 2);
  EXPECT_EQ(hb.relayed_errors(0).code(),
            static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_THAT(hb.relayed_errors(0).message(), HasSubstr("declared dead"));
  EXPECT_EQ(hb.relayed_errors(1).rank(), 9);
  EXPECT_EQ(hb.relayed_errors(1).code(),
            static_cast<int>(absl::StatusCode::kNotFound));

  // A relay that is not registered relays nothing.
  relay.set_rank(7);
  EXPECT_THAT(service->Heartbeat(relay), StatusIs(absl::StatusCode::kNotFound));
  // A bounded number per call.
  relay.set_rank(0);
  for (int i = 0; i <= CoordinatorService::kMaxRelayedHeartbeats; ++i) {
    relay.add_relayed()->set_rank(1);
  }
  EXPECT_THAT(service->Heartbeat(relay),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("relayed: at most")));
}

TEST_F(CoordinatorServiceTest, KeyValueRpcs) {
  auto service = MakeService();
  v1::PutRequest put;
  put.set_key("gloo/0");
  put.set_value("addr0");
  SHARDD_ASSERT_OK(service->Put(put).status());
  EXPECT_THAT(service->Put(put),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("gloo/0")));
  put.set_overwrite(true);
  put.set_value("addr0b");
  SHARDD_ASSERT_OK(service->Put(put).status());

  v1::GetRequest get;
  get.set_key("gloo/0");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto got, service->Get(get));
  EXPECT_EQ(got.value(), "addr0b");
  get.set_key("gloo/1");
  EXPECT_THAT(service->Get(get),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("gloo/1")));
  get.set_wait_ms(30);
  EXPECT_THAT(service->Get(get), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                          HasSubstr("gloo/1")));

  // An asynchronous Get completes when the key is Put.
  absl::Notification done;
  absl::StatusOr<v1::GetResponse> async_result;
  get.set_wait_ms(10000);
  service->GetAsync(get, [&](absl::StatusOr<v1::GetResponse> r) {
    async_result = std::move(r);
    done.Notify();
  });
  EXPECT_FALSE(done.HasBeenNotified());
  put.set_key("gloo/1");
  put.set_value("addr1");
  SHARDD_ASSERT_OK(service->Put(put).status());
  ASSERT_TRUE(done.HasBeenNotified());  // Completed on the Put's thread.
  ASSERT_THAT(async_result, IsOk());
  EXPECT_EQ(async_result->value(), "addr1");

  v1::DeleteRequest del;
  del.set_key("gloo/");
  del.set_prefix(true);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto deleted, service->Delete(del));
  EXPECT_EQ(deleted.deleted(), 2);
}

TEST_F(CoordinatorServiceTest, BarrierRpc) {
  auto service = MakeService();
  v1::BarrierRequest request;
  request.set_barrier_id("init");
  request.set_participants(2);
  request.set_caller("rank0");
  request.set_timeout_ms(-1);
  EXPECT_THAT(
      service->Barrier(request),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout_ms")));
  request.set_timeout_ms(10000);
  absl::Notification done;
  absl::StatusOr<v1::BarrierResponse> first;
  EXPECT_NE(service->BarrierAsync(request,
                                  [&](absl::StatusOr<v1::BarrierResponse> r) {
                                    first = std::move(r);
                                    done.Notify();
                                  }),
            0u);
  request.set_caller("rank1");
  SHARDD_EXPECT_OK(service->Barrier(request).status());
  ASSERT_TRUE(done.HasBeenNotified());
  SHARDD_EXPECT_OK(first.status());
  request.set_timeout_ms(20);
  EXPECT_THAT(
      service->Barrier(request),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("1 of 2")));
}

TEST_F(CoordinatorServiceTest, ConcurrentSubmissionsStoreEachModelOnce) {
  auto service = MakeService();
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::vector<std::string> ids(kThreads);
  std::vector<absl::Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Two distinct models (dp 1 and dp 2), each submitted 4 times.
      auto response = service->SubmitModel(SpecRequest(TinySpec(), 1 + t % 2));
      results[t] = response.status();
      if (response.ok()) ids[t] = response->model_id();
    });
  }
  for (auto& thread : threads) thread.join();
  for (const auto& status : results) SHARDD_EXPECT_OK(status);
  for (int t = 2; t < kThreads; ++t) EXPECT_EQ(ids[t], ids[t % 2]);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto status, service->GetStatus({}));
  EXPECT_THAT(status.models(), SizeIs(2));
}

// ---------------------------------------------------------------------------
// Training jobs through the service, with in-memory workers.

// Records what the coordinator sends; every step succeeds with loss 2.5 on
// 64 tokens per rank.
class RecordingWorkers {
 public:
  class Client final : public WorkerClient {
   public:
    Client(RecordingWorkers* owner, std::string address)
        : owner_(owner), address_(std::move(address)) {}
    const std::string& address() const override { return address_; }
    absl::StatusOr<v1::LoadPlanResponse> LoadPlan(
        const v1::LoadPlanRequest& request,
        const WorkerCallOptions& /*options*/) override {
      absl::MutexLock lock(&owner_->mu_);
      owner_->loads_.push_back(request);
      return v1::LoadPlanResponse();
    }
    absl::StatusOr<v1::ExecuteResponse> Execute(
        const v1::ExecuteRequest& request,
        const WorkerCallOptions& /*options*/) override {
      absl::MutexLock lock(&owner_->mu_);
      owner_->programs_.push_back(request.program());
      v1::ExecuteResponse response;
      response.set_loss(2.5);
      response.set_tokens(64);
      return response;
    }
    absl::StatusOr<v1::ExecuteResponse> RunCommand(
        const v1::RunCommandRequest& /*request*/,
        const WorkerCallOptions& /*options*/) override {
      return absl::UnimplementedError("not used");
    }
    absl::StatusOr<v1::GetStatsResponse> GetStats(
        const WorkerCallOptions& /*options*/) override {
      return v1::GetStatsResponse();
    }

   private:
    RecordingWorkers* const owner_;
    const std::string address_;
  };

  WorkerClientFactory Factory() {
    return [this](const std::string& address)
               -> absl::StatusOr<std::unique_ptr<WorkerClient>> {
      return std::make_unique<Client>(this, address);
    };
  }
  std::vector<v1::LoadPlanRequest> loads() {
    absl::MutexLock lock(&mu_);
    return loads_;
  }
  std::vector<v1::StepProgram> programs() {
    absl::MutexLock lock(&mu_);
    return programs_;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::LoadPlanRequest> loads_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::StepProgram> programs_ ABSL_GUARDED_BY(mu_);
};

v1::SubmitStepRequest StepRequest(const std::string& model_id) {
  v1::SubmitStepRequest request;
  request.set_model_id(model_id);
  v1::TrainConfig* config = request.mutable_config();
  config->set_steps(3);
  config->set_global_batch(8);
  config->set_seq_len(4);
  return request;
}

// Waits (bounded) for a job's log to end and returns its events.
std::vector<v1::StepEvent> EventsAfterEnd(CoordinatorService* service,
                                          const std::string& job_id) {
  v1::WatchStepRequest watch;
  watch.set_job_id(job_id);
  absl::StatusOr<StepWatch> log = service->WatchStep(watch);
  EXPECT_THAT(log, IsOk());
  if (!log.ok()) return {};
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (!log->log->ended() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_TRUE(log->log->ended());
  return log->log->Snapshot();
}

TEST_F(CoordinatorServiceTest, SubmitStepChecksItsInput) {
  RecordingWorkers workers;
  CoordinatorServiceOptions options;
  options.worker_clients = workers.Factory();
  auto service = MakeService(options);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto model,
                              service->SubmitModel(SpecRequest(TinySpec(), 1)));
  SHARDD_ASSERT_OK(service->RegisterWorker(WorkerRequest(5000, 1)).status());
  auto invalid = [&](const v1::SubmitStepRequest& request,
                     const std::string& field) {
    EXPECT_THAT(service->SubmitStep(request),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field)))
        << field;
  };
  invalid(StepRequest(""), "model_id");
  auto with = [&](auto mutate) {
    v1::SubmitStepRequest request = StepRequest(model.model_id());
    mutate(request.mutable_config());
    return request;
  };
  invalid(with([](v1::TrainConfig* c) { c->set_steps(0); }), "config.steps");
  invalid(with([](v1::TrainConfig* c) { c->set_global_batch(0); }),
          "config.global_batch");
  invalid(with([](v1::TrainConfig* c) { c->set_seq_len(-1); }),
          "config.seq_len");
  invalid(with([](v1::TrainConfig* c) { c->set_microbatches(-2); }),
          "config.microbatches");
  invalid(with([](v1::TrainConfig* c) { c->set_lr(-0.1); }), "config.lr");
  invalid(with([](v1::TrainConfig* c) { c->set_beta1(1.0); }), "config.beta1");
  invalid(with([](v1::TrainConfig* c) { c->set_grad_clip(std::nan("")); }),
          "config.grad_clip");
  invalid(with([](v1::TrainConfig* c) { c->set_eps(-1e-9); }), "config.eps");
  // Evaluation needs its data; its counts are ranged.
  invalid(with([](v1::TrainConfig* c) { c->set_eval_every(5); }),
          "config.eval_data_path: required with eval_every (5)");
  invalid(with([](v1::TrainConfig* c) { c->set_eval_batches(2); }),
          "config.eval_data_path");
  invalid(with([](v1::TrainConfig* c) {
            c->set_eval_data_path("/data/held-out.bin");
            c->set_eval_every(-1);
          }),
          "config.eval_every");
  invalid(with([](v1::TrainConfig* c) {
            c->set_eval_data_path("/data/held-out.bin");
            c->set_eval_batches(-3);
          }),
          "config.eval_batches");
  // 8 sequences cannot be split into 3 micro-batches of whole rows.
  invalid(with([](v1::TrainConfig* c) { c->set_microbatches(3); }),
          "divisible");
  invalid(with([](v1::TrainConfig* c) { c->set_optimizer("sgd"); }),
          "config.optimizer: must be one of adamw, muon");
  invalid(with([](v1::TrainConfig* c) { c->set_muon_lr(-1); }),
          "config.muon_lr");
  invalid(with([](v1::TrainConfig* c) { c->set_muon_momentum(1); }),
          "config.muon_momentum");
  invalid(with([](v1::TrainConfig* c) { c->set_muon_ns_steps(101); }),
          "config.muon_ns_steps");
  // Muon needs whole matrices: megatron_fsdp's flat ranges are refused,
  // naming both.
  v1::SubmitModelRequest flat = SpecRequest(TinySpec(), 1);
  flat.mutable_options()->set_strategy("megatron_fsdp");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto flat_model, service->SubmitModel(flat));
  v1::SubmitStepRequest muon_flat = StepRequest(flat_model.model_id());
  muon_flat.mutable_config()->set_optimizer("muon");
  EXPECT_THAT(service->SubmitStep(muon_flat),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("optimizer muon cannot run with strategy "
                                 "megatron_fsdp")));
  EXPECT_THAT(service->SubmitStep(StepRequest("m-0000000000000000")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("m-0000")));

  auto no_transport = MakeService();
  SHARDD_ASSERT_OK(no_transport->SubmitModel(SpecRequest(TinySpec(), 1)));
  EXPECT_THAT(
      no_transport->SubmitStep(StepRequest(model.model_id())),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("transport")));
  EXPECT_TRUE(workers.loads().empty());
}

// An expert-parallel model is planned with its ep mesh and its job goes to
// the workers like any other (here: none registered yet).
TEST_F(CoordinatorServiceTest, ExpertParallelModelsPlanAndTrain) {
  RecordingWorkers workers;
  CoordinatorServiceOptions options;
  options.worker_clients = workers.Factory();
  auto service = MakeService(options);
  v1::ModelSpec spec = TinySpec();
  v1::ModuleSpec* layers =
      spec.mutable_root()->mutable_children(0)->mutable_children(1);
  for (v1::ModuleSpec& layer : *layers->mutable_children()) {
    v1::ModuleSpec* experts =
        AddChild(&layer, "experts", v1::MODULE_GROUPED_EXPERTS);
    AddParam(experts, "gate_and_up_projs", {4, kHidden, 2 * kInter});
    AddParam(experts, "down_projs", {4, kInter, kHidden});
  }
  v1::SubmitModelRequest request = SpecRequest(spec, 2);
  request.mutable_options()->mutable_mesh()->set_ep(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto model, service->SubmitModel(request));
  EXPECT_EQ(model.plan().mesh().ep(), 2);
  int expert_units = 0;
  for (const v1::FsdpUnit& unit : model.plan().units()) {
    if (unit.ep() == 2) ++expert_units;
  }
  EXPECT_EQ(expert_units, kLayers);
  EXPECT_THAT(service->SubmitStep(StepRequest(model.model_id())),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("have not registered")));
  EXPECT_TRUE(workers.loads().empty());
}

TEST_F(CoordinatorServiceTest, SubmitStepNeedsLiveWorkersForThePlansWorld) {
  RecordingWorkers workers;
  CoordinatorServiceOptions options;
  options.worker_clients = workers.Factory();
  auto service = MakeService(options);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto model,
                              service->SubmitModel(SpecRequest(TinySpec(), 2)));
  EXPECT_THAT(service->SubmitStep(StepRequest(model.model_id())),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("ranks 0-1 have not registered")));
  SHARDD_ASSERT_OK(service->RegisterWorker(WorkerRequest(5000, 1)).status());
  EXPECT_THAT(service->SubmitStep(StepRequest(model.model_id())),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("rank 1 has not registered")));
  EXPECT_TRUE(workers.loads().empty());
}

// GPU workers keep other activations than CPU workers: the job's plan
// counts those of the device its ranks registered with.
TEST_F(CoordinatorServiceTest, SubmitStepPlansForTheWorkersDevice) {
  for (const char* device : {"cpu", "cuda:0"}) {
    RecordingWorkers workers;
    CoordinatorServiceOptions options;
    options.worker_clients = workers.Factory();
    auto service = MakeService(options);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        auto model, service->SubmitModel(SpecRequest(TinySpec(), 2)));
    for (int r = 0; r < 2; ++r) {
      v1::RegisterWorkerRequest worker = WorkerRequest(5000 + r, r + 1);
      worker.set_device(device);
      SHARDD_ASSERT_OK(service->RegisterWorker(worker).status());
    }
    SHARDD_ASSERT_OK_AND_ASSIGN(
        v1::SubmitStepResponse submitted,
        service->SubmitStep(StepRequest(model.model_id())));
    EventsAfterEnd(service.get(), submitted.job_id());
    const std::vector<v1::LoadPlanRequest> loads = workers.loads();
    ASSERT_EQ(loads.size(), 2u) << device;
    const v1::WorkerDevice want = std::string(device) == "cpu"
                                      ? v1::WORKER_DEVICE_CPU
                                      : v1::WORKER_DEVICE_CUDA;
    for (const v1::LoadPlanRequest& load : loads) {
      EXPECT_EQ(load.plan_options().worker_device(), want) << device;
    }
  }
}

TEST_F(CoordinatorServiceTest, SubmitStepPlansForTheStepShapeAndRunsTheJob) {
  RecordingWorkers workers;
  CoordinatorServiceOptions options;
  options.worker_clients = workers.Factory();
  auto service = MakeService(options);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto model,
                              service->SubmitModel(SpecRequest(TinySpec(), 2)));
  ASSERT_EQ(model.plan().step().microbatches(), 1);
  SHARDD_ASSERT_OK(service->RegisterWorker(WorkerRequest(5000, 1)).status());
  SHARDD_ASSERT_OK(service->RegisterWorker(WorkerRequest(5001, 2)).status());

  v1::SubmitStepRequest request = StepRequest(model.model_id());
  request.mutable_config()->set_microbatches(2);
  request.mutable_config()->set_defer_grad_sync(true);
  request.mutable_config()->set_weight_decay(0.05);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::SubmitStepResponse submitted,
                              service->SubmitStep(request));
  EXPECT_EQ(submitted.job_id(), "j-1");
  EXPECT_EQ(submitted.world_size(), 2);
  const std::vector<v1::StepEvent> events =
      EventsAfterEnd(service.get(), submitted.job_id());
  ASSERT_EQ(events.size(), 3u);
  EXPECT_TRUE(events.back().done());
  EXPECT_DOUBLE_EQ(events.back().loss(), 2.5);
  EXPECT_EQ(events.back().tokens(), 128);

  // The workers got the plan for the job's step shape, the config, and the
  // program compiled from that plan.
  v1::GetPlanRequest replan;
  replan.set_model_id(model.model_id());
  replan.set_replan(true);
  *replan.mutable_options() = Options(2);
  replan.mutable_options()->set_microbatches(2);
  replan.mutable_options()->set_defer_grad_sync(true);
  // Each rank's micro-batch: 8 sequences over 2 ranks x 2 micro-batches.
  replan.mutable_options()->set_micro_batch_size(2);
  replan.mutable_options()->set_seq_len(4);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::GetPlanResponse expected,
                              service->GetPlan(replan));
  const std::vector<v1::LoadPlanRequest> loads = workers.loads();
  ASSERT_EQ(loads.size(), 2u);
  std::unique_ptr<StrategyRegistry> strategies =
      StrategyRegistry::CreateWithBuiltins();
  std::vector<v1::ShardingPlan> derived;
  for (const v1::LoadPlanRequest& load : loads) {
    // The workers derive the plan from the model and its options, as a
    // worker's planner does: the coordinator's plan, fingerprint and all.
    EXPECT_FALSE(load.has_plan());
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan,
                                ShardingPlanner(strategies.get())
                                    .Plan(load.model(), load.plan_options()));
    EXPECT_EQ(plan.fingerprint(), load.plan_fingerprint());
    EXPECT_EQ(plan.fingerprint(), expected.plan().fingerprint());
    EXPECT_EQ(load.model_id(), model.model_id());
    EXPECT_EQ(plan.step().microbatches(), 2);
    EXPECT_TRUE(plan.step().defer_grad_sync());
    // The activations of the micro-batches the ranks hold.
    EXPECT_EQ(plan.activations().micro_batch_size(), 2);
    EXPECT_EQ(plan.activations().seq_len(), 4);
    EXPECT_EQ(plan.memory().peak_unsharded_bytes(),
              expected.plan().memory().peak_unsharded_bytes());
    derived.push_back(plan);
    EXPECT_EQ(load.train().microbatches(), 2);
    // Zero optimizer values travel as they are: workers own the defaults.
    EXPECT_DOUBLE_EQ(load.train().lr(), 0.0);
    EXPECT_DOUBLE_EQ(load.train().beta2(), 0.0);
    EXPECT_DOUBLE_EQ(load.train().weight_decay(), 0.05);
    EXPECT_EQ(load.train().steps(), 3);
    EXPECT_EQ(load.train().global_batch(), 8);
    EXPECT_EQ(load.model().architecture(), "TinyTestForCausalLM");
  }
  EXPECT_EQ(events.back().planned_peak_unsharded_bytes(),
            expected.plan().memory().peak_unsharded_bytes());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram compiled,
                              CompileStepProgram(derived[0]));
  const std::vector<v1::StepProgram> programs = workers.programs();
  ASSERT_EQ(programs.size(), 6u);  // 3 steps x 2 ranks.
  for (v1::StepProgram program : programs) {
    EXPECT_GE(program.step(), 0);
    EXPECT_LE(program.step(), 2);
    program.set_step(0);
    EXPECT_EQ(program.SerializeAsString(), compiled.SerializeAsString());
  }

  // Status lists the finished job.
  SHARDD_ASSERT_OK_AND_ASSIGN(auto status, service->GetStatus({}));
  ASSERT_THAT(status.jobs(), SizeIs(1));
  EXPECT_EQ(status.jobs(0).job_id(), "j-1");
  EXPECT_EQ(status.jobs(0).model_id(), model.model_id());
  EXPECT_EQ(status.jobs(0).state(), v1::JOB_DONE);
  EXPECT_EQ(status.jobs(0).steps_done(), 3);
  EXPECT_EQ(status.jobs(0).total_steps(), 3);
  EXPECT_EQ(status.jobs(0).world_size(), 2);

  // Watching from step 2 starts at the second event.
  v1::WatchStepRequest watch;
  watch.set_job_id("j-1");
  watch.set_from_step(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(StepWatch from_two, service->WatchStep(watch));
  EXPECT_EQ(from_two.start_index, 1);
}

TEST_F(CoordinatorServiceTest, WatchStepErrors) {
  auto service = MakeService();
  v1::WatchStepRequest request;
  EXPECT_THAT(
      service->WatchStep(request),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));
  request.set_job_id("j-1");
  request.set_from_step(-1);
  EXPECT_THAT(
      service->WatchStep(request),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("from_step")));
  request.set_from_step(0);
  EXPECT_THAT(service->WatchStep(request),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("j-1")));
}

}  // namespace
}  // namespace shardd
