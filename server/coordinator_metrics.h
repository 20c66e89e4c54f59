#ifndef SHARDD_SERVER_COORDINATOR_METRICS_H_
#define SHARDD_SERVER_COORDINATOR_METRICS_H_

// The coordinator's Prometheus metrics (docs/observability.md lists them).
// They are pulled: a collector reads the service's status and membership
// at scrape time, so nothing on the job or RPC paths records anything but
// the RPC latencies' relaxed atomic counts (rpc_latencies.h).

#include "absl/status/status.h"
#include "common/metrics_registry.h"
#include "server/coordinator_service.h"
#include "server/rpc_latencies.h"

namespace shardd {

// Registers the coordinator families in `registry` and a collector that
// fills them from `service` (not owned; must outlive every Render).
// Errors: those of MetricsRegistry::Add* (ALREADY_EXISTS when called twice
// on one registry).
// `latencies` (not owned; null: the histogram is left out) feeds
// shardd_coordinator_rpc_seconds{method}.
absl::Status RegisterCoordinatorMetrics(
    CoordinatorService* service, MetricsRegistry* registry,
    const RpcLatencies* latencies = nullptr);

}  // namespace shardd

#endif  // SHARDD_SERVER_COORDINATOR_METRICS_H_
