#ifndef SHARDD_WORKER_COMM_IN_MEMORY_KV_CLIENT_H_
#define SHARDD_WORKER_COMM_IN_MEMORY_KV_CLIENT_H_

// A KeyValueClient backed by a map in this process: for tests (many ranks as
// threads of one process) and single-process runs. Thread-safe; Get blocks
// until the key is set or the timeout passes.

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/comm/kv_client.h"

namespace shardd {

class InMemoryKeyValueClient : public KeyValueClient {
 public:
  // Errors: INVALID_ARGUMENT for an empty key.
  absl::Status Set(const std::string& key, const std::string& value) override;
  // Errors: INVALID_ARGUMENT for an empty key; DEADLINE_EXCEEDED when the key
  // is not set within `timeout` (a non-positive timeout only checks once).
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  // Removes `key`, or with `prefix` every key starting with it. Removing
  // nothing is OK.
  absl::Status Delete(const std::string& key, bool prefix) override;

  // Number of keys stored now.
  int size() const;
  // Number of Set calls so far (tests count store traffic with it).
  int set_calls() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  int set_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_IN_MEMORY_KV_CLIENT_H_
