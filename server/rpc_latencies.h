#ifndef SHARDD_SERVER_RPC_LATENCIES_H_
#define SHARDD_SERVER_RPC_LATENCIES_H_

// Server-side latency of the coordinator's control-plane RPCs, by method:
// from the moment gRPC hands the call to its handler to the handler's
// Finish (for a waiting Get or Barrier, its release). Recording is a few
// relaxed atomic adds, so it stays on even at thousands of calls a second;
// the metrics collector reads a snapshot at scrape time
// (shardd_coordinator_rpc_seconds). Thread-safe.

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/metrics_registry.h"

namespace shardd {

class RpcLatencies {
 public:
  enum Method {
    kRegisterWorker,
    kHeartbeat,
    kPut,
    kGet,
    kDelete,
    kBarrier,
    kSubmitModel,
    kGetPlan,
    kSubmitStep,
    kGetStatus,
    kMethods,
  };
  // The method's name as the proto spells it.
  static const char* Name(Method method);

  // Bucket upper bounds in seconds: 10 us doubling 24 times (to 84 s);
  // anything longer lands in a last, unbounded bucket.
  static constexpr int kBounds = 24;
  static const std::vector<double>& Bounds();

  // Non-cumulative counts, one per bound, the unbounded bucket last; the
  // sum in seconds. The metrics registry's type, so a collector sets it as
  // it is.
  using Snapshot = HistogramFamily::Snapshot;

  RpcLatencies();

  void Record(Method method, absl::Duration latency);
  Snapshot Get(Method method) const;

  // The q-quantile (0 < q <= 1) of the calls counted in `after` but not in
  // `before` (an earlier snapshot of the same method; empty: none), as the
  // upper bound of the bucket it falls in; 0 with no calls, +Inf in the
  // unbounded bucket.
  static double Quantile(const Snapshot& after, const Snapshot& before,
                         double q);

 private:
  struct PerMethod {
    std::array<std::atomic<uint64_t>, kBounds + 1> buckets{};
    std::atomic<uint64_t> count{0};
    std::atomic<uint64_t> sum_nanos{0};
  };
  std::array<PerMethod, kMethods> methods_;
};

// Records the time from its construction to its destruction (null
// `latencies`: nothing).
class RpcLatencyScope {
 public:
  RpcLatencyScope(RpcLatencies* latencies, RpcLatencies::Method method)
      : latencies_(latencies),
        method_(method),
        start_(latencies != nullptr ? absl::Now() : absl::InfinitePast()) {}
  ~RpcLatencyScope() {
    if (latencies_ != nullptr)
      latencies_->Record(method_, absl::Now() - start_);
  }
  RpcLatencyScope(const RpcLatencyScope&) = delete;
  RpcLatencyScope& operator=(const RpcLatencyScope&) = delete;

 private:
  RpcLatencies* const latencies_;
  const RpcLatencies::Method method_;
  const absl::Time start_;
};

}  // namespace shardd

#endif  // SHARDD_SERVER_RPC_LATENCIES_H_
