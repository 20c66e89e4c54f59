#include "server/kv_store.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Collects one GetAsync completion.
struct Result {
  absl::Notification done;
  absl::StatusOr<std::string> value;
  KvStore::GetCallback Callback() {
    return [this](absl::StatusOr<std::string> v) {
      value = std::move(v);
      done.Notify();
    };
  }
};

TEST(KvStoreTest, PutGetOverwriteAndAlreadyExists) {
  KvStore store;
  SHARDD_ASSERT_OK(store.Put("a", "1", /*overwrite=*/false));
  EXPECT_THAT(store.Put("a", "2", /*overwrite=*/false),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("'a'")));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string v,
                              store.Get("a", absl::ZeroDuration()));
  EXPECT_EQ(v, "1");
  SHARDD_ASSERT_OK(store.Put("a", "22", /*overwrite=*/true));
  SHARDD_ASSERT_OK_AND_ASSIGN(v, store.Get("a", absl::ZeroDuration()));
  EXPECT_EQ(v, "22");
  EXPECT_EQ(store.size(), 1u);
  EXPECT_EQ(store.total_bytes(), 3u);  // "a" + "22".
}

TEST(KvStoreTest, AbsentKeyWithoutWaitIsNotFound) {
  KvStore store;
  EXPECT_THAT(store.Get("missing", absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
  EXPECT_THAT(store.Get("", absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
  EXPECT_THAT(store.Put("", "x", true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
}

TEST(KvStoreTest, WaitingGetIsCompletedByPutWithoutBlocking) {
  KvStore store;
  Result first;
  Result second;
  const uint64_t h1 =
      store.GetAsync("rdv/0", absl::Seconds(10), first.Callback());
  const uint64_t h2 =
      store.GetAsync("rdv/0", absl::Seconds(10), second.Callback());
  // GetAsync returned without waiting for the key.
  EXPECT_NE(h1, 0u);
  EXPECT_NE(h2, 0u);
  EXPECT_FALSE(first.done.HasBeenNotified());
  EXPECT_EQ(store.waiting(), 2u);
  std::thread putter([&] {
    absl::SleepFor(absl::Milliseconds(20));
    SHARDD_EXPECT_OK(store.Put("rdv/0", "addr", false));
  });
  ASSERT_TRUE(first.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(second.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  putter.join();
  EXPECT_THAT(first.value, IsOk());
  EXPECT_EQ(*first.value, "addr");
  EXPECT_EQ(*second.value, "addr");
  EXPECT_EQ(store.waiting(), 0u);
  EXPECT_FALSE(store.CancelGet(h1));  // Already completed.
}

TEST(KvStoreTest, PresentKeyCompletesInline) {
  KvStore store;
  SHARDD_ASSERT_OK(store.Put("k", "v", false));
  Result result;
  EXPECT_EQ(store.GetAsync("k", absl::Seconds(1), result.Callback()), 0u);
  ASSERT_TRUE(result.done.HasBeenNotified());
  EXPECT_EQ(*result.value, "v");
}

TEST(KvStoreTest, WaitEndsWithDeadlineExceeded) {
  KvStore store;
  const absl::Time start = absl::Now();
  EXPECT_THAT(store.Get("never", absl::Milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("never"), HasSubstr("50ms"))));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(50));
  EXPECT_LT(took, absl::Seconds(3));
  EXPECT_EQ(store.waiting(), 0u);
  // A Put after the timeout does not resurrect the finished Get.
  SHARDD_EXPECT_OK(store.Put("never", "late", false));
}

TEST(KvStoreTest, CancelEndsTheWaitWithCancelled) {
  KvStore store;
  Result result;
  const uint64_t handle =
      store.GetAsync("k", absl::Seconds(30), result.Callback());
  EXPECT_TRUE(store.CancelGet(handle));
  ASSERT_TRUE(result.done.HasBeenNotified());
  EXPECT_THAT(result.value,
              StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  EXPECT_FALSE(store.CancelGet(handle));
  EXPECT_EQ(store.waiting(), 0u);
}

TEST(KvStoreTest, DestructorEndsWaitsWithUnavailable) {
  Result result;
  {
    KvStore store;
    store.GetAsync("k", absl::Hours(1), result.Callback());
  }
  ASSERT_TRUE(result.done.HasBeenNotified());
  EXPECT_THAT(result.value,
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("shutting")));
}

TEST(KvStoreTest, DeleteExactAndPrefix) {
  KvStore store;
  for (const char* key : {"gloo/0/a", "gloo/0/b", "gloo/1/a", "gloo0", "x"}) {
    SHARDD_ASSERT_OK(store.Put(key, "v", false));
  }
  EXPECT_EQ(store.Delete("gloo/0/", /*prefix=*/true), 2);
  EXPECT_EQ(store.Delete("gloo/1/a", /*prefix=*/false), 1);
  EXPECT_EQ(store.Delete("gloo/1/a", /*prefix=*/false), 0);
  EXPECT_EQ(store.Delete("nothing", /*prefix=*/true), 0);
  EXPECT_EQ(store.size(), 2u);  // "gloo0" and "x" remain.
  EXPECT_THAT(store.Get("gloo0", absl::ZeroDuration()), IsOk());
  EXPECT_EQ(store.total_bytes(), 5u + 1 + 1 + 1);
  EXPECT_EQ(store.Delete("", /*prefix=*/true), 2);
  EXPECT_EQ(store.total_bytes(), 0u);
}

TEST(KvStoreTest, LimitsNameTheLimit) {
  KvStoreOptions options;
  options.max_entries = 2;
  options.max_value_bytes = 8;
  options.max_key_bytes = 4;
  options.max_total_bytes = 12;
  options.max_waiters = 1;
  KvStore store(options);
  EXPECT_THAT(
      store.Put("k", std::string(9, 'x'), false),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("9 bytes"), HasSubstr("max_value_bytes"))));
  EXPECT_THAT(
      store.Put("kkkkk", "v", false),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_key_bytes")));
  SHARDD_ASSERT_OK(store.Put("a", std::string(8, 'x'), false));  // 9 bytes.
  // 9 + (1 + 3) = 13 > 12.
  EXPECT_THAT(store.Put("b", "xxx", false),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("max_total_bytes")));
  SHARDD_ASSERT_OK(store.Put("b", "x", false));  // 9 + 2 = 11.
  EXPECT_THAT(
      store.Put("c", "", false),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_entries")));
  // Overwriting is not a new entry; 9 + (1 + 2) = 12 fits.
  SHARDD_EXPECT_OK(store.Put("b", "xx", true));

  Result waiting;
  store.GetAsync("w", absl::Seconds(10), waiting.Callback());
  EXPECT_THAT(
      store.Get("w2", absl::Seconds(10)),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("max_waiters")));
}

TEST(KvStoreTest, ManyConcurrentWaitersAllWoken) {
  KvStore store;
  constexpr int kKeys = 16;
  constexpr int kWaitersPerKey = 4;
  absl::Mutex mu;
  int ok = 0;
  absl::Notification all;
  for (int k = 0; k < kKeys; ++k) {
    for (int w = 0; w < kWaitersPerKey; ++w) {
      store.GetAsync(absl::StrCat("k", k), absl::Seconds(10),
                     [&, k](absl::StatusOr<std::string> v) {
                       absl::MutexLock lock(&mu);
                       if (v.ok() && *v == absl::StrCat("v", k)) ++ok;
                       if (ok == kKeys * kWaitersPerKey) all.Notify();
                     });
    }
  }
  std::vector<std::thread> putters;
  for (int k = 0; k < kKeys; ++k) {
    putters.emplace_back([&, k] {
      SHARDD_EXPECT_OK(
          store.Put(absl::StrCat("k", k), absl::StrCat("v", k), false));
    });
  }
  for (std::thread& t : putters) t.join();
  ASSERT_TRUE(all.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(store.waiting(), 0u);
}

}  // namespace
}  // namespace shardd
