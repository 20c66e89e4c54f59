#include "common/grpc_security.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using Role = Authorizer::Role;
using ::testing::HasSubstr;

std::string WriteFile(const std::string& name, const std::string& contents) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path =
      std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
  std::ofstream(path) << contents;
  return path;
}

absl::Status CheckWith(const Authorizer& authorizer, absl::string_view header,
                       Role role) {
  return authorizer.CheckHeader(&header, role);
}

TEST(AuthorizerTest, OpenAuthorizerPassesEverything) {
  Authorizer open;
  EXPECT_TRUE(open.open());
  SHARDD_EXPECT_OK(open.CheckHeader(nullptr, Role::kClient));
  SHARDD_EXPECT_OK(open.CheckHeader(nullptr, Role::kWorker));
  SHARDD_EXPECT_OK(CheckWith(open, "Bearer anything", Role::kWorker));
}

TEST(AuthorizerTest, RightTokenPasses) {
  Authorizer authorizer("client-secret", "worker-secret");
  SHARDD_EXPECT_OK(
      CheckWith(authorizer, "Bearer client-secret", Role::kClient));
  SHARDD_EXPECT_OK(
      CheckWith(authorizer, "Bearer worker-secret", Role::kWorker));
}

TEST(AuthorizerTest, MissingOrMalformedHeaderIsUnauthenticated) {
  Authorizer authorizer("client-secret", "worker-secret");
  EXPECT_THAT(authorizer.CheckHeader(nullptr, Role::kClient),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("missing bearer token")));
  EXPECT_THAT(CheckWith(authorizer, "client-secret", Role::kClient),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("Bearer <token>")));
  EXPECT_THAT(CheckWith(authorizer, "Basic client-secret", Role::kClient),
              StatusIs(absl::StatusCode::kUnauthenticated));
}

TEST(AuthorizerTest, UnknownTokenIsUnauthenticated) {
  Authorizer authorizer("client-secret", "worker-secret");
  EXPECT_THAT(
      CheckWith(authorizer, "Bearer client-secreT", Role::kClient),
      StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("unknown token")));
  EXPECT_THAT(CheckWith(authorizer, "Bearer ", Role::kWorker),
              StatusIs(absl::StatusCode::kUnauthenticated));
  // A prefix of the real token is not the token.
  EXPECT_THAT(CheckWith(authorizer, "Bearer client", Role::kClient),
              StatusIs(absl::StatusCode::kUnauthenticated));
}

TEST(AuthorizerTest, OtherRolesTokenIsPermissionDenied) {
  Authorizer authorizer("client-secret", "worker-secret");
  EXPECT_THAT(
      CheckWith(authorizer, "Bearer client-secret", Role::kWorker),
      StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("worker token")));
  EXPECT_THAT(
      CheckWith(authorizer, "Bearer worker-secret", Role::kClient),
      StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("client token")));
}

TEST(AuthorizerTest, RoleWithoutTokenIsOpen) {
  Authorizer workers_only("", "worker-secret");
  SHARDD_EXPECT_OK(workers_only.CheckHeader(nullptr, Role::kClient));
  EXPECT_THAT(workers_only.CheckHeader(nullptr, Role::kWorker),
              StatusIs(absl::StatusCode::kUnauthenticated));
  // The client role has no token, so a random one is unknown, not denied.
  EXPECT_THAT(CheckWith(workers_only, "Bearer x", Role::kWorker),
              StatusIs(absl::StatusCode::kUnauthenticated));
}

TEST(AuthorizerTest, ChecksMetadataMap) {
  Authorizer authorizer("c", "w");
  const std::string key = "authorization";
  const std::string value = "Bearer w";
  std::multimap<grpc::string_ref, grpc::string_ref> metadata;
  EXPECT_THAT(authorizer.Check(metadata, Role::kClient),
              StatusIs(absl::StatusCode::kUnauthenticated));
  metadata.insert({grpc::string_ref(key), grpc::string_ref(value)});
  SHARDD_EXPECT_OK(authorizer.Check(metadata, Role::kWorker));
  EXPECT_THAT(authorizer.Check(metadata, Role::kClient),
              StatusIs(absl::StatusCode::kPermissionDenied));
}

TEST(ConstantTimeEqualsTest, ComparesBytes) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(ReadTokenFileTest, FirstLineTrimmed) {
  const std::string path = WriteFile("token", "  s3cret \nsecond line\n");
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string token,
                              ReadTokenFile(path, "--token-file"));
  EXPECT_EQ(token, "s3cret");
}

TEST(ReadTokenFileTest, EmptyOrMissingNamesTheFlag) {
  EXPECT_THAT(
      ReadTokenFile(WriteFile("empty_token", "  \n"), "--token-file"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--token-file")));
  EXPECT_THAT(ReadTokenFile("/nonexistent/token", "--worker-token-file"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--worker-token-file")));
}

TEST(ServerCredentialsTest, NoCertificateIsPlaintext) {
  SHARDD_ASSERT_OK_AND_ASSIGN(auto credentials,
                              MakeServerCredentials(ServerSecurity()));
  EXPECT_NE(credentials, nullptr);
}

TEST(ServerCredentialsTest, ErrorsNameTheFlag) {
  ServerSecurity cert_only;
  cert_only.tls_cert_file = WriteFile("cert.pem", "x");
  EXPECT_THAT(
      MakeServerCredentials(cert_only),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-key")));

  ServerSecurity missing;
  missing.tls_cert_file = "/nonexistent/cert.pem";
  missing.tls_key_file = WriteFile("key.pem", "x");
  EXPECT_THAT(
      MakeServerCredentials(missing),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-cert")));

  ServerSecurity ca_without_cert;
  ca_without_cert.tls_client_ca_file = WriteFile("ca.pem", "x");
  EXPECT_THAT(MakeServerCredentials(ca_without_cert),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls-client-ca")));

  ServerSecurity missing_ca;
  missing_ca.tls_cert_file = WriteFile("cert.pem", "x");
  missing_ca.tls_key_file = WriteFile("key.pem", "x");
  missing_ca.tls_client_ca_file = "/nonexistent/ca.pem";
  EXPECT_THAT(MakeServerCredentials(missing_ca),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls-client-ca")));
}

TEST(ChannelTest, ErrorsNameTheFlag) {
  ChannelSecurity missing_ca;
  missing_ca.tls_ca_file = "/nonexistent/ca.pem";
  EXPECT_THAT(
      CreateSecureChannel("127.0.0.1:1", missing_ca, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-ca")));

  ChannelSecurity cert_without_ca;
  cert_without_ca.tls_cert_file = WriteFile("cert.pem", "x");
  cert_without_ca.tls_key_file = WriteFile("key.pem", "x");
  EXPECT_THAT(
      CreateSecureChannel("127.0.0.1:1", cert_without_ca, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-ca")));

  ChannelSecurity key_only;
  key_only.tls_ca_file = WriteFile("ca.pem", "x");
  key_only.tls_key_file = WriteFile("key.pem", "x");
  EXPECT_THAT(
      CreateSecureChannel("127.0.0.1:1", key_only, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-cert")));
}

TEST(ChannelTest, PlaintextWithTokenOpens) {
  ChannelSecurity security;
  security.bearer_token = "t";
  SHARDD_ASSERT_OK_AND_ASSIGN(auto channel,
                              CreateSecureChannel("127.0.0.1:1", security, {}));
  EXPECT_NE(channel, nullptr);
}

}  // namespace
}  // namespace shardd
