#include "server/rpc_latencies.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace shardd {

const char* RpcLatencies::Name(Method method) {
  switch (method) {
    case kRegisterWorker:
      return "RegisterWorker";
    case kHeartbeat:
      return "Heartbeat";
    case kPut:
      return "Put";
    case kGet:
      return "Get";
    case kDelete:
      return "Delete";
    case kBarrier:
      return "Barrier";
    case kSubmitModel:
      return "SubmitModel";
    case kGetPlan:
      return "GetPlan";
    case kSubmitStep:
      return "SubmitStep";
    case kGetStatus:
      return "GetStatus";
    case kMethods:
      break;
  }
  return "unknown";
}

const std::vector<double>& RpcLatencies::Bounds() {
  static const std::vector<double>* bounds = [] {
    auto* b = new std::vector<double>();
    for (int i = 0; i < kBounds; ++i) b->push_back(1e-5 * std::ldexp(1.0, i));
    return b;
  }();
  return *bounds;
}

RpcLatencies::RpcLatencies() = default;

void RpcLatencies::Record(Method method, absl::Duration latency) {
  if (method < 0 || method >= kMethods) return;
  const double seconds = absl::ToDoubleSeconds(latency);
  const std::vector<double>& bounds = Bounds();
  int bucket = 0;
  while (bucket < kBounds && seconds > bounds[bucket]) ++bucket;
  PerMethod& m = methods_[method];
  m.buckets[bucket].fetch_add(1, std::memory_order_relaxed);
  m.count.fetch_add(1, std::memory_order_relaxed);
  const int64_t nanos = absl::ToInt64Nanoseconds(latency);
  m.sum_nanos.fetch_add(nanos > 0 ? static_cast<uint64_t>(nanos) : 0,
                        std::memory_order_relaxed);
}

RpcLatencies::Snapshot RpcLatencies::Get(Method method) const {
  Snapshot out;
  out.bucket_counts.assign(kBounds + 1, 0);
  if (method < 0 || method >= kMethods) return out;
  const PerMethod& m = methods_[method];
  for (int i = 0; i <= kBounds; ++i) {
    out.bucket_counts[i] = m.buckets[i].load(std::memory_order_relaxed);
    out.count += out.bucket_counts[i];
  }
  out.sum =
      static_cast<double>(m.sum_nanos.load(std::memory_order_relaxed)) * 1e-9;
  return out;
}

double RpcLatencies::Quantile(const Snapshot& after, const Snapshot& before,
                              double q) {
  std::vector<uint64_t> counts = after.bucket_counts;
  uint64_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (i < before.bucket_counts.size()) {
      counts[i] -= std::min(counts[i], before.bucket_counts[i]);
    }
    total += counts[i];
  }
  if (total == 0) return 0.0;
  // The smallest bucket whose cumulative count reaches q of the calls.
  const double want = std::ceil(q * static_cast<double>(total));
  uint64_t seen = 0;
  const std::vector<double>& bounds = Bounds();
  for (size_t i = 0; i < counts.size(); ++i) {
    seen += counts[i];
    if (static_cast<double>(seen) >= want) {
      return i < bounds.size() ? bounds[i]
                               : std::numeric_limits<double>::infinity();
    }
  }
  return std::numeric_limits<double>::infinity();
}

}  // namespace shardd
