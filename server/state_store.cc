#include "server/state_store.h"

#include <sqlite3.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardd {
namespace {

// PRAGMA application_id of a shardd state database ("SHDD").
constexpr int kApplicationId = 0x53484444;
constexpr int kSchemaVersion = 1;
constexpr size_t kMaxNameBytes = 256;
constexpr size_t kMaxValueBytes = size_t{1} << 30;

absl::Status SqliteError(sqlite3* db, int rc, absl::string_view what) {
  const std::string message = absl::StrCat(
      what, ": SQLite error ", rc, " (",
      db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc), ")");
  switch (rc & 0xff) {
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return absl::DataLossError(message);
    default:
      return absl::UnavailableError(message);
  }
}

// A prepared statement, finalized on scope exit.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) : db_(db) {
    rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  absl::Status status(absl::string_view what) const {
    return rc_ == SQLITE_OK ? absl::OkStatus() : SqliteError(db_, rc_, what);
  }
  void BindText(int index, absl::string_view text) {
    sqlite3_bind_text(stmt_, index, text.data(), static_cast<int>(text.size()),
                      SQLITE_TRANSIENT);
  }
  void BindBlob(int index, absl::string_view bytes) {
    // A zero-length blob still binds as a blob, not NULL.
    sqlite3_bind_blob64(stmt_, index, bytes.empty() ? "" : bytes.data(),
                        bytes.size(), SQLITE_TRANSIENT);
  }
  int Step() { return sqlite3_step(stmt_); }
  std::string Column(int index) const {
    const void* data = sqlite3_column_blob(stmt_, index);
    const int size = sqlite3_column_bytes(stmt_, index);
    return data == nullptr ? std::string()
                           : std::string(static_cast<const char*>(data),
                                         static_cast<size_t>(size));
  }
  int ColumnInt(int index) const { return sqlite3_column_int(stmt_, index); }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_ = SQLITE_OK;
};

absl::Status CheckName(size_t index, absl::string_view field,
                       absl::string_view value) {
  if (value.empty() || value.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("writes[", index, "].", field, ": must be 1 to ",
                     kMaxNameBytes, " bytes, got ", value.size()));
  }
  return absl::OkStatus();
}

}  // namespace

StateStore::StateStore(sqlite3* db, std::string path)
    : path_(std::move(path)), db_(db) {}

StateStore::~StateStore() {
  absl::MutexLock lock(&mu_);
  sqlite3_close_v2(db_);
}

absl::Status StateStore::ExecLocked(const char* sql) {
  char* error = nullptr;
  const int rc = sqlite3_exec(db_, sql, nullptr, nullptr, &error);
  if (rc == SQLITE_OK) return absl::OkStatus();
  const std::string message = error != nullptr ? error : sqlite3_errstr(rc);
  sqlite3_free(error);
  return SqliteError(nullptr, rc, absl::StrCat(sql, ": ", message));
}

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(
    const std::string& path) {
  if (path.empty()) {
    return absl::InvalidArgumentError("path: must not be empty");
  }
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(
      path.c_str(), &db,
      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
      nullptr);
  if (rc != SQLITE_OK) {
    absl::Status status = SqliteError(db, rc, absl::StrCat("open ", path));
    sqlite3_close_v2(db);
    return status;
  }
  auto store = absl::WrapUnique(new StateStore(db, path));
  absl::MutexLock lock(&store->mu_);
  sqlite3_busy_timeout(db, 2000);
  // Exclusive locking: the first write takes the database for the life of
  // this process, so a second coordinator on the same --data-dir fails here
  // instead of interleaving writes. FULL sync makes every commit durable
  // before it is acknowledged.
  for (const char* pragma :
       {"PRAGMA locking_mode=EXCLUSIVE", "PRAGMA journal_mode=WAL",
        "PRAGMA synchronous=FULL"}) {
    absl::Status status = store->ExecLocked(pragma);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("open ", path, ": ", status.message()));
    }
  }
  {
    Statement check(db, "PRAGMA quick_check");
    SHARDD_RETURN_IF_ERROR(check.status("quick_check"));
    const int step = check.Step();
    if (step != SQLITE_ROW) {
      return SqliteError(db, step, absl::StrCat("open ", path));
    }
    const std::string result = check.Column(0);
    if (result != "ok") {
      return absl::DataLossError(
          absl::StrCat("open ", path, ": integrity check failed: ", result));
    }
  }
  int application_id = 0;
  int tables = 0;
  {
    Statement id(db, "PRAGMA application_id");
    SHARDD_RETURN_IF_ERROR(id.status("application_id"));
    if (id.Step() == SQLITE_ROW) application_id = id.ColumnInt(0);
    Statement count(db, "SELECT count(*) FROM sqlite_master");
    SHARDD_RETURN_IF_ERROR(count.status("sqlite_master"));
    if (count.Step() == SQLITE_ROW) tables = count.ColumnInt(0);
  }
  if (application_id == 0 && tables == 0) {
    SHARDD_RETURN_IF_ERROR(store->ExecLocked(
        absl::StrCat("BEGIN IMMEDIATE;"
                     "CREATE TABLE records("
                     "  seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                     "  tbl TEXT NOT NULL, k TEXT NOT NULL, v BLOB NOT NULL,"
                     "  UNIQUE(tbl, k));"
                     "PRAGMA application_id=",
                     kApplicationId, ";PRAGMA user_version=", kSchemaVersion,
                     ";COMMIT;")
            .c_str()));
  } else if (application_id != kApplicationId) {
    return absl::DataLossError(absl::StrCat(
        "open ", path, ": not a shardd state database (application_id ",
        application_id, ")"));
  } else {
    Statement version(db, "PRAGMA user_version");
    SHARDD_RETURN_IF_ERROR(version.status("user_version"));
    const int v = version.Step() == SQLITE_ROW ? version.ColumnInt(0) : 0;
    if (v != kSchemaVersion) {
      return absl::DataLossError(
          absl::StrCat("open ", path, ": schema version ", v,
                       ", this coordinator reads version ", kSchemaVersion));
    }
    // Take the exclusive lock now, not at the first write.
    SHARDD_RETURN_IF_ERROR(store->ExecLocked("BEGIN IMMEDIATE; COMMIT;"));
  }
  return store;
}

absl::Status StateStore::Commit(const std::vector<Write>& writes) {
  for (size_t i = 0; i < writes.size(); ++i) {
    SHARDD_RETURN_IF_ERROR(CheckName(i, "table", writes[i].table));
    SHARDD_RETURN_IF_ERROR(CheckName(i, "key", writes[i].key));
    if (writes[i].value.has_value() &&
        writes[i].value->size() > kMaxValueBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("writes[", i, "].value: at most ", kMaxValueBytes,
                       " bytes, got ", writes[i].value->size()));
    }
  }
  if (writes.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(ExecLocked("BEGIN IMMEDIATE"));
  auto rollback = [&](absl::Status status) {
    ExecLocked("ROLLBACK").IgnoreError();
    return status;
  };
  for (const Write& write : writes) {
    Statement statement(
        db_, write.value.has_value()
                 ? "INSERT INTO records(tbl, k, v) VALUES(?1, ?2, ?3) "
                   "ON CONFLICT(tbl, k) DO UPDATE SET v = excluded.v"
                 : "DELETE FROM records WHERE tbl = ?1 AND k = ?2");
    absl::Status prepared = statement.status("prepare write");
    if (!prepared.ok()) return rollback(prepared);
    statement.BindText(1, write.table);
    statement.BindText(2, write.key);
    if (write.value.has_value()) statement.BindBlob(3, *write.value);
    const int rc = statement.Step();
    if (rc != SQLITE_DONE) {
      return rollback(SqliteError(
          db_, rc, absl::StrCat("write ", write.table, "/", write.key)));
    }
  }
  const absl::Status committed = ExecLocked("COMMIT");
  if (!committed.ok()) return rollback(committed);
  return absl::OkStatus();
}

absl::Status StateStore::Put(absl::string_view table, absl::string_view key,
                             absl::string_view value) {
  return Commit(
      {Write{std::string(table), std::string(key), std::string(value)}});
}

absl::Status StateStore::Erase(absl::string_view table, absl::string_view key) {
  return Commit({Write{std::string(table), std::string(key), std::nullopt}});
}

absl::StatusOr<std::string> StateStore::Get(absl::string_view table,
                                            absl::string_view key) const {
  absl::MutexLock lock(&mu_);
  Statement statement(db_, "SELECT v FROM records WHERE tbl = ?1 AND k = ?2");
  SHARDD_RETURN_IF_ERROR(statement.status("prepare get"));
  statement.BindText(1, table);
  statement.BindText(2, key);
  const int rc = statement.Step();
  if (rc == SQLITE_ROW) return statement.Column(0);
  if (rc == SQLITE_DONE) {
    return absl::NotFoundError(absl::StrCat(table, "/", key, ": not stored"));
  }
  return SqliteError(db_, rc, absl::StrCat("get ", table, "/", key));
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>>
StateStore::List(absl::string_view table) const {
  absl::MutexLock lock(&mu_);
  Statement statement(db_,
                      "SELECT k, v FROM records WHERE tbl = ?1 ORDER BY seq");
  SHARDD_RETURN_IF_ERROR(statement.status("prepare list"));
  statement.BindText(1, table);
  std::vector<std::pair<std::string, std::string>> rows;
  while (true) {
    const int rc = statement.Step();
    if (rc == SQLITE_DONE) break;
    if (rc != SQLITE_ROW) {
      return SqliteError(db_, rc, absl::StrCat("list ", table));
    }
    rows.emplace_back(statement.Column(0), statement.Column(1));
  }
  return rows;
}

}  // namespace shardd
