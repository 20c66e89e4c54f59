#ifndef SHARDD_SERVER_STATE_STORE_H_
#define SHARDD_SERVER_STATE_STORE_H_

// The coordinator's durable state: a small typed key-value store on SQLite
// in WAL mode under --data-dir. Tables hold serialized records (models with
// their plans, jobs and their committed step counters, membership epochs,
// the checkpoint index); a write is acknowledged only after SQLite has
// committed it with synchronous=FULL, so a kill -9 (or a power cut, as far
// as the disk keeps its promises) at any moment loses nothing acknowledged:
// on reopen the store holds every acknowledged write and no partial one.
//
// Transport-free and independent of what the records mean: the coordinator
// decides the tables and encodings (protos, serialized). Thread-safe (one
// connection behind a mutex; the coordinator's write rate is a few per
// step).

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

struct sqlite3;

namespace shardd {

class StateStore {
 public:
  // One write of a Commit: value set (put) or the key removed (erase).
  struct Write {
    std::string table;
    std::string key;
    std::optional<std::string> value;  // nullopt: erase.
  };

  // Opens (creating when missing) the database file at `path` and checks
  // its integrity. Errors: INVALID_ARGUMENT (empty path), UNAVAILABLE (the
  // file cannot be opened or locked, e.g. its directory does not exist or
  // another coordinator holds it), DATA_LOSS (not a shardd state database,
  // a newer schema, or SQLite reports corruption).
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(
      const std::string& path);

  ~StateStore();
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  // Applies every write atomically (all or none) and returns once durable.
  // Table and key must be non-empty and at most 256 bytes; values at most
  // 1 GiB. Errors: INVALID_ARGUMENT (naming the write and field),
  // UNAVAILABLE (disk full, I/O error: nothing was applied).
  absl::Status Commit(const std::vector<Write>& writes);
  absl::Status Put(absl::string_view table, absl::string_view key,
                   absl::string_view value);
  absl::Status Erase(absl::string_view table, absl::string_view key);

  // NOT_FOUND when absent.
  absl::StatusOr<std::string> Get(absl::string_view table,
                                  absl::string_view key) const;
  // Every (key, value) of a table in insertion order (the order of the
  // first Put of each key; a key erased and put again counts as new).
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> List(
      absl::string_view table) const;

  const std::string& path() const { return path_; }

 private:
  StateStore(sqlite3* db, std::string path);
  absl::Status ExecLocked(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  mutable absl::Mutex mu_;
  sqlite3* const db_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardd

#endif  // SHARDD_SERVER_STATE_STORE_H_
