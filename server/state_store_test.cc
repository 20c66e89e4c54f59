#include "server/state_store.h"

#include <signal.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

std::string TempPath(const std::string& name) {
  static int counter = 0;
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/state_", getpid(), "_",
                      ++counter, "_", name);
}

TEST(StateStoreTest, PutGetListEraseAndReopen) {
  const std::string path = TempPath("basic.db");
  {
    SHARDD_ASSERT_OK_AND_ASSIGN(auto store, StateStore::Open(path));
    SHARDD_ASSERT_OK(store->Put("models", "m-2", "two"));
    SHARDD_ASSERT_OK(store->Put("models", "m-1", "one"));
    SHARDD_ASSERT_OK(store->Put("jobs", "j-1", std::string("\0bin\xff", 5)));
    SHARDD_ASSERT_OK(store->Put("models", "m-2", "two again"));  // Update.
    EXPECT_THAT(store->Get("models", "m-2"), IsOkAndHolds("two again"));
    EXPECT_THAT(store->Get("models", "m-3"),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("models/m-3")));
    // Insertion order of the first put; an update keeps the position.
    EXPECT_THAT(store->List("models"),
                IsOkAndHolds(
                    ElementsAre(Pair("m-2", "two again"), Pair("m-1", "one"))));
    SHARDD_ASSERT_OK(store->Erase("models", "m-2"));
    EXPECT_THAT(store->Put("models", "", "x"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("writes[0].key")));
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reopened, StateStore::Open(path));
  EXPECT_THAT(reopened->List("models"),
              IsOkAndHolds(ElementsAre(Pair("m-1", "one"))));
  EXPECT_THAT(reopened->Get("jobs", "j-1"),
              IsOkAndHolds(std::string("\0bin\xff", 5)));
}

TEST(StateStoreTest, CommitIsAllOrNothing) {
  SHARDD_ASSERT_OK_AND_ASSIGN(auto store, StateStore::Open(TempPath("tx.db")));
  SHARDD_ASSERT_OK(store->Put("jobs", "j-1", "step 4"));
  // The second write is invalid: the first must not be applied either.
  EXPECT_THAT(
      store->Commit({{"jobs", "j-1", std::string("step 5")},
                     {"jobs", std::string(300, 'k'), std::string("x")}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("writes[1].key")));
  EXPECT_THAT(store->Get("jobs", "j-1"), IsOkAndHolds("step 4"));
  SHARDD_ASSERT_OK(store->Commit({{"jobs", "j-1", std::string("step 5")},
                                  {"checkpoints", "j-1/5", std::string("p")},
                                  {"jobs", "j-0", std::nullopt}}));
  EXPECT_THAT(store->Get("jobs", "j-1"), IsOkAndHolds("step 5"));
  EXPECT_THAT(store->Get("checkpoints", "j-1/5"), IsOkAndHolds("p"));
}

TEST(StateStoreTest, RefusesASecondOpenerAndForeignFiles) {
  const std::string path = TempPath("locked.db");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto store, StateStore::Open(path));
  SHARDD_ASSERT_OK(store->Put("meta", "epoch", "3"));
  // Another process (here: another connection) cannot take the database.
  EXPECT_THAT(StateStore::Open(path).status(),
              StatusIs(absl::StatusCode::kUnavailable));

  // A SQLite file that is not ours.
  const std::string foreign = TempPath("foreign.db");
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(foreign.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "CREATE TABLE t(x)", nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close(db);
  EXPECT_THAT(StateStore::Open(foreign).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("not a shardd state database")));

  // Garbage where the database should be.
  const std::string garbage = TempPath("garbage.db");
  std::ofstream(garbage) << std::string(8192, 'z');
  EXPECT_THAT(StateStore::Open(garbage).status(),
              StatusIs(absl::StatusCode::kDataLoss));

  EXPECT_THAT(StateStore::Open("/nonexistent-dir/state.db").status(),
              StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(StateStore::Open("").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("path")));
}

// kill -9 while writing: every write acknowledged before the kill is there
// after reopening, and the store is consistent (each value whole).
TEST(StateStoreTest, KillNineLosesNothingAcknowledged) {
  for (int round = 0; round < 3; ++round) {
    const std::string path = TempPath(absl::StrCat("kill", round, ".db"));
    int pipe_fds[2];
    ASSERT_EQ(pipe(pipe_fds), 0);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      close(pipe_fds[0]);
      auto store = StateStore::Open(path);
      if (!store.ok()) _exit(3);
      for (int i = 0;; ++i) {
        // A value large enough to span several pages.
        const std::string value(4096 + i % 977,
                                static_cast<char>('a' + i % 26));
        if (!(*store)
                 ->Commit({{"steps", absl::StrCat("k", i), value},
                           {"meta", "last", absl::StrCat(i)}})
                 .ok()) {
          _exit(4);
        }
        // Acknowledge only after the commit returned.
        if (write(pipe_fds[1], &i, sizeof(i)) != sizeof(i)) _exit(5);
      }
    }
    close(pipe_fds[1]);
    absl::SleepFor(absl::Milliseconds(150 + 100 * round));
    ASSERT_EQ(kill(child, SIGKILL), 0);
    int acknowledged = -1;
    int value = 0;
    while (read(pipe_fds[0], &value, sizeof(value)) == sizeof(value)) {
      acknowledged = value;
    }
    close(pipe_fds[0]);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited " << WEXITSTATUS(status);
    ASSERT_GE(acknowledged, 0) << "nothing was written before the kill";

    SHARDD_ASSERT_OK_AND_ASSIGN(auto store, StateStore::Open(path));
    SHARDD_ASSERT_OK_AND_ASSIGN(auto rows, store->List("steps"));
    ASSERT_GE(static_cast<int>(rows.size()), acknowledged + 1);
    for (size_t i = 0; i < rows.size(); ++i) {
      ASSERT_EQ(rows[i].first, absl::StrCat("k", i));
      ASSERT_EQ(rows[i].second,
                std::string(4096 + i % 977, static_cast<char>('a' + i % 26)));
    }
    // The two writes of each commit went together.
    EXPECT_THAT(store->Get("meta", "last"),
                IsOkAndHolds(absl::StrCat(rows.size() - 1)));
    std::printf("[state] round %d: %d acknowledged, %zu stored\n", round,
                acknowledged + 1, rows.size());
  }
}

}  // namespace
}  // namespace shardd
