#include "common/grpc_security.h"

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/support/client_interceptor.h"

namespace shardd {
namespace {

constexpr absl::string_view kAuthorizationHeader = "authorization";
constexpr absl::string_view kBearerPrefix = "Bearer ";

// Adds `authorization: Bearer <token>` to each call's initial metadata.
class BearerTokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerTokenInterceptor(const std::string* header)
      : header_(header) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert(
          {std::string(kAuthorizationHeader), *header_});
    }
    methods->Proceed();
  }

 private:
  const std::string* const header_;  // Owned by the factory.
};

class BearerTokenInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenInterceptorFactory(absl::string_view token)
      : header_(absl::StrCat(kBearerPrefix, token)) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new BearerTokenInterceptor(&header_);
  }

 private:
  const std::string header_;
};

// Both or neither of a certificate and its key.
absl::Status CheckPair(const std::string& cert, const std::string& key,
                       absl::string_view cert_flag,
                       absl::string_view key_flag) {
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        cert.empty() ? cert_flag : key_flag, ": required together with ",
        cert.empty() ? key_flag : cert_flag));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ReadSecurityFile(const std::string& path,
                                             absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read '", path, "'"));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (contents.str().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' is empty"));
  }
  return contents.str();
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path,
                                          absl::string_view flag) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read token file '", path, "'"));
  }
  std::string line;
  std::getline(in, line);
  std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": token file '", path, "' is empty (first line is the token)"));
  }
  return token;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerSecurity& security) {
  if (absl::Status status =
          CheckPair(security.tls_cert_file, security.tls_key_file, "--tls-cert",
                    "--tls-key");
      !status.ok()) {
    return status;
  }
  if (security.tls_cert_file.empty()) {
    if (!security.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca: needs --tls-cert and --tls-key (mutual TLS is "
          "TLS)");
    }
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::string> cert =
      ReadSecurityFile(security.tls_cert_file, "--tls-cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key =
      ReadSecurityFile(security.tls_key_file, "--tls-key");
  if (!key.ok()) return key.status();

  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  if (!security.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> ca =
        ReadSecurityFile(security.tls_client_ca_file, "--tls-client-ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
    options.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateSecureChannel(
    const std::string& target, const ChannelSecurity& security,
    grpc::ChannelArguments args) {
  if (absl::Status status =
          CheckPair(security.tls_cert_file, security.tls_key_file, "--tls-cert",
                    "--tls-key");
      !status.ok()) {
    return status;
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (security.tls_ca_file.empty()) {
    if (!security.tls_cert_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-cert: a client certificate needs --tls-ca (mutual TLS is "
          "TLS)");
    }
    credentials = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions options;
    absl::StatusOr<std::string> ca =
        ReadSecurityFile(security.tls_ca_file, "--tls-ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
    if (!security.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert =
          ReadSecurityFile(security.tls_cert_file, "--tls-cert");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key =
          ReadSecurityFile(security.tls_key_file, "--tls-key");
      if (!key.ok()) return key.status();
      options.pem_cert_chain = *std::move(cert);
      options.pem_private_key = *std::move(key);
    }
    credentials = grpc::SslCredentials(options);
    if (!security.tls_server_name_override.empty()) {
      args.SetSslTargetNameOverride(security.tls_server_name_override);
    }
  }
  std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
      interceptors;
  if (!security.bearer_token.empty()) {
    interceptors.push_back(
        std::make_unique<BearerTokenInterceptorFactory>(security.bearer_token));
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      target, credentials, args, std::move(interceptors));
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // The length is not secret (tokens have a fixed format); the bytes are.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

Authorizer::Authorizer(std::string client_token, std::string worker_token)
    : client_token_(std::move(client_token)),
      worker_token_(std::move(worker_token)) {}

absl::Status Authorizer::CheckHeader(const absl::string_view* authorization,
                                     Role required) const {
  const std::string& wanted =
      required == Role::kClient ? client_token_ : worker_token_;
  const std::string& other =
      required == Role::kClient ? worker_token_ : client_token_;
  if (wanted.empty()) return absl::OkStatus();
  if (authorization == nullptr) {
    return absl::UnauthenticatedError(
        "missing bearer token (send 'authorization: Bearer <token>')");
  }
  if (!absl::StartsWith(*authorization, kBearerPrefix)) {
    return absl::UnauthenticatedError(
        "malformed authorization header: expected 'Bearer <token>'");
  }
  const absl::string_view token =
      absl::StripAsciiWhitespace(authorization->substr(kBearerPrefix.size()));
  if (ConstantTimeEquals(token, wanted)) return absl::OkStatus();
  if (!other.empty() && ConstantTimeEquals(token, other)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "this call needs the ", required == Role::kClient ? "client" : "worker",
        " token; the ", required == Role::kClient ? "worker" : "client",
        " token does not grant it"));
  }
  return absl::UnauthenticatedError("unknown token");
}

absl::Status Authorizer::Check(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
    Role required) const {
  const auto it = metadata.find(grpc::string_ref(kAuthorizationHeader.data(),
                                                 kAuthorizationHeader.size()));
  if (it == metadata.end()) return CheckHeader(nullptr, required);
  const absl::string_view header(it->second.data(), it->second.size());
  return CheckHeader(&header, required);
}

absl::Status Authorizer::Check(const grpc::CallbackServerContext& context,
                               Role required) const {
  if (client_token_.empty() && worker_token_.empty()) return absl::OkStatus();
  return Check(context.client_metadata(), required);
}

absl::StatusOr<std::string> ReadOptionalTokenFile(const std::string& path,
                                                  absl::string_view flag) {
  if (path.empty()) return std::string();
  return ReadTokenFile(path, flag);
}

}  // namespace shardd
