#include "common/daemon/listen_policy.h"

#include <arpa/inet.h>

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardd {
namespace {

// The host part of "HOST:PORT" or "[V6]:PORT" (brackets removed).
std::string HostOf(absl::string_view address) {
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) return std::string(address);
    return std::string(address.substr(1, close - 1));
  }
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return std::string(address);
  // A bare IPv6 address without a port has several colons.
  if (address.find(':') != colon) return std::string(address);
  return std::string(address.substr(0, colon));
}

}  // namespace

bool IsLoopbackListenAddress(absl::string_view address) {
  if (absl::StartsWith(address, "unix:") ||
      absl::StartsWith(address, "unix-abstract:")) {
    return true;
  }
  // gRPC's URI forms: "ipv4:HOST:PORT", "ipv6:[V6]:PORT", "dns:HOST:PORT".
  for (absl::string_view scheme : {"ipv4:", "ipv6:", "dns:"}) {
    if (absl::StartsWith(address, scheme)) {
      address.remove_prefix(scheme.size());
      break;
    }
  }
  const std::string host = absl::AsciiStrToLower(HostOf(address));
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6);
  }
  return false;
}

absl::StatusOr<bool> CheckListener(const ListenerGuard& guard) {
  if (IsLoopbackListenAddress(guard.address)) return false;
  std::vector<std::string> missing;
  if (!guard.tls) missing.push_back("--tls-cert and --tls-key");
  for (const auto& [flag, set] : guard.tokens) {
    if (!set) missing.push_back(flag);
  }
  if (missing.empty()) return false;
  if (guard.insecure) return true;
  return absl::FailedPreconditionError(absl::StrCat(
      guard.listen_flag, "=", guard.address,
      " is reachable from other machines, and without ",
      absl::StrJoin(missing, ", "),
      " anyone who reaches it is served in plaintext without "
      "authentication: give them (deploy/k8s/make-secrets.sh makes a set), "
      "listen on a loopback address (127.0.0.1), or pass --insecure to "
      "serve it that way anyway"));
}

std::string InsecureListenerWarning(absl::string_view daemon,
                                    absl::string_view address) {
  return absl::StrCat(daemon, " serves ", address,
                      " without TLS or tokens (--insecure): anyone who can "
                      "reach it can call it");
}

}  // namespace shardd
