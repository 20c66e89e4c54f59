#include "common/daemon/security_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain to serve TLS with (with --tls-key); also "
          "the client certificate shown to the peers this daemon calls when "
          "they require one");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mutual "
          "TLS); needs --tls-cert");
ABSL_FLAG(bool, insecure, false,
          "Serve --listen on an address other machines can reach without "
          "TLS (--tls-cert, --tls-key) and tokens; refused otherwise. The "
          "daemon then warns at start and reports it in status and metrics");
ABSL_FLAG(std::string, worker_token_file, "",
          "File whose first line is the worker bearer token: workers send "
          "it to the coordinator and the coordinator to workers, and each "
          "requires it from its callers; empty: none");

namespace shardd {

ServerSecurity ServerSecurityFromFlags() {
  ServerSecurity security;
  security.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  security.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  security.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  return security;
}

void SetClientCertificateFromFlags(ChannelSecurity* channel) {
  channel->tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  channel->tls_key_file = absl::GetFlag(FLAGS_tls_key);
}

absl::StatusOr<std::string> WorkerTokenFromFlags() {
  return ReadOptionalTokenFile(absl::GetFlag(FLAGS_worker_token_file),
                               "--worker-token-file");
}

}  // namespace shardd
