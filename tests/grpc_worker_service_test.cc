#include "worker/grpc/grpc_worker_service.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/error_info.h"
#include "common/grpc_server.h"
#include "common/grpc_status.h"
#include "testing/model_builder.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/worker.grpc.pb.h"
#include "server/coordinator_server.h"
#include "server/coordinator_service.h"
#include "planner/sharding_planner.h"
#include "program/step_program.h"
#include "planner/strategy_registry.h"
#include "worker/grpc/coordinator_agent.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/worker_runtime.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

using ::shardd::testing_util::AddChild;
using ::shardd::testing_util::AddParam;

// Embedding (vocab 16, hidden 8), one MoE layer (4 experts, top-2), final
// norm, tied head.
v1::ModelSpec TinyMoe() {
  v1::ModelSpec spec;
  spec.set_architecture("ShardMoEForCausalLM");
  spec.set_dtype(v1::FLOAT32);
  spec.mutable_dims()->set_top_k(2);
  spec.mutable_dims()->set_activation(v1::SWIGLU);
  spec.mutable_dims()->set_rms_norm_eps(1e-6);
  v1::ModuleSpec* root = spec.mutable_root();
  root->set_kind(v1::MODULE_MODEL);
  v1::ModuleSpec* model = AddChild(root, "model", v1::MODULE_GENERIC);
  AddParam(AddChild(model, "embed_tokens", v1::MODULE_EMBEDDING), "weight",
           {16, 8});
  v1::ModuleSpec* layers = AddChild(model, "layers", v1::MODULE_LAYER_LIST);
  v1::ModuleSpec* layer = AddChild(layers, "0", v1::MODULE_DECODER_LAYER);
  AddParam(AddChild(layer, "input_layernorm", v1::MODULE_NORM), "weight", {8});
  v1::ModuleSpec* moe = AddChild(layer, "moe", v1::MODULE_MOE);
  AddParam(AddChild(moe, "gate", v1::MODULE_ROUTER), "weight", {4, 8});
  v1::ModuleSpec* experts =
      AddChild(moe, "experts", v1::MODULE_GROUPED_EXPERTS);
  AddParam(experts, "gate_and_up_projs", {4, 8, 12});
  AddParam(experts, "down_projs", {4, 6, 8});
  AddParam(AddChild(model, "norm", v1::MODULE_NORM), "weight", {8});
  AddParam(AddChild(root, "lm_head", v1::MODULE_LM_HEAD), "weight", {16, 8})
      ->set_tied_to("model.embed_tokens.weight");
  return spec;
}

v1::ShardingPlan MakePlan(const v1::ModelSpec& model, int dp_shard) {
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(dp_shard);
  options.set_strategy("default");
  options.set_mixed_precision(false);
  absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(model, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardingPlan();
}

v1::LoadPlanRequest MakeLoad(const v1::ShardingPlan& plan,
                             const v1::ModelSpec& model) {
  v1::LoadPlanRequest request;
  *request.mutable_plan() = plan;
  *request.mutable_model() = model;
  request.set_job_id("grpc-test");
  request.set_membership_epoch(1);
  request.set_seed(5);
  request.mutable_train()->set_global_batch(4);
  request.mutable_train()->set_seq_len(6);
  return request;
}

class WorkerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    service_ = std::make_unique<GrpcWorkerService>(&runtime_,
                                                   [this] { stopped_ = true; });
    auto running = StartGrpcServer(GrpcServerOptions{}, {service_.get()});
    ASSERT_TRUE(running.ok()) << running.status();
    server_ = std::move(*running);
    stub_ = v1::Worker::NewStub(grpc::CreateChannel(
        server_.address, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_.server) server_.server->Shutdown();
  }
  std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(10));
    return context;
  }

  std::atomic<bool> stopped_{false};
  WorkerRuntime runtime_;
  std::unique_ptr<GrpcWorkerService> service_;
  RunningServer server_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(WorkerServiceTest, SingleUnitRpcsPointToRunCommand) {
  v1::CommandResponse response;
  grpc::Status status =
      stub_->Unshard(Context().get(), v1::UnitRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), HasSubstr("Unshard"));
  EXPECT_THAT(status.error_message(), HasSubstr("RunCommand"));
  status = stub_->ReduceScatter(Context().get(), v1::UnitRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), HasSubstr("REDUCE_SCATTER"));
}

TEST_F(WorkerServiceTest, CheckpointRpcsNeedAPlanAndACheckpointRoot) {
  v1::SaveShardsResponse saved;
  grpc::Status status =
      stub_->SaveShards(Context().get(), v1::SaveShardsRequest(), &saved);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("--checkpoint-root"));
  v1::LoadShardsResponse loaded;
  status = stub_->LoadShards(Context().get(), v1::LoadShardsRequest(), &loaded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("--checkpoint-root"));
}

// (section: worker-recovery) HealReplicas is served (queued like the
// checkpoint RPCs) and refuses a worker without a plan.
TEST_F(WorkerServiceTest, HealReplicasNeedsAPlan) {
  v1::HealReplicasRequest request;
  request.add_source_replica(0);
  v1::HealReplicasResponse response;
  const grpc::Status status =
      stub_->HealReplicas(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("no plan loaded"));
  // The coordinator acts on the reason, which crosses gRPC with the status.
  EXPECT_EQ(ErrorReasonOf(FromGrpcStatus(status)), kReasonPlanNotHeld);
}

// A call context with a 10 s deadline that presents `token` ("": none).
std::unique_ptr<grpc::ClientContext> TokenContext(const char* token) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::seconds(10));
  if (*token != '\0') {
    context->AddMetadata("authorization", std::string("Bearer ") + token);
  }
  return context;
}

TEST(WorkerServiceAuthTest, CheckpointRpcsNeedTheWorkerToken) {
  WorkerRuntimeOptions options;
  options.checkpoint_root = "/nonexistent";
  WorkerRuntime runtime(options);
  GrpcWorkerService service(&runtime, nullptr,
                            Authorizer("client-token", "worker-token"));
  auto running = StartGrpcServer(GrpcServerOptions{}, {&service});
  ASSERT_TRUE(running.ok()) << running.status();
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(
      running->address, grpc::InsecureChannelCredentials()));
  for (const char* token : {"", "client-token"}) {
    v1::SaveShardsResponse saved;
    const grpc::Status status = stub->SaveShards(
        TokenContext(token).get(), v1::SaveShardsRequest(), &saved);
    EXPECT_TRUE(status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                status.error_code() == grpc::StatusCode::PERMISSION_DENIED)
        << token << ": " << status.error_message();
    v1::LoadShardsResponse loaded;
    const grpc::Status load_status = stub->LoadShards(
        TokenContext(token).get(), v1::LoadShardsRequest(), &loaded);
    EXPECT_TRUE(load_status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                load_status.error_code() == grpc::StatusCode::PERMISSION_DENIED)
        << token << ": " << load_status.error_message();
  }
  running->server->Shutdown();
}

TEST(WorkerServiceAuthTest, RelayHeartbeatNeedsTheWorkerTokenAndAnAnswer) {
  WorkerRuntime runtime{WorkerRuntimeOptions()};
  GrpcWorkerService service(&runtime, nullptr,
                            Authorizer("client-token", "worker-token"));
  auto running = StartGrpcServer(GrpcServerOptions{}, {&service});
  ASSERT_TRUE(running.ok()) << running.status();
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(
      running->address, grpc::InsecureChannelCredentials()));
  v1::HeartbeatRequest beat;
  beat.set_rank(3);
  beat.set_incarnation(33);
  auto call = [&](const char* token, v1::HeartbeatResponse* response) {
    return stub->RelayHeartbeat(TokenContext(token).get(), beat, response);
  };
  v1::HeartbeatResponse response;
  EXPECT_EQ(call("", &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call("client-token", &response).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // No answer from the coordinator yet: the caller is sent there directly.
  EXPECT_EQ(call("worker-token", &response).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(service.heartbeat_relay()->TakePending().empty());
  v1::HeartbeatResponse answer;
  answer.set_coordinator_incarnation(9);
  answer.set_membership_epoch(4);
  service.heartbeat_relay()->Delivered(answer);
  const grpc::Status status = call("worker-token", &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.coordinator_incarnation(), 9u);
  EXPECT_EQ(response.membership_epoch(), 4u);
  const std::vector<v1::RelayedHeartbeat> pending =
      service.heartbeat_relay()->TakePending();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_EQ(pending[0].rank(), 3);
  EXPECT_EQ(pending[0].incarnation(), 33u);
  running->server->Shutdown();
}

TEST_F(WorkerServiceTest, LoadPlanAndExecuteOneRank) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 1);
  const absl::StatusOr<v1::StepProgram> program = CompileStepProgram(plan);
  ASSERT_TRUE(program.ok()) << program.status();

  // Before any plan: a clear FAILED_PRECONDITION.
  v1::ExecuteRequest execute;
  *execute.mutable_program() = *program;
  v1::ExecuteResponse step;
  grpc::Status status = stub_->Execute(Context().get(), execute, &step);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("no plan loaded"));

  // A bad train config travels back as INVALID_ARGUMENT.
  v1::LoadPlanRequest load = MakeLoad(plan, model);
  load.mutable_train()->set_seq_len(0);
  v1::LoadPlanResponse loaded;
  status = stub_->LoadPlan(Context().get(), load, &loaded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("seq_len"));

  // No --coordinator (no KV store): one rank still loads.
  load = MakeLoad(plan, model);
  status = stub_->LoadPlan(Context().get(), load, &loaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_GT(loaded.data_entropy_rate(), 0.0);
  EXPECT_LT(loaded.data_entropy_rate(), std::log(16.0));
  int64_t shard_elements = 0;
  for (const v1::FsdpUnit& unit : plan.units()) {
    shard_elements += unit.shard_numel();
  }
  EXPECT_EQ(loaded.shard_bytes(), 4 * shard_elements);

  std::vector<double> losses;
  for (int s = 0; s < 2; ++s) {
    execute.mutable_program()->set_step(s);
    status = stub_->Execute(Context().get(), execute, &step);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(step.step(), s + 1);
    EXPECT_EQ(step.tokens(), 4 * 6);  // global_batch x seq_len, one rank.
    EXPECT_EQ(step.peak_unsharded_bytes(),
              plan.memory().peak_unsharded_bytes());
    EXPECT_GT(step.grad_norm(), 0.0);
    losses.push_back(step.loss());
  }
  // Steps 0 and 1 read different sequences and use updated weights.
  EXPECT_NE(losses[0], losses[1]);
  // The same plan through the runtime directly gives the same numbers: the
  // adapter moves messages and nothing else.
  WorkerRuntime direct;
  ASSERT_TRUE(direct.LoadPlan(load, nullptr).ok());
  for (int s = 0; s < 2; ++s) {
    execute.mutable_program()->set_step(s);
    absl::StatusOr<v1::ExecuteResponse> local = direct.Execute(execute);
    ASSERT_TRUE(local.ok()) << local.status();
    EXPECT_EQ(local->loss(), losses[s]);
  }

  v1::GetStatsResponse stats;
  ASSERT_TRUE(
      stub_->GetStats(Context().get(), v1::GetStatsRequest(), &stats).ok());
  EXPECT_GT(stats.live_bytes(), loaded.shard_bytes());
  EXPECT_GE(stats.peak_bytes(), stats.live_bytes());

  // A stale fingerprint.
  execute.mutable_program()->set_plan_fingerprint(plan.fingerprint() ^ 1);
  status = stub_->Execute(Context().get(), execute, &step);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("stale plan"));
  EXPECT_EQ(ErrorReasonOf(FromGrpcStatus(status)), kReasonPlanNotHeld);
}

TEST_F(WorkerServiceTest, ABlockedLoadPlanDoesNotBlockOtherRpcs) {
  // Rank 0 of 2 with a store but no rank 1: LoadPlan waits for the peer
  // for the collective timeout while GetStats still answers.
  InMemoryKeyValueClient kv;
  service_->set_kv_client(&kv);
  const v1::ModelSpec model = TinyMoe();
  v1::LoadPlanRequest load = MakeLoad(MakePlan(model, 2), model);
  load.set_collective_timeout_ms(1500);
  v1::LoadPlanResponse loaded;
  grpc::Status load_status;
  absl::Notification done;
  auto load_context = Context();
  const absl::Time start = absl::Now();
  stub_->async()->LoadPlan(load_context.get(), &load, &loaded,
                           [&](grpc::Status s) {
                             load_status = s;
                             done.Notify();
                           });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(done.HasBeenNotified());
  v1::GetStatsResponse stats;
  ASSERT_TRUE(
      stub_->GetStats(Context().get(), v1::GetStatsRequest(), &stats).ok());
  EXPECT_FALSE(done.HasBeenNotified());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(9)));
  EXPECT_EQ(load_status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << load_status.error_message();
  EXPECT_THAT(load_status.error_message(), HasSubstr("shard group"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1400));
  service_->set_kv_client(nullptr);
}

// Two workers wired as shardd-worker wires them (runtime behind the gRPC
// service, the coordinator agent as its KV store): LoadPlan and Execute
// over gRPC, with the Gloo rendezvous through the coordinator's KV RPCs.
TEST(WorkerServiceCoordinatorTest, TwoWorkersRendezvousThroughTheCoordinator) {
  std::unique_ptr<StrategyRegistry> registry =
      StrategyRegistry::CreateWithBuiltins();
  CoordinatorService coordinator(registry.get(), CoordinatorServiceOptions());
  CoordinatorServerOptions server_options;
  server_options.listen_address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<CoordinatorServer>> coordinator_server =
      CoordinatorServer::Start(server_options, &coordinator);
  ASSERT_TRUE(coordinator_server.ok()) << coordinator_server.status();

  constexpr int kWorkers = 2;
  struct Worker {
    WorkerRuntime runtime;
    std::unique_ptr<GrpcWorkerService> service;
    RunningServer server;
    std::unique_ptr<CoordinatorAgent> agent;
    std::unique_ptr<v1::Worker::Stub> stub;
  };
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < kWorkers; ++i) {
    auto w = std::make_unique<Worker>();
    w->service = std::make_unique<GrpcWorkerService>(&w->runtime, nullptr);
    absl::StatusOr<RunningServer> running =
        StartGrpcServer(GrpcServerOptions{}, {w->service.get()});
    ASSERT_TRUE(running.ok()) << running.status();
    w->server = *std::move(running);
    CoordinatorAgentOptions agent_options;
    agent_options.coordinator = (*coordinator_server)->address();
    agent_options.address = w->server.address;
    agent_options.connect_timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<CoordinatorAgent>> agent =
        CoordinatorAgent::Start(agent_options);
    ASSERT_TRUE(agent.ok()) << agent.status();
    w->agent = *std::move(agent);
    w->service->set_kv_client(w->agent.get());
    w->stub = v1::Worker::NewStub(grpc::CreateChannel(
        w->server.address, grpc::InsecureChannelCredentials()));
    workers.push_back(std::move(w));
  }

  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, kWorkers);
  const absl::StatusOr<v1::StepProgram> program = CompileStepProgram(plan);
  ASSERT_TRUE(program.ok()) << program.status();
  auto deadline = [] {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(20));
    return context;
  };
  std::vector<grpc::Status> statuses(kWorkers);
  std::vector<v1::ExecuteResponse> steps(kWorkers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      Worker& w = *workers[i];
      v1::LoadPlanRequest load = MakeLoad(plan, model);
      load.set_rank(w.agent->rank());
      load.set_collective_timeout_ms(10000);
      v1::LoadPlanResponse loaded;
      statuses[i] = w.stub->LoadPlan(deadline().get(), load, &loaded);
      if (!statuses[i].ok()) return;
      v1::ExecuteRequest execute;
      *execute.mutable_program() = *program;
      statuses[i] = w.stub->Execute(deadline().get(), execute, &steps[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kWorkers; ++i) {
    ASSERT_TRUE(statuses[i].ok())
        << "worker " << i << ": " << statuses[i].error_message();
    EXPECT_EQ(steps[i].tokens(), 4 / kWorkers * 6);
    EXPECT_EQ(steps[i].all_gathers(), plan.comm().all_gathers());
    EXPECT_GT(steps[i].grad_norm(), 0.0);
  }
  // Both see the same global gradient norm (the norm is all-reduced).
  EXPECT_NEAR(steps[0].grad_norm(), steps[1].grad_norm(),
              1e-6 * steps[0].grad_norm());

  for (auto& w : workers) {
    w->agent->Stop();
    w->service->Stop();
    w->service->set_kv_client(nullptr);
    w->server.server->Shutdown();
  }
  workers.clear();
  (*coordinator_server)->Shutdown(absl::Seconds(1));
}

TEST_F(WorkerServiceTest, StoppedServiceRefusesWork) {
  service_->Stop();
  v1::ExecuteResponse step;
  grpc::Status status =
      stub_->Execute(Context().get(), v1::ExecuteRequest(), &step);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("shutting down"));
}

TEST_F(WorkerServiceTest, StatsAndShutdown) {
  v1::GetStatsResponse stats;
  ASSERT_TRUE(
      stub_->GetStats(Context().get(), v1::GetStatsRequest(), &stats).ok());
  EXPECT_EQ(stats.live_bytes(), 0);
  EXPECT_FALSE(stopped_.load());
  v1::ShutdownResponse shutdown;
  ASSERT_TRUE(
      stub_->Shutdown(Context().get(), v1::ShutdownRequest(), &shutdown).ok());
  EXPECT_TRUE(stopped_.load());
}

TEST_F(WorkerServiceTest, HealthServiceIsServing) {
  // The default health service answers grpc.health.v1.Health/Check; probe it
  // through the generic stub with an empty request (service "").
  grpc::GenericStub generic(
      grpc::CreateChannel(server_.address, grpc::InsecureChannelCredentials()));
  grpc::Slice empty("", 0);  // An empty HealthCheckRequest (service "").
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer reply;
  grpc::Status result;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  auto context = Context();
  generic.UnaryCall(context.get(), "/grpc.health.v1.Health/Check",
                    grpc::StubOptions(), &request, &reply, [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mu);
                      result = s;
                      done = true;
                      cv.notify_one();
                    });
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(
      cv.wait_for(lock, std::chrono::seconds(10), [&] { return done; }));
  ASSERT_TRUE(result.ok()) << result.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(reply.Dump(&slices).ok());
  std::string bytes;
  for (const auto& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse{status: SERVING(1)} encodes as field 1 varint 1.
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

}  // namespace
}  // namespace shardd
