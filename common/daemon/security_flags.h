#ifndef SHARDD_COMMON_DAEMON_SECURITY_FLAGS_H_
#define SHARDD_COMMON_DAEMON_SECURITY_FLAGS_H_

// The TLS and token flags both daemons take (--tls-cert, --tls-key,
// --tls-client-ca, --worker-token-file, --insecure), defined once. Each daemon
// adds the flags only it has (the coordinator's --client-token-file and
// --worker-tls-ca, the worker's --tls-ca).

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "common/grpc_security.h"

ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_client_ca);
ABSL_DECLARE_FLAG(std::string, worker_token_file);
ABSL_DECLARE_FLAG(bool, insecure);

namespace shardd {

// What this daemon serves with: --tls-cert, --tls-key, --tls-client-ca.
ServerSecurity ServerSecurityFromFlags();

// Shows --tls-cert/--tls-key as the client certificate on `channel` (for
// peers that require one).
void SetClientCertificateFromFlags(ChannelSecurity* channel);

// The first line of --worker-token-file, or "" when the flag is empty.
// Errors: ReadOptionalTokenFile's, naming --worker-token-file.
absl::StatusOr<std::string> WorkerTokenFromFlags();

}  // namespace shardd

#endif  // SHARDD_COMMON_DAEMON_SECURITY_FLAGS_H_
