#ifndef SHARDD_COMMON_DAEMON_LISTEN_POLICY_H_
#define SHARDD_COMMON_DAEMON_LISTEN_POLICY_H_

// Locked by default: a daemon whose gRPC port is reachable from other
// machines must encrypt (TLS) and authenticate (bearer tokens) what it
// serves, or be told --insecure. A coordinator started by hand on
// 0.0.0.0 would otherwise take jobs and workers from anyone who can reach
// it. Loopback listeners (127.0.0.0/8, ::1, localhost, unix sockets) are
// reachable from this machine only and need neither.

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardd {

// Whether a gRPC listen address ("HOST:PORT", "[V6]:PORT", "unix:PATH")
// accepts connections from this machine only. Host names other than
// "localhost" are not resolved and count as reachable.
bool IsLoopbackListenAddress(absl::string_view address);

struct ListenerGuard {
  std::string listen_flag = "--listen";
  std::string address;  // The listen address.
  bool tls = false;     // --tls-cert and --tls-key are set.
  // The tokens the daemon's callers must present: flag name, whether set.
  std::vector<std::pair<std::string, bool>> tokens;
  bool insecure = false;  // --insecure.
};

// Whether `guard`'s listener may start, and whether it then serves other
// machines without TLS and tokens (under --insecure: the daemon warns and
// reports it). Errors: FAILED_PRECONDITION for a non-loopback address
// without TLS or a token and without --insecure; the message names the
// listen flag, the address, each missing flag and --insecure.
absl::StatusOr<bool> CheckListener(const ListenerGuard& guard);

// The warning an insecure listener logs at start and shows in status.
std::string InsecureListenerWarning(absl::string_view daemon,
                                    absl::string_view address);

}  // namespace shardd

#endif  // SHARDD_COMMON_DAEMON_LISTEN_POLICY_H_
