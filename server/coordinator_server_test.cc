#include "server/coordinator_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/coordinator.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "server/coordinator_service.h"
#include "planner/strategy_registry.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

class CoordinatorServerTest : public ::testing::Test {
 protected:
  CoordinatorServerTest()
      : registry_(StrategyRegistry::CreateWithBuiltins()),
        service_(registry_.get()) {}

  std::unique_ptr<StrategyRegistry> registry_;
  CoordinatorService service_;
};

TEST_F(CoordinatorServerTest, RejectsMalformedAddresses) {
  for (const char* address : {"", "localhost", ":80", "127.0.0.1:x",
                              "127.0.0.1:65536", "127.0.0.1:-1"}) {
    CoordinatorServerOptions options;
    options.listen_address = address;
    EXPECT_THAT(
        CoordinatorServer::Start(options, &service_),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listen")))
        << address;
  }
}

TEST_F(CoordinatorServerTest, BusyPortIsUnavailable) {
  // A plain listening socket without SO_REUSEPORT holds the port.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);

  CoordinatorServerOptions options;
  options.listen_address = absl::StrCat("127.0.0.1:", port);
  EXPECT_THAT(
      CoordinatorServer::Start(options, &service_),
      StatusIs(absl::StatusCode::kUnavailable, HasSubstr(absl::StrCat(port))));
  close(fd);
}

TEST_F(CoordinatorServerTest, ServesOnPickedPortWithHealthAndStatusCodes) {
  CoordinatorServerOptions options;
  options.listen_address = "127.0.0.1:0";
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CoordinatorServer> server,
                              CoordinatorServer::Start(options, &service_));
  ASSERT_GT(server->port(), 0);
  EXPECT_EQ(server->address(), absl::StrCat("127.0.0.1:", server->port()));

  auto channel = grpc::CreateChannel(server->address(),
                                     grpc::InsecureChannelCredentials());
  ASSERT_TRUE(channel->WaitForConnected(In(10)));

  auto health = grpc::health::v1::Health::NewStub(channel);
  {
    grpc::ClientContext context;
    context.set_deadline(In(10));
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&context, {}, &response).ok());
    EXPECT_EQ(response.status(),
              grpc::health::v1::HealthCheckResponse::SERVING);
  }

  auto stub = v1::Coordinator::NewStub(channel);
  {
    // The logic's code and message cross the transport unchanged.
    grpc::ClientContext context;
    context.set_deadline(In(10));
    v1::SubmitModelResponse response;
    grpc::Status status = stub->SubmitModel(&context, {}, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(status.error_message(),
              std::string(service_.SubmitModel({}).status().message()));
  }
  {
    // A refused stream ends at once with the service's error, no events.
    grpc::ClientContext context;
    context.set_deadline(In(10));
    v1::WatchStepRequest request;
    request.set_job_id("j-404");
    auto reader = stub->WatchStep(&context, request);
    v1::StepEvent event;
    EXPECT_FALSE(reader->Read(&event));
    grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(status.error_message(), HasSubstr("j-404"));
  }

  server->Shutdown(absl::Seconds(2));
  server->Shutdown(absl::Seconds(2));  // Idempotent.
  grpc::ClientContext context;
  context.set_deadline(In(2));
  v1::GetStatusResponse response;
  EXPECT_FALSE(stub->GetStatus(&context, {}, &response).ok());
}

}  // namespace
}  // namespace shardd
