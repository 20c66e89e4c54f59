// WatchStep over real gRPC (in-process server on loopback): stored events
// are replayed, live ones streamed as the job publishes them, a failed job's
// error arrives as an event, shutdown ends open streams at once, and a
// client that goes away frees its stream. Workers are in-memory fakes.

#include "server/grpc_coordinator_service.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_server.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "planner/strategy_registry.h"
#include "proto/coordinator.grpc.pb.h"
#include "server/coordinator_service.h"
#include "server/jobs/worker_client.h"
#include "testing/fake_cluster.h"

namespace shardd {
namespace {

using ::shardd::testing_util::AddressOf;
using ::shardd::testing_util::FakeCluster;
using ::testing::HasSubstr;

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

class WatchStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Every rank answers loss 10 - step and 32 tokens.
    cluster_.script().loss = [](int, int64_t step) {
      return 10.0 - static_cast<double>(step);
    };
    cluster_.script().tokens = [](int) { return int64_t{32}; };
    cluster_.script().entropy_rate = 0.75;
    grpc_init();  // Held for the whole test: no teardown stall between.
    registry_ = StrategyRegistry::CreateWithBuiltins();
    CoordinatorServiceOptions options;
    options.worker_clients = [this](const std::string& address)
        -> absl::StatusOr<std::unique_ptr<WorkerClient>> {
      return cluster_.MakeClient(address);
    };
    options.jobs.poll_interval = absl::Milliseconds(10);
    // A failed step fails the job here (recovery is job_runner_test's).
    options.jobs.default_max_recoveries = 0;
    service_ = std::make_unique<CoordinatorService>(registry_.get(), options);
    grpc_service_ = std::make_unique<GrpcCoordinatorService>(service_.get());
    GrpcServerOptions server_options;
    server_options.address = "127.0.0.1:0";
    SHARDD_ASSERT_OK_AND_ASSIGN(
        server_, StartGrpcServer(server_options, {grpc_service_.get()}));
    channel_ = grpc::CreateChannel(server_.address,
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);

    v1::RegisterWorkerRequest worker;
    worker.set_address(AddressOf(0));
    worker.set_incarnation(5);
    worker.set_requested_rank(-1);
    SHARDD_ASSERT_OK(service_->RegisterWorker(worker).status());
  }

  void TearDown() override {
    if (!cluster_.gate().HasBeenNotified()) cluster_.gate().Notify();
    StopServer();
    service_->Shutdown();
    stub_.reset();
    channel_.reset();
    grpc_shutdown();
  }

  void StopServer() {
    if (server_.server == nullptr) return;
    grpc_service_->CancelWaitingCalls();
    server_.server->Shutdown(In(absl::Seconds(5)));
    server_.server->Wait();
    server_.server.reset();
  }

  // A one-worker job of `steps` steps of a small dense model.
  std::string Submit(int steps) {
    v1::SubmitModelRequest model;
    model.set_native_spec_json(R"({
      "architecture": "T", "dtype": "float32",
      "root": {"kind": "model", "children": [
        {"name": "model", "kind": "generic", "children": [
          {"name": "embed_tokens", "kind": "embedding",
           "params": [{"name": "weight", "shape": [16, 8]}]},
          {"name": "norm", "kind": "norm",
           "params": [{"name": "weight", "shape": [8]}]}]},
        {"name": "lm_head", "kind": "lm_head",
         "params": [{"name": "weight", "shape": [16, 8]}]}]}})");
    model.mutable_options()->mutable_mesh()->set_dp_shard(1);
    absl::StatusOr<v1::SubmitModelResponse> submitted =
        service_->SubmitModel(model);
    EXPECT_THAT(submitted, IsOk());
    if (!submitted.ok()) return "";

    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    v1::SubmitStepRequest request;
    request.set_model_id(submitted->model_id());
    request.mutable_config()->set_steps(steps);
    request.mutable_config()->set_global_batch(4);
    request.mutable_config()->set_seq_len(8);
    v1::SubmitStepResponse response;
    const grpc::Status status = stub_->SubmitStep(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.world_size(), 1);
    return response.job_id();
  }

  std::unique_ptr<StrategyRegistry> registry_;
  FakeCluster cluster_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<GrpcCoordinatorService> grpc_service_;
  RunningServer server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(WatchStepTest, StreamsStoredThenLiveEventsAndEnds) {
  cluster_.script().gate_step = 1;  // Step 1 is published, step 2 waits.
  const std::string job = Submit(3);
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(20)));
  v1::WatchStepRequest request;
  request.set_job_id(job);
  auto reader = stub_->WatchStep(&context, request);
  v1::StepEvent event;
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.step(), 1);
  EXPECT_DOUBLE_EQ(event.loss(), 10.0);
  EXPECT_DOUBLE_EQ(event.data_entropy_rate(), 0.75);
  EXPECT_EQ(event.total_steps(), 3);
  EXPECT_FALSE(event.done());
  // The stream waits without an event until the job goes on.
  EXPECT_EQ(grpc_service_->watch_streams(), 1u);
  cluster_.gate().Notify();
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.step(), 2);
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.step(), 3);
  EXPECT_DOUBLE_EQ(event.loss(), 8.0);
  EXPECT_TRUE(event.done());
  EXPECT_FALSE(reader->Read(&event));
  const grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(WatchStepTest, ReplaysFromTheRequestedStep) {
  const std::string job = Submit(4);
  // Wait (bounded) for the job to end, then watch from step 3.
  SHARDD_ASSERT_OK_AND_ASSIGN(StepWatch log, service_->WatchStep([&] {
    v1::WatchStepRequest r;
    r.set_job_id(job);
    return r;
  }()));
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (!log.log->ended() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_TRUE(log.log->ended());
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(20)));
  v1::WatchStepRequest request;
  request.set_job_id(job);
  request.set_from_step(3);
  auto reader = stub_->WatchStep(&context, request);
  std::vector<int64_t> steps;
  v1::StepEvent event;
  while (reader->Read(&event)) steps.push_back(event.step());
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 4}));
}

TEST_F(WatchStepTest, AFailedJobsErrorArrivesAsTheLastEvent) {
  cluster_.script().failures[0] = {1,
                                   absl::AbortedError("collective timed out")};
  const std::string job = Submit(5);
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(20)));
  v1::WatchStepRequest request;
  request.set_job_id(job);
  auto reader = stub_->WatchStep(&context, request);
  std::vector<v1::StepEvent> events;
  v1::StepEvent event;
  while (reader->Read(&event)) events.push_back(event);
  EXPECT_TRUE(reader->Finish().ok());
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].step(), 2);
  EXPECT_EQ(events[1].error(),
            "step 2/5: rank 0 (fake-0:1): ABORTED: collective timed out");
}

TEST_F(WatchStepTest, UnknownJobIsNotFound) {
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(10)));
  v1::WatchStepRequest request;
  request.set_job_id("j-77");
  auto reader = stub_->WatchStep(&context, request);
  v1::StepEvent event;
  EXPECT_FALSE(reader->Read(&event));
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("j-77"));
}

TEST_F(WatchStepTest, ShutdownEndsAWaitingStreamAtOnce) {
  cluster_.script().gate_step = 0;  // Nothing is published.
  const std::string job = Submit(3);
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(60)));
  v1::WatchStepRequest request;
  request.set_job_id(job);
  auto reader = stub_->WatchStep(&context, request);
  // Wait (bounded) until the stream is open on the server.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (grpc_service_->watch_streams() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(grpc_service_->watch_streams(), 1u);
  const absl::Time start = absl::Now();
  StopServer();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  v1::StepEvent event;
  EXPECT_FALSE(reader->Read(&event));
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(WatchStepTest, ACancelledClientFreesItsStream) {
  cluster_.script().gate_step = 0;
  const std::string job = Submit(3);
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(60)));
  v1::WatchStepRequest request;
  request.set_job_id(job);
  auto reader = stub_->WatchStep(&context, request);
  absl::Time until = absl::Now() + absl::Seconds(10);
  while (grpc_service_->watch_streams() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(grpc_service_->watch_streams(), 1u);
  context.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  until = absl::Now() + absl::Seconds(10);
  while (grpc_service_->watch_streams() > 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(grpc_service_->watch_streams(), 0u);
}

}  // namespace
}  // namespace shardd
