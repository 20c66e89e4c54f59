#include "common/daemon/listen_policy.h"

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(ListenPolicyTest, LoopbackAddresses) {
  for (const char* address :
       {"127.0.0.1:0", "127.0.0.1:7070", "127.8.9.10:1", "localhost:7070",
        "LOCALHOST:1", "[::1]:7070", "::1", "unix:/tmp/shardd.sock",
        "ipv4:127.0.0.1:5", "ipv6:[::1]:5"}) {
    EXPECT_TRUE(IsLoopbackListenAddress(address)) << address;
  }
  for (const char* address :
       {"0.0.0.0:7070", "[::]:7070", "10.0.0.5:7070", "128.0.0.1:1",
        "myhost:7070", "[2001:db8::1]:7070", ":7070", "ipv4:0.0.0.0:5",
        "[::ffff:10.0.0.1]:1"}) {
    EXPECT_FALSE(IsLoopbackListenAddress(address)) << address;
  }
}

ListenerGuard Guard(const char* address, bool tls, bool client, bool worker,
                    bool insecure) {
  ListenerGuard guard;
  guard.address = address;
  guard.tls = tls;
  guard.tokens = {{"--client-token-file", client},
                  {"--worker-token-file", worker}};
  guard.insecure = insecure;
  return guard;
}

TEST(ListenPolicyTest, ReachableListenersNeedTlsAndEveryTokenOrInsecure) {
  // Loopback: nothing needed, nothing to warn about.
  EXPECT_THAT(CheckListener(Guard("127.0.0.1:0", false, false, false, false)),
              IsOkAndHolds(false));
  // Reachable and secured: served, no warning.
  EXPECT_THAT(CheckListener(Guard("0.0.0.0:7070", true, true, true, false)),
              IsOkAndHolds(false));
  // Each missing piece is refused, naming it.
  EXPECT_THAT(
      CheckListener(Guard("0.0.0.0:7070", false, false, false, false)),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("--listen=0.0.0.0:7070"),
                     HasSubstr("--tls-cert and --tls-key, "
                               "--client-token-file, --worker-token-file"),
                     HasSubstr("--insecure"))));
  EXPECT_THAT(CheckListener(Guard("10.1.2.3:7070", true, true, false, false)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("without --worker-token-file anyone"),
                             ::testing::Not(HasSubstr("--tls-cert")))));
  EXPECT_THAT(CheckListener(Guard("[::]:7070", false, true, true, false)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("without --tls-cert and --tls-key anyone")));
  // --insecure: served, and reported as insecure.
  EXPECT_THAT(CheckListener(Guard("0.0.0.0:7070", false, false, true, true)),
              IsOkAndHolds(true));
  EXPECT_THAT(InsecureListenerWarning("shardd-worker", "0.0.0.0:1"),
              AllOf(HasSubstr("shardd-worker serves 0.0.0.0:1"),
                    HasSubstr("--insecure")));
}

}  // namespace
}  // namespace shardd
