#ifndef SHARDD_WORKER_COMM_KV_GLOO_STORE_H_
#define SHARDD_WORKER_COMM_KV_GLOO_STORE_H_

// Gloo's rendezvous store on top of the coordinator's key-value RPCs, so
// workers find each other's collective endpoints through the coordinator.
//
// Gloo calls the store from inside connectFullMesh and expects failures as
// exceptions: every error here is thrown as a GlooStatusError carrying the
// KeyValueClient's status (prefixed with the key), and GlooCommunicator's
// Create() turns it back into that status. Callers outside Gloo should use
// the KeyValueClient directly.

#include <chrono>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gloo/rendezvous/store.h"
#include "worker/comm/kv_client.h"

namespace shardd {

class KvGlooStore : public gloo::rendezvous::Store {
 public:
  // `client` is not owned and must outlive the store. `timeout` (positive;
  // anything else is treated as 1 ms) bounds get(), wait() without a timeout,
  // and every wait() with one: Gloo's PrefixStore forwards a fixed 30 s
  // default that would otherwise override the caller's deadline.
  KvGlooStore(KeyValueClient* client, absl::Duration timeout);

  // Overwrites. Throws GlooStatusError with the client's status.
  void set(const std::string& key, const std::vector<char>& data) override;

  // Waits up to the store timeout for the key. Throws GlooStatusError:
  // DEADLINE_EXCEEDED when the key does not appear in time, else the
  // client's status.
  std::vector<char> get(const std::string& key) override;

  // Waits until every key exists, within one shared deadline of
  // min(timeout, store timeout) (a non-positive `timeout` means the store
  // timeout). Throws GlooStatusError like get().
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  KeyValueClient* const client_;
  const absl::Duration timeout_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_KV_GLOO_STORE_H_
