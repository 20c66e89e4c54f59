// Network faults between the coordinator and a worker, with real links: the
// worker runs in its own network namespace joined to the coordinator's by a
// veth pair (ip netns, as root). Cutting the link (the host end down) must
// be detected within the heartbeat timeout, fail a running job with a clear
// error within its deadline, and after the link is restored the worker must
// rejoin by itself and train again. Every wait is bounded; teardown removes
// the namespace, the link and every process.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "gtest/gtest.h"
#include "proto/coordinator.pb.h"
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
using ::testing::HasSubstr;

constexpr char kCoordinatorBinary[] = "server/shardd-coordinator";
constexpr char kWorkerBinary[] = "worker/shardd-worker";
constexpr char kShardctlBinary[] = "client/shardctl";
constexpr char kSmallMoe[] = "tests/data/small_moe.json";

class NetworkFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root for ip netns";
    const int id = getpid() % 100000;
    ns_ = absl::StrCat("shd", id);
    host_if_ = absl::StrCat("shdh", id);
    ns_if_ = absl::StrCat("shdn", id);
    const int subnet = getpid() % 250 + 1;
    host_ip_ = absl::StrCat("10.213.", subnet, ".1");
    ns_ip_ = absl::StrCat("10.213.", subnet, ".2");
    std::string out;
    if (Ip({"netns", "add", ns_}, &out) != 0) {
      GTEST_SKIP() << "ip netns add failed (no CAP_SYS_ADMIN here?): " << out;
    }
    created_ = true;
    ASSERT_EQ(
        Ip({"link", "add", host_if_, "type", "veth", "peer", "name", ns_if_},
           &out),
        0)
        << out;
    ASSERT_EQ(Ip({"link", "set", ns_if_, "netns", ns_}, &out), 0) << out;
    ASSERT_EQ(Ip({"addr", "add", host_ip_ + "/30", "dev", host_if_}, &out), 0)
        << out;
    ASSERT_EQ(Ip({"link", "set", host_if_, "up"}, &out), 0) << out;
    ASSERT_EQ(InNs({"ip", "addr", "add", ns_ip_ + "/30", "dev", ns_if_}, &out),
              0)
        << out;
    ASSERT_EQ(InNs({"ip", "link", "set", ns_if_, "up"}, &out), 0) << out;
    ASSERT_EQ(InNs({"ip", "link", "set", "lo", "up"}, &out), 0) << out;

    grpc_init();
    dir_ = absl::StrCat(TempDir(), "/netfault_", getpid());
    const std::string data_dir = dir_ + "/data";
    coordinator_ =
        // The veth link's addresses exist only between this test's two
        // network namespaces: plaintext is fine (--insecure).
        Spawn(
            {kCoordinatorBinary, absl::StrCat("--listen=", host_ip_, ":0"),
             absl::StrCat("--data-dir=", data_dir), "--workers=1",
             "--heartbeat-timeout=1s", "--collective-timeout=3s", "--insecure"},
            dir_ + "_coordinator.out", dir_ + "_coordinator.err");
    ASSERT_GT(coordinator_, 0);
    const int port = WaitForPortFile(data_dir, coordinator_, absl::Seconds(30));
    ASSERT_GT(port, 0) << ReadFile(dir_ + "_coordinator.err");
    address_ = absl::StrCat(host_ip_, ":", port);
    // `ip netns exec` execs the worker: the pid is the worker's.
    worker_ = Spawn({"ip", "netns", "exec", ns_, kWorkerBinary,
                     absl::StrCat("--coordinator=", address_),
                     absl::StrCat("--listen=", ns_ip_, ":0"),
                     absl::StrCat("--collective_bind=", ns_ip_), "--device=cpu",
                     "--requested-rank=0", "--insecure"},
                    dir_ + "_worker.out", dir_ + "_worker.err");
    ASSERT_GT(worker_, 0);
    auto client = CoordinatorClient::Connect(address_, absl::Seconds(10));
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    ASSERT_TRUE(WaitForAlive(true, absl::Seconds(30)))
        << ReadFile(dir_ + "_worker.err");
  }

  void TearDown() override {
    client_.reset();
    if (link_down_) Ip({"link", "set", host_if_, "up"}, nullptr);
    Stop(worker_);
    Stop(coordinator_);
    if (created_) {
      // Deleting the namespace deletes its veth end, and with it the pair.
      Ip({"netns", "del", ns_}, nullptr);
      Ip({"link", "del", host_if_}, nullptr);
      grpc_shutdown();
    }
  }

  int Ip(std::vector<std::string> args, std::string* out) {
    args.insert(args.begin(), "ip");
    return RunCommand(args, absl::Seconds(10), out);
  }
  int InNs(std::vector<std::string> args, std::string* out) {
    args.insert(args.begin(), {"ip", "netns", "exec", ns_});
    return RunCommand(args, absl::Seconds(10), out);
  }

  // Whether the coordinator's status satisfies `done` within `timeout`
  // (polled; a failed GetStatus counts as not yet).
  bool WaitForStatus(
      const std::function<bool(const v1::GetStatusResponse&)>& done,
      absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      auto status = client_->GetStatus();
      if (status.ok() && done(*status)) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  // Whether rank 0 reaches the wanted liveness within `timeout`.
  bool WaitForAlive(bool alive, absl::Duration timeout) {
    return WaitForStatus(
        [alive](const v1::GetStatusResponse& status) {
          bool seen = false;
          for (const v1::WorkerInfo& worker : status.workers()) {
            if (worker.rank() == 0) seen = worker.alive();
          }
          return seen == alive;
        },
        timeout);
  }

  // Whether a job of `total_steps` steps has finished at least one step and
  // not all of them within `timeout`. Cutting the link only once a job is
  // seen mid-run keeps the test independent of how fast steps run here.
  bool WaitForJobMidRun(int total_steps, absl::Duration timeout) {
    return WaitForStatus(
        [total_steps](const v1::GetStatusResponse& status) {
          for (const v1::JobInfo& job : status.jobs()) {
            if (job.total_steps() == total_steps && job.steps_done() >= 1 &&
                job.steps_done() < total_steps) {
              return true;
            }
          }
          return false;
        },
        timeout);
  }

  // recoveries: --max-recoveries (0: fail on the first fault).
  std::vector<std::string> Train(int steps, int recoveries = 0) {
    return {kShardctlBinary,
            "train",
            "--coordinator",
            address_,
            "--model",
            kSmallMoe,
            "--steps",
            absl::StrCat(steps),
            "--global-batch",
            "8",
            "--seq",
            "32",
            "--dp",
            "1",
            "--json",
            "--max-recoveries",
            absl::StrCat(recoveries)};
  }

  std::string ns_, host_if_, ns_if_, host_ip_, ns_ip_, dir_, address_;
  bool created_ = false;
  bool link_down_ = false;
  pid_t coordinator_ = -1;
  pid_t worker_ = -1;
  std::unique_ptr<CoordinatorClient> client_;
};

TEST_F(NetworkFaultTest,
       CutLinkFailsOrInterruptsTheJobCleanlyAndTheWorkerRejoins) {
  std::string out;
  // Sanity: training works across the veth link.
  ASSERT_EQ(RunCommand(Train(3), absl::Seconds(120), &out), 0) << out;

  // A long job, then the link cut under it.
  const std::string job_base = dir_ + "_long";
  const pid_t job = Spawn(Train(100000), job_base + ".out", job_base + ".err");
  ASSERT_GT(job, 0);
  ASSERT_TRUE(WaitForJobMidRun(100000, absl::Seconds(60)))
      << ReadFile(job_base + ".err");
  ASSERT_EQ(WaitFor(job, absl::ZeroDuration()), -2)
      << "the job ended before the cut: " << ReadFile(job_base + ".err");
  const absl::Time cut = absl::Now();
  ASSERT_EQ(Ip({"link", "set", host_if_, "down"}, &out), 0) << out;
  link_down_ = true;

  // Detection: the worker is declared dead within the heartbeat timeout
  // (1 s) plus scheduling slack.
  ASSERT_TRUE(WaitForAlive(false, absl::Seconds(10)));
  const absl::Duration detected = absl::Now() - cut;
  // Clean failure: the job fails with a message, within its deadline
  // (collective timeout 3 s + 30 s RPC slack).
  const int code = WaitFor(job, absl::Seconds(60));
  if (code == -2) {
    kill(job, SIGKILL);
    waitpid(job, nullptr, 0);
  }
  const absl::Duration failed = absl::Now() - cut;
  EXPECT_EQ(code, 1) << ReadFile(job_base + ".err");
  EXPECT_THAT(ReadFile(job_base + ".err"), HasSubstr("rank 0"));
  // A new job while the link is down is refused at once, naming the rank.
  EXPECT_EQ(RunCommand(Train(2), absl::Seconds(30), &out), 1);
  EXPECT_THAT(out, HasSubstr("rank"));

  // Restore: the worker re-registers by itself and trains again.
  ASSERT_EQ(Ip({"link", "set", host_if_, "up"}, &out), 0) << out;
  link_down_ = false;
  const absl::Time restored = absl::Now();
  ASSERT_TRUE(WaitForAlive(true, absl::Seconds(30)))
      << ReadFile(dir_ + "_worker.err");
  const absl::Duration rejoined = absl::Now() - restored;
  EXPECT_EQ(RunCommand(Train(3), absl::Seconds(120), &out), 0) << out;
  std::printf(
      "[netfault] dead after %.2f s, job failed after %.2f s, rejoined "
      "%.2f s after the link came back\n",
      absl::ToDoubleSeconds(detected), absl::ToDoubleSeconds(failed),
      absl::ToDoubleSeconds(rejoined));

  // A job allowed to recover waits out the cut and goes on from the step
  // the worker still holds. 2000 steps take a few seconds here: long enough
  // to be cut mid-run on a fast machine, short enough to finish in the wait.
  const std::string recovering_base = dir_ + "_recovering";
  constexpr int kRecoveringSteps = 2000;
  const pid_t recovering =
      Spawn(Train(kRecoveringSteps, /*recoveries=*/3), recovering_base + ".out",
            recovering_base + ".err");
  ASSERT_GT(recovering, 0);
  ASSERT_TRUE(WaitForJobMidRun(kRecoveringSteps, absl::Seconds(60)))
      << ReadFile(recovering_base + ".err");
  ASSERT_EQ(Ip({"link", "set", host_if_, "down"}, &out), 0) << out;
  link_down_ = true;
  ASSERT_TRUE(WaitForAlive(false, absl::Seconds(10)));
  ASSERT_EQ(Ip({"link", "set", host_if_, "up"}, &out), 0) << out;
  link_down_ = false;
  const int recovered = WaitFor(recovering, absl::Seconds(180));
  if (recovered == -2) {
    kill(recovering, SIGKILL);
    waitpid(recovering, nullptr, 0);
  }
  EXPECT_EQ(recovered, 0) << ReadFile(recovering_base + ".err");
  const std::string summary = ReadFile(recovering_base + ".out");
  EXPECT_THAT(summary, HasSubstr("interrupted at step"));
  EXPECT_THAT(summary, HasSubstr("every worker still held step"));
}

}  // namespace
}  // namespace shardd
