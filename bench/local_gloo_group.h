#ifndef SHARDD_BENCH_LOCAL_GLOO_GROUP_H_
#define SHARDD_BENCH_LOCAL_GLOO_GROUP_H_

// Runs `body(rank, group)` on `world` threads, each a rank of one Gloo group
// on loopback (rendezvous through an in-memory key-value store). Returns
// false, after printing every failing rank's status, if a rank could not
// join or its body failed. Benchmarks only.

#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"

namespace shardd {

inline bool RunOnLocalGlooGroup(
    int world, const std::string& prefix, absl::Duration timeout,
    const std::function<absl::Status(int, GlooCommunicator*)>& body) {
  InMemoryKeyValueClient kv;
  absl::Mutex mu;
  bool ok = true;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      KvGlooStore store(&kv, timeout);
      auto comm = GlooCommunicator::Create(&store, prefix, r, world,
                                           "127.0.0.1", timeout);
      absl::Status status = comm.ok() ? body(r, comm->get()) : comm.status();
      if (!status.ok()) {
        absl::MutexLock lock(&mu);
        std::fprintf(stderr, "rank %d: %s\n", r, status.ToString().c_str());
        ok = false;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return ok;
}

}  // namespace shardd

#endif  // SHARDD_BENCH_LOCAL_GLOO_GROUP_H_
