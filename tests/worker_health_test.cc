// The worker's gRPC health status is what a Kubernetes readiness probe sees:
// NOT_SERVING while the worker has not registered with its coordinator,
// SERVING once it has, on both the main port and the plaintext
// --health-listen port. Real processes on loopback; every wait is bounded
// and every process is stopped.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"
#include "tests/subprocess.h"

namespace shardd {
namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::shardd::testing_util::ReadFile;
using ::shardd::testing_util::RunCommand;
using ::shardd::testing_util::Spawn;
using ::shardd::testing_util::Stop;
using ::shardd::testing_util::TempDir;
using ::shardd::testing_util::WaitFor;

constexpr char kCoordinatorBinary[] = "server/shardd-coordinator";
constexpr char kWorkerBinary[] = "worker/shardd-worker";

// A port that was free a moment ago (bind to 0, read it, close).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// The overall status from a plaintext Check with a 1 s deadline; -1 when
// the call failed (nothing listening yet).
int CheckHealth(int port) {
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(1));
  HealthCheckResponse response;
  if (!stub->Check(&context, HealthCheckRequest(), &response).ok()) return -1;
  return response.status();
}

// Polls until the status is `want` or `timeout` passes; the last status.
int WaitForHealth(int port, int want, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int status = -1;
  while (absl::Now() < deadline) {
    status = CheckHealth(port);
    if (status == want) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return status;
}

class WorkerHealthTest : public ::testing::Test {
 protected:
  void TearDown() override {
    Stop(worker_);
    Stop(coordinator_);
  }

  pid_t worker_ = -1;
  pid_t coordinator_ = -1;
};

TEST_F(WorkerHealthTest, NotServingUntilRegistered) {
  const std::string dir = absl::StrCat(TempDir(), "/worker_health_", getpid());
  const int coordinator_port = FreePort();
  const int worker_port = FreePort();
  const int health_port = FreePort();
  ASSERT_GT(coordinator_port, 0);
  ASSERT_GT(worker_port, 0);
  ASSERT_GT(health_port, 0);

  // Nothing listens on the coordinator's port yet: the worker keeps trying.
  worker_ = Spawn({kWorkerBinary,
                   absl::StrCat("--coordinator=127.0.0.1:", coordinator_port),
                   absl::StrCat("--listen=127.0.0.1:", worker_port),
                   absl::StrCat("--health-listen=127.0.0.1:", health_port),
                   "--device=cpu", "--coordinator-timeout=60s"},
                  dir + "_worker.out", dir + "_worker.err");
  ASSERT_GT(worker_, 0);

  // The health port answers once the worker serves; give it a moment after
  // the first answer so the status set right after start-up is in place.
  ASSERT_NE(WaitForHealth(health_port, HealthCheckResponse::NOT_SERVING,
                          absl::Seconds(20)),
            -1)
      << "the worker's health port never answered: "
      << ReadFile(dir + "_worker.err");
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(CheckHealth(health_port), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(CheckHealth(worker_port), HealthCheckResponse::NOT_SERVING);
  ASSERT_EQ(waitpid(worker_, nullptr, WNOHANG), 0)
      << "the worker exited: " << ReadFile(dir + "_worker.err");

  coordinator_ = Spawn({kCoordinatorBinary,
                        absl::StrCat("--listen=127.0.0.1:", coordinator_port),
                        absl::StrCat("--data-dir=", dir, "_data")},
                       dir + "_coordinator.out", dir + "_coordinator.err");
  ASSERT_GT(coordinator_, 0);

  EXPECT_EQ(WaitForHealth(health_port, HealthCheckResponse::SERVING,
                          absl::Seconds(30)),
            HealthCheckResponse::SERVING)
      << ReadFile(dir + "_worker.err") << ReadFile(dir + "_coordinator.err");
  EXPECT_EQ(CheckHealth(worker_port), HealthCheckResponse::SERVING);
}

TEST_F(WorkerHealthTest, StandaloneWorkerServesAtOnce) {
  const std::string dir =
      absl::StrCat(TempDir(), "/worker_health_standalone_", getpid());
  const int health_port = FreePort();
  ASSERT_GT(health_port, 0);
  worker_ = Spawn(
      {kWorkerBinary, "--listen=127.0.0.1:0",
       absl::StrCat("--health-listen=127.0.0.1:", health_port), "--device=cpu"},
      dir + "_worker.out", dir + "_worker.err");
  ASSERT_GT(worker_, 0);
  EXPECT_EQ(WaitForHealth(health_port, HealthCheckResponse::SERVING,
                          absl::Seconds(20)),
            HealthCheckResponse::SERVING)
      << ReadFile(dir + "_worker.err");
}

// The port file is how launchers find a worker on port 0: one that cannot
// be written fails the start instead of leaving them waiting.
TEST(WorkerStartTest, AnUnwritablePortFileFailsTheStartNamingTheFlag) {
  const std::string dir =
      absl::StrCat(TempDir(), "/worker_port_file_", getpid());
  std::string out;
  EXPECT_EQ(RunCommand({kWorkerBinary, "--listen=127.0.0.1:0", "--device=cpu",
                        "--port-file=" + dir + "/missing/worker.port"},
                       absl::Seconds(30), &out),
            1)
      << out;
  EXPECT_NE(out.find("--port-file: cannot write"), std::string::npos) << out;
}

// SIGTERM stops a running worker cleanly (exit 0), after it wrote its port.
TEST(WorkerStartTest, SigtermStopsTheWorkerWithExitZero) {
  const std::string dir = absl::StrCat(TempDir(), "/worker_sigterm_", getpid());
  const std::string port_file = dir + "_worker.port";
  const pid_t worker = Spawn({kWorkerBinary, "--listen=127.0.0.1:0",
                              "--device=cpu", "--port-file=" + port_file},
                             dir + "_worker.out", dir + "_worker.err");
  ASSERT_GT(worker, 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (ReadFile(port_file).empty() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_FALSE(ReadFile(port_file).empty()) << ReadFile(dir + "_worker.err");
  kill(worker, SIGTERM);
  const int code = WaitFor(worker, absl::Seconds(20));
  if (code == -2) Stop(worker);
  EXPECT_EQ(code, 0) << ReadFile(dir + "_worker.err");
}

}  // namespace
}  // namespace shardd
