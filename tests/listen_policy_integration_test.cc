// Locked by default, end to end: the real shardd-coordinator and
// shardd-worker refuse to listen on an address other machines can reach
// without TLS and tokens, start with them, and start with --insecure only
// after a warning that `shardctl status` shows too. The listeners bind
// 0.0.0.0:0 (any free port) but every call goes over loopback; every wait
// is bounded and every process is stopped.

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"

namespace shardd {
namespace {

using ::shardd::testing_util::ReadFile;
using ::shardd::testing_util::RunCommand;
using ::shardd::testing_util::Spawn;
using ::shardd::testing_util::Stop;
using ::shardd::testing_util::TempDir;
using ::shardd::testing_util::WaitFor;
using ::shardd::testing_util::WaitForPortFile;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kCoordinator[] = "server/shardd-coordinator";
constexpr char kWorker[] = "worker/shardd-worker";
constexpr char kShardctl[] = "client/shardctl";
constexpr char kCertScript[] = "tools/make_test_certs.sh";

class ListenPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(TempDir(), "/listen_policy_", getpid());
  }
  void TearDown() override {
    for (pid_t pid : pids_) Stop(pid);
  }

  // Runs a daemon that must refuse to start: exit code 2, its stderr.
  std::string Refused(std::vector<std::string> argv, const std::string& name) {
    const std::string err = absl::StrCat(dir_, "_", name, ".err");
    const pid_t pid = Spawn(argv, absl::StrCat(dir_, "_", name, ".out"), err);
    EXPECT_GT(pid, 0);
    const int code = WaitFor(pid, absl::Seconds(30));
    if (code == -2) Stop(pid);
    EXPECT_EQ(code, 2) << ReadFile(err);
    return ReadFile(err);
  }

  // Starts a coordinator with `flags` on 0.0.0.0:0; returns its loopback
  // address ("" when it did not start).
  std::string StartCoordinator(std::vector<std::string> flags,
                               const std::string& name) {
    const std::string data = absl::StrCat(dir_, "_", name, "_data");
    std::vector<std::string> argv = {kCoordinator, "--listen=0.0.0.0:0",
                                     absl::StrCat("--data-dir=", data)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const pid_t pid = Spawn(argv, absl::StrCat(dir_, "_", name, ".out"),
                            absl::StrCat(dir_, "_", name, ".err"));
    EXPECT_GT(pid, 0);
    pids_.push_back(pid);
    const int port = WaitForPortFile(data, pid, absl::Seconds(30));
    EXPECT_GT(port, 0) << ReadFile(absl::StrCat(dir_, "_", name, ".err"));
    return port > 0 ? absl::StrCat("127.0.0.1:", port) : "";
  }

  std::string Status(const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {kShardctl, "status"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    std::string out;
    EXPECT_EQ(RunCommand(argv, absl::Seconds(30), &out), 0) << out;
    return out;
  }

  std::string dir_;
  std::vector<pid_t> pids_;
};

TEST_F(ListenPolicyTest, CoordinatorRefusesAReachablePlaintextListener) {
  const std::string err =
      Refused({kCoordinator, "--listen=0.0.0.0:0"}, "coordinator_open");
  EXPECT_THAT(err,
              AllOf(HasSubstr("--listen=0.0.0.0:0"),
                    HasSubstr("--tls-cert and --tls-key"),
                    HasSubstr("--client-token-file"),
                    HasSubstr("--worker-token-file"), HasSubstr("--insecure")));
  // IPv6's any address too, and a token alone does not unlock it.
  const std::string token = dir_ + "_token";
  ASSERT_EQ(RunCommand({"/bin/sh", "-c", absl::StrCat("echo secret > ", token)},
                       absl::Seconds(10)),
            0);
  const std::string v6 = Refused({kCoordinator, "--listen=[::]:0",
                                  absl::StrCat("--client-token-file=", token),
                                  absl::StrCat("--worker-token-file=", token)},
                                 "coordinator_v6");
  EXPECT_THAT(v6, AllOf(HasSubstr("--listen=[::]:0"),
                        HasSubstr("without --tls-cert and --tls-key anyone"),
                        Not(HasSubstr("--client-token-file"))));
}

TEST_F(ListenPolicyTest, WorkerRefusesAReachablePlaintextListener) {
  const std::string err =
      Refused({kWorker, "--listen=0.0.0.0:0", "--device=cpu"}, "worker_open");
  EXPECT_THAT(err,
              AllOf(HasSubstr("--listen=0.0.0.0:0"),
                    HasSubstr("--tls-cert and --tls-key"),
                    HasSubstr("--worker-token-file"), HasSubstr("--insecure")));
}

TEST_F(ListenPolicyTest, TlsAndTokensUnlockAReachableListener) {
  const std::string certs = dir_ + "_certs";
  ASSERT_EQ(RunCommand({"/bin/bash", kCertScript, certs}, absl::Seconds(60)),
            0);
  const std::string address = StartCoordinator(
      {absl::StrCat("--tls-cert=", certs, "/server.pem"),
       absl::StrCat("--tls-key=", certs, "/server.key"),
       absl::StrCat("--client-token-file=", certs, "/client.token"),
       absl::StrCat("--worker-token-file=", certs, "/worker.token")},
      "coordinator_tls");
  ASSERT_FALSE(address.empty());
  const std::string out = Status(
      {"--coordinator", address, absl::StrCat("--tls-ca=", certs, "/ca.pem"),
       absl::StrCat("--token-file=", certs, "/client.token")});
  EXPECT_THAT(out, Not(HasSubstr("WARNING")));
  EXPECT_THAT(ReadFile(dir_ + "_coordinator_tls.err"),
              Not(HasSubstr("WARNING")));
}

TEST_F(ListenPolicyTest, InsecureStartsWithAWarningStatusShows) {
  const std::string address =
      StartCoordinator({"--insecure"}, "coordinator_insecure");
  ASSERT_FALSE(address.empty());
  EXPECT_THAT(ReadFile(dir_ + "_coordinator_insecure.err"),
              AllOf(HasSubstr("WARNING: shardd-coordinator serves "
                              "0.0.0.0:0 without TLS or tokens"),
                    HasSubstr("--insecure")));
  // A worker on a reachable plaintext port joins only with --insecure too.
  const std::string port_file = dir_ + "_worker.port";
  const pid_t worker = Spawn(
      {kWorker, absl::StrCat("--coordinator=", address), "--listen=0.0.0.0:0",
       "--insecure", absl::StrCat("--port-file=", port_file)},
      dir_ + "_worker.out", dir_ + "_worker.err");
  ASSERT_GT(worker, 0);
  pids_.push_back(worker);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (ReadFile(port_file).empty() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_FALSE(ReadFile(port_file).empty()) << ReadFile(dir_ + "_worker.err");
  EXPECT_THAT(ReadFile(dir_ + "_worker.err"),
              HasSubstr("WARNING: shardd-worker serves 0.0.0.0:0 without TLS "
                        "or tokens"));
  const std::string out = Status({"--coordinator", address});
  EXPECT_THAT(out, AllOf(HasSubstr("WARNING      shardd-coordinator serves "
                                   "0.0.0.0:0 without TLS or tokens"),
                         HasSubstr("INSECURE (no TLS or tokens, --insecure)")));
  const std::string json = Status({"--coordinator", address, "--json"});
  EXPECT_THAT(json,
              AllOf(HasSubstr("\"insecure\": \"shardd-coordinator serves"),
                    HasSubstr("\"insecure\": true")));
}

}  // namespace
}  // namespace shardd
