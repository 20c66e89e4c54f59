#ifndef SHARDD_COMMON_GRPC_SECURITY_H_
#define SHARDD_COMMON_GRPC_SECURITY_H_

// Transport security and call authorization for every shardd gRPC endpoint.
//
// Servers: ServerSecurity names PEM files; without a certificate the server
// listens in plaintext (local development), with one it serves TLS, and a
// client CA additionally requires and verifies client certificates (mutual
// TLS).
//
// Channels: ChannelSecurity names the CA that verifies the server (set =>
// TLS), an optional client certificate, and a bearer token that an
// interceptor attaches to every call as `authorization: Bearer <token>`.
// An interceptor rather than call credentials, because gRPC drops call
// credentials on plaintext channels and the tokens must work there too.
//
// Authorizer: the server-side check of that header. Two roles, each with its
// own token: clients (shardctl: submit, watch, status, checkpoints) and
// workers (registration, heartbeat, key-value store, barriers; the
// coordinator presents the worker token to the Worker service too). A role
// without a configured token is open.

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace shardd {

struct ServerSecurity {
  // PEM certificate chain and private key of the server (--tls-cert,
  // --tls-key); both or neither. Neither: plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  // PEM CA bundle (--tls-client-ca); set: clients must present a
  // certificate signed by it (mutual TLS). Needs tls_cert_file.
  std::string tls_client_ca_file;
};

// Credentials for grpc::ServerBuilder::AddListeningPort. Errors:
// INVALID_ARGUMENT naming the flag (--tls-cert, --tls-key, --tls-client-ca)
// when a file is missing, unreadable or empty, when only one of cert/key is
// given, or when a client CA is given without a server certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerSecurity& security);

struct ChannelSecurity {
  // PEM CA bundle that verifies the server (--tls-ca); set: TLS, else
  // plaintext.
  std::string tls_ca_file;
  // Client certificate and key for mutual TLS (--tls-cert, --tls-key); both
  // or neither; need tls_ca_file.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Expected server name in its certificate instead of the target's host
  // (tests, or addressing a server by IP whose certificate names a host).
  std::string tls_server_name_override;
  // Sent with every call when not empty.
  std::string bearer_token;
};

// Opens a channel to `target` with `args` and `security`. Errors:
// INVALID_ARGUMENT naming the flag (--tls-ca, --tls-cert, --tls-key) as for
// MakeServerCredentials, or when a client certificate is given without
// --tls-ca.
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateSecureChannel(
    const std::string& target, const ChannelSecurity& security,
    grpc::ChannelArguments args);

// Reads a token file: its first line, surrounding whitespace trimmed.
// Errors: INVALID_ARGUMENT naming `flag` when the file cannot be read or the
// token is empty.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path,
                                          absl::string_view flag);

// ReadTokenFile for an optional flag: "" (no token) when `path` is empty.
absl::StatusOr<std::string> ReadOptionalTokenFile(const std::string& path,
                                                  absl::string_view flag);

// Reads a whole file. Errors: INVALID_ARGUMENT naming `flag` when it cannot
// be read or is empty.
absl::StatusOr<std::string> ReadSecurityFile(const std::string& path,
                                             absl::string_view flag);

class Authorizer {
 public:
  enum class Role { kClient, kWorker };

  // Requires nothing: every call passes.
  Authorizer() = default;
  // An empty token leaves its role open.
  Authorizer(std::string client_token, std::string worker_token);

  // Checks the `authorization` header (nullptr: absent) for a call that
  // needs `required`. OK when the role is open or the header carries its
  // token. Errors: UNAUTHENTICATED (no header, not "Bearer <token>", or a
  // token of no role), PERMISSION_DENIED (the other role's token).
  absl::Status CheckHeader(const absl::string_view* authorization,
                           Role required) const;

  // CheckHeader on a call's metadata.
  absl::Status Check(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
      Role required) const;
  absl::Status Check(const grpc::CallbackServerContext& context,
                     Role required) const;

  // True when no role needs a token.
  bool open() const { return client_token_.empty() && worker_token_.empty(); }

 private:
  std::string client_token_;
  std::string worker_token_;
};

// Compares without an early exit, so the time taken does not reveal how many
// leading bytes of a guessed token were right.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace shardd

#endif  // SHARDD_COMMON_GRPC_SECURITY_H_
