#include "worker/comm/kv_gloo_store.h"

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/gloo_status.h"
#include "worker/comm/in_memory_kv_client.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

// Runs `fn`, which must throw; returns the status Gloo's boundary maps the
// exception to.
template <typename Fn>
absl::Status ThrownStatus(Fn fn) {
  try {
    fn();
  } catch (...) {
    return CurrentGlooExceptionToStatus("test");
  }
  return absl::OkStatus();
}

// A client whose every call fails, to check errors keep their code.
class FailingClient : public KeyValueClient {
 public:
  absl::Status Set(const std::string&, const std::string&) override {
    return absl::UnavailableError("coordinator down");
  }
  absl::StatusOr<std::string> Get(const std::string&, absl::Duration) override {
    return absl::UnavailableError("coordinator down");
  }
  absl::Status Delete(const std::string&, bool) override {
    return absl::UnavailableError("coordinator down");
  }
};

TEST(KvGlooStoreTest, SetThenGetRoundTripsBinaryData) {
  InMemoryKeyValueClient kv;
  KvGlooStore store(&kv, absl::Seconds(1));
  const std::vector<char> data = {'a', '\0', static_cast<char>(0xff), 'z'};
  store.set("k", data);
  EXPECT_EQ(store.get("k"), data);
  // The bytes reach the client unchanged.
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string raw,
                              kv.Get("k", absl::ZeroDuration()));
  EXPECT_EQ(raw, std::string(data.begin(), data.end()));
}

TEST(KvGlooStoreTest, SetOverwrites) {
  InMemoryKeyValueClient kv;
  KvGlooStore store(&kv, absl::Seconds(1));
  store.set("k", {'1'});
  store.set("k", {'2', '3'});
  EXPECT_EQ(store.get("k"), std::vector<char>({'2', '3'}));
}

TEST(KvGlooStoreTest, GetOfMissingKeyThrowsDeadlineExceededAfterTimeout) {
  InMemoryKeyValueClient kv;
  KvGlooStore store(&kv, absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  const absl::Status status = ThrownStatus([&] { store.get("missing"); });
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               HasSubstr("missing")));
  EXPECT_GE(elapsed, absl::Milliseconds(95));
  EXPECT_LT(elapsed, absl::Seconds(2));
}

TEST(KvGlooStoreTest, WaitReturnsOnceAnotherThreadSetsEveryKey) {
  InMemoryKeyValueClient kv;
  KvGlooStore store(&kv, absl::Seconds(5));
  const absl::Time start = absl::Now();
  std::thread setter([&kv] {
    absl::SleepFor(absl::Milliseconds(30));
    ASSERT_TRUE(kv.Set("a", "1").ok());
    absl::SleepFor(absl::Milliseconds(30));
    ASSERT_TRUE(kv.Set("b", "2").ok());
  });
  EXPECT_THAT(ThrownStatus([&] { store.wait({"a", "b"}); }), IsOk());
  // It really waited for the second key.
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(55));
  setter.join();
}

TEST(KvGlooStoreTest, WaitUsesTheShorterOfItsTimeoutAndTheStoreTimeout) {
  InMemoryKeyValueClient kv;
  ASSERT_TRUE(kv.Set("present", "x").ok());
  {
    KvGlooStore store(&kv, absl::Seconds(10));
    const absl::Time start = absl::Now();
    const absl::Status status = ThrownStatus([&] {
      store.wait({"present", "never"}, std::chrono::milliseconds(80));
    });
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                                 HasSubstr("never")));
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  }
  {
    // Gloo's PrefixStore passes 30 s; the store's own 80 ms wins.
    KvGlooStore store(&kv, absl::Milliseconds(80));
    gloo::rendezvous::PrefixStore prefixed("p", store);
    const absl::Time start = absl::Now();
    const absl::Status status = ThrownStatus([&] { prefixed.wait({"never"}); });
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                                 HasSubstr("p/never")));
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  }
}

TEST(KvGlooStoreTest, PrefixStoreWritesPrefixedKeysToTheClient) {
  InMemoryKeyValueClient kv;
  KvGlooStore store(&kv, absl::Seconds(1));
  gloo::rendezvous::PrefixStore prefixed("job1/shard", store);
  prefixed.set("0", {'x'});
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string raw,
                              kv.Get("job1/shard/0", absl::ZeroDuration()));
  EXPECT_EQ(raw, "x");
  EXPECT_EQ(prefixed.get("0"), std::vector<char>({'x'}));
}

TEST(KvGlooStoreTest, ClientErrorsKeepTheirCode) {
  FailingClient client;
  KvGlooStore store(&client, absl::Seconds(1));
  EXPECT_THAT(
      ThrownStatus([&] { store.set("k", {'v'}); }),
      StatusIs(absl::StatusCode::kUnavailable, HasSubstr("coordinator down")));
  EXPECT_THAT(ThrownStatus([&] { store.get("k"); }),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("'k'")));
  EXPECT_THAT(ThrownStatus([&] { store.wait({"k"}); }),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("'k'")));
}

TEST(KvGlooStoreTest, ThrownErrorIsAGlooIoException) {
  // Gloo's own code treats it like any other I/O failure.
  FailingClient client;
  KvGlooStore store(&client, absl::Seconds(1));
  bool caught = false;
  try {
    store.set("k", {'v'});
  } catch (const gloo::IoException& e) {
    caught = true;
    EXPECT_THAT(e.what(), HasSubstr("UNAVAILABLE"));
  }
  EXPECT_TRUE(caught);
}

}  // namespace
}  // namespace shardd
