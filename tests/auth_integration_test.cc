// End-to-end tests of transport security and bearer tokens: a test CA and
// certificates made by tools/make_test_certs.sh, a coordinator and a worker
// service in this process serving TLS on loopback, and callers with and
// without the right CA, client certificate and token. Every call has a
// deadline.

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "common/grpc_security.h"
#include "common/grpc_server.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/coordinator.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "server/coordinator_server.h"
#include "server/coordinator_service.h"
#include "server/jobs/grpc_worker_client.h"
#include "planner/strategy_registry.h"
#include "worker/grpc/grpc_worker_service.h"
#include "worker/worker_runtime.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

constexpr char kScript[] = "tools/make_test_certs.sh";
constexpr char kShardctl[] = "client/shardctl";

std::string CertDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/auth_certs");
}

std::string Cert(const std::string& name) {
  return absl::StrCat(CertDir(), "/", name);
}

std::string Token(const std::string& name) {
  absl::StatusOr<std::string> token = ReadTokenFile(Cert(name), "token");
  return token.ok() ? *token : std::string();
}

std::unique_ptr<grpc::ClientContext> Context() {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::seconds(10));
  return context;
}

// A Coordinator stub over a channel with `security`.
std::unique_ptr<v1::Coordinator::Stub> Stub(const std::string& address,
                                            const ChannelSecurity& security) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      CreateSecureChannel(address, security, grpc::ChannelArguments());
  EXPECT_TRUE(channel.ok()) << channel.status();
  if (!channel.ok()) return nullptr;
  return v1::Coordinator::NewStub(*channel);
}

grpc::StatusCode ListStrategiesCode(const std::string& address,
                                    const ChannelSecurity& security) {
  std::unique_ptr<v1::Coordinator::Stub> stub = Stub(address, security);
  if (stub == nullptr) return grpc::StatusCode::INTERNAL;
  v1::ListStrategiesResponse response;
  grpc::Status status = stub->ListStrategies(
      Context().get(), v1::ListStrategiesRequest(), &response);
  if (status.ok() && response.strategies_size() == 0) {
    ADD_FAILURE() << "ListStrategies answered OK with no strategies";
  }
  return status.error_code();
}

class AuthIntegrationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string command = absl::StrCat("OPENSSL=/usr/bin/openssl bash ",
                                             kScript, " ", CertDir(), " 2>&1");
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    // Idempotent: a second run keeps what the first made.
    const std::string token_before = Token("client.token");
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    ASSERT_EQ(Token("client.token"), token_before);
  }

  void StartCoordinator(bool mutual_tls) {
    registry_ = StrategyRegistry::CreateWithBuiltins();
    service_ = std::make_unique<CoordinatorService>(registry_.get());
    CoordinatorServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.security.tls_cert_file = Cert("server.pem");
    options.security.tls_key_file = Cert("server.key");
    if (mutual_tls) options.security.tls_client_ca_file = Cert("ca.pem");
    options.authorizer =
        Authorizer(Token("client.token"), Token("worker.token"));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        server_, CoordinatorServer::Start(options, service_.get()));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(1));
  }

  ChannelSecurity Tls(const std::string& token_file) const {
    ChannelSecurity security;
    security.tls_ca_file = Cert("ca.pem");
    if (!token_file.empty()) security.bearer_token = Token(token_file);
    return security;
  }

  std::unique_ptr<StrategyRegistry> registry_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<CoordinatorServer> server_;
};

TEST_F(AuthIntegrationTest, ScriptMakesDistinctTokens) {
  EXPECT_EQ(Token("client.token").size(), 64u);
  EXPECT_EQ(Token("worker.token").size(), 64u);
  EXPECT_NE(Token("client.token"), Token("worker.token"));
}

TEST_F(AuthIntegrationTest, ClientCallsNeedTheClientToken) {
  StartCoordinator(/*mutual_tls=*/false);
  const std::string address = server_->address();
  EXPECT_EQ(ListStrategiesCode(address, Tls("")),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ListStrategiesCode(address, Tls("worker.token")),
            grpc::StatusCode::PERMISSION_DENIED);
  ChannelSecurity wrong = Tls("");
  wrong.bearer_token = "not-a-token";
  EXPECT_EQ(ListStrategiesCode(address, wrong),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ListStrategiesCode(address, Tls("client.token")),
            grpc::StatusCode::OK);
}

TEST_F(AuthIntegrationTest, WorkerCallsNeedTheWorkerToken) {
  StartCoordinator(/*mutual_tls=*/false);
  v1::PutRequest put;
  put.set_key("auth/test");
  put.set_value("v");
  v1::PutResponse put_response;
  {
    auto stub = Stub(server_->address(), Tls("client.token"));
    ASSERT_NE(stub, nullptr);
    grpc::Status status = stub->Put(Context().get(), put, &put_response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("worker token"));
  }
  {
    auto stub = Stub(server_->address(), Tls(""));
    ASSERT_NE(stub, nullptr);
    v1::HeartbeatResponse response;
    grpc::Status status =
        stub->Heartbeat(Context().get(), v1::HeartbeatRequest(), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(status.error_message(), HasSubstr("missing bearer token"));
  }
  auto stub = Stub(server_->address(), Tls("worker.token"));
  ASSERT_NE(stub, nullptr);
  grpc::Status status = stub->Put(Context().get(), put, &put_response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  v1::GetRequest get;
  get.set_key("auth/test");
  v1::GetResponse got;
  status = stub->Get(Context().get(), get, &got);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(got.value(), "v");
}

TEST_F(AuthIntegrationTest, HealthNeedsNoToken) {
  StartCoordinator(/*mutual_tls=*/false);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = CreateSecureChannel(
      server_->address(), Tls(""), grpc::ChannelArguments());
  ASSERT_TRUE(channel.ok());
  auto health = grpc::health::v1::Health::NewStub(*channel);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = health->Check(
      Context().get(), grpc::health::v1::HealthCheckRequest(), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(AuthIntegrationTest, PlaintextClientCannotTalkToTlsServer) {
  StartCoordinator(/*mutual_tls=*/false);
  ChannelSecurity plaintext;
  plaintext.bearer_token = Token("client.token");
  EXPECT_EQ(ListStrategiesCode(server_->address(), plaintext),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(AuthIntegrationTest, ServerNameMustMatchTheCertificate) {
  StartCoordinator(/*mutual_tls=*/false);
  ChannelSecurity security = Tls("client.token");
  security.tls_server_name_override = "not-the-server.example";
  EXPECT_EQ(ListStrategiesCode(server_->address(), security),
            grpc::StatusCode::UNAVAILABLE);
  // By name: the certificate lists localhost too.
  security.tls_server_name_override = "localhost";
  EXPECT_EQ(ListStrategiesCode(server_->address(), security),
            grpc::StatusCode::OK);
}

TEST_F(AuthIntegrationTest, MutualTlsNeedsAClientCertificate) {
  StartCoordinator(/*mutual_tls=*/true);
  EXPECT_EQ(ListStrategiesCode(server_->address(), Tls("client.token")),
            grpc::StatusCode::UNAVAILABLE);
  ChannelSecurity with_cert = Tls("client.token");
  with_cert.tls_cert_file = Cert("client.pem");
  with_cert.tls_key_file = Cert("client.key");
  EXPECT_EQ(ListStrategiesCode(server_->address(), with_cert),
            grpc::StatusCode::OK);
}

TEST_F(AuthIntegrationTest, CoordinatorClientConnectsWithSecurity) {
  StartCoordinator(/*mutual_tls=*/true);
  ChannelSecurity security = Tls("client.token");
  security.tls_cert_file = Cert("client.pem");
  security.tls_key_file = Cert("client.key");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<CoordinatorClient> client,
      CoordinatorClient::Connect(server_->address(), absl::Seconds(10),
                                 security));
  client->set_call_timeout(absl::Seconds(10));
  SHARDD_EXPECT_OK(client->GetStatus());

  // Without the client certificate the handshake never completes.
  EXPECT_THAT(CoordinatorClient::Connect(server_->address(),
                                         absl::Milliseconds(500), Tls("")),
              StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(AuthIntegrationTest, WorkerServiceNeedsTheWorkerToken) {
  WorkerRuntime runtime;
  GrpcWorkerService service(&runtime, nullptr,
                            Authorizer("", Token("worker.token")));
  ServerSecurity security;
  security.tls_cert_file = Cert("server.pem");
  security.tls_key_file = Cert("server.key");
  security.tls_client_ca_file = Cert("ca.pem");
  GrpcServerOptions options;
  SHARDD_ASSERT_OK_AND_ASSIGN(options.credentials,
                              MakeServerCredentials(security));
  SHARDD_ASSERT_OK_AND_ASSIGN(RunningServer running,
                              StartGrpcServer(options, {&service}));

  // What the coordinator does: the CA, its certificate and the worker token.
  ChannelSecurity coordinator = Tls("worker.token");
  coordinator.tls_cert_file = Cert("server.pem");
  coordinator.tls_key_file = Cert("server.key");
  WorkerCallOptions call;
  call.deadline = absl::Now() + absl::Seconds(10);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<WorkerClient> client,
      GrpcWorkerClient::Create(running.address, coordinator));
  SHARDD_EXPECT_OK(client->GetStats(call));

  ChannelSecurity client_token = coordinator;
  client_token.bearer_token = Token("client.token");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<WorkerClient> wrong,
      GrpcWorkerClient::Create(running.address, client_token));
  EXPECT_THAT(wrong->GetStats(call),
              StatusIs(absl::StatusCode::kUnauthenticated));

  ChannelSecurity no_token = coordinator;
  no_token.bearer_token.clear();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<WorkerClient> anonymous,
      GrpcWorkerClient::Create(running.address, no_token));
  EXPECT_THAT(anonymous->GetStats(call),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("missing bearer token")));

  service.Stop();
  running.server->Shutdown(std::chrono::system_clock::now() +
                           std::chrono::seconds(1));
}

// Runs `command` through the shell; returns its exit status and output.
int RunShell(const std::string& command, std::string* output) {
  FILE* pipe = popen(absl::StrCat(command, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) {
    output->append(buffer, n);
  }
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_F(AuthIntegrationTest, ShardctlSendsItsTokenAndCertificate) {
  StartCoordinator(/*mutual_tls=*/true);
  const std::string base = absl::StrCat(
      kShardctl, " status --timeout 5 --coordinator ", server_->address(),
      " --tls-ca ", Cert("ca.pem"), " --tls-cert ", Cert("client.pem"),
      " --tls-key ", Cert("client.key"));
  std::string output;
  EXPECT_EQ(RunShell(absl::StrCat(base, " --token-file ", Cert("client.token")),
                     &output),
            0)
      << output;
  // The token file from the environment.
  output.clear();
  EXPECT_EQ(RunShell(absl::StrCat("SHARDD_TOKEN_FILE=", Cert("client.token"),
                                  " ", base),
                     &output),
            0)
      << output;
  output.clear();
  EXPECT_NE(RunShell(base, &output), 0);
  EXPECT_THAT(output, HasSubstr("UNAUTHENTICATED"));
  output.clear();
  EXPECT_NE(RunShell(absl::StrCat(base, " --token-file ", Cert("worker.token")),
                     &output),
            0);
  EXPECT_THAT(output, HasSubstr("PERMISSION_DENIED"));
}

}  // namespace
}  // namespace shardd
