#ifndef SHARDD_WORKER_COMM_KV_CLIENT_H_
#define SHARDD_WORKER_COMM_KV_CLIENT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardd {

// The coordinator's key-value store as seen by worker-side code (collective
// rendezvous: Gloo's store, later the NCCL unique id). Implemented over the
// coordinator RPCs by CoordinatorAgent; tests may use an in-memory fake.
class KeyValueClient {
 public:
  virtual ~KeyValueClient() = default;
  // Errors: as the coordinator's Put.
  virtual absl::Status Set(const std::string& key,
                           const std::string& value) = 0;  // overwrite = true
  // Waits until the key exists or the timeout passes (DEADLINE_EXCEEDED).
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          absl::Duration timeout) = 0;
  virtual absl::Status Delete(const std::string& key, bool prefix) = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_KV_CLIENT_H_
