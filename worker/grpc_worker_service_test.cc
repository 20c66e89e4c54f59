#include "worker/grpc_worker_service.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/grpc_server.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/worker.grpc.pb.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

class WorkerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    service_ = std::make_unique<GrpcWorkerService>([this] { stopped_ = true; });
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
  std::unique_ptr<GrpcWorkerService> service_;
  RunningServer server_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(WorkerServiceTest, DataPathRpcsSayTheyAreNotImplementedYet) {
  v1::CommandResponse response;
  grpc::Status status =
      stub_->Unshard(Context().get(), v1::UnitRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), HasSubstr("Unshard"));
  v1::LoadPlanResponse load;
  status = stub_->LoadPlan(Context().get(), v1::LoadPlanRequest(), &load);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), HasSubstr("workers issue"));
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
