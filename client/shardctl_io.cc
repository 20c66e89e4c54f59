#include "client/shardctl_io.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_security.h"

namespace shardd {
namespace {

// Larger files are refused before parsing (the coordinator's own limit on
// model descriptions is 16 MiB).
constexpr size_t kMaxInputFileBytes = size_t{64} << 20;

}  // namespace

// The channel security the flags ask for; reads the token file.
namespace {

absl::StatusOr<ChannelSecurity> SecurityOf(const ShardctlArgs& args) {
  ChannelSecurity security;
  security.tls_ca_file = args.tls_ca_file;
  security.tls_cert_file = args.tls_cert_file;
  security.tls_key_file = args.tls_key_file;
  if (!args.token_file.empty()) {
    absl::StatusOr<std::string> token =
        ReadTokenFile(args.token_file, "--token-file");
    if (!token.ok()) return token.status();
    security.bearer_token = *std::move(token);
  }
  return security;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorClient>> ConnectTo(
    const ShardctlArgs& args) {
  absl::StatusOr<ChannelSecurity> security = SecurityOf(args);
  if (!security.ok()) return security.status();
  return CoordinatorClient::Connect(args.coordinator, args.timeout, *security);
}

absl::StatusOr<std::string> ReadInputFile(absl::string_view flag,
                                     const std::string& path) {
  std::error_code ec;
  if (flag == "--model" && std::filesystem::is_directory(path, ec)) {
    // A Hugging Face model directory: its config.json.
    const std::string config = path + "/config.json";
    if (!std::filesystem::exists(config, ec)) {
      return absl::NotFoundError(absl::StrCat(
          flag, ": directory '", path,
          "' has no config.json (expected a Hugging Face model directory)"));
    }
    return ReadInputFile(flag, config);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(flag, ": cannot open '", path, "'"));
  }
  std::string text;
  char buffer[1 << 16];
  while (in) {
    in.read(buffer, sizeof(buffer));
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxInputFileBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat(flag, ": '", path, "' is larger than ",
                       kMaxInputFileBytes, " bytes"));
    }
  }
  if (in.bad()) {
    return absl::DataLossError(
        absl::StrCat(flag, ": error reading '", path, "'"));
  }
  return text;
}

std::string BaseName(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

absl::Status WriteTextFile(absl::string_view flag, const std::string& path,
                           const std::string& text) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (file) file << text;
  if (file) file.close();
  if (!file) {
    return absl::InternalError(
        absl::StrCat(flag, ": cannot write '", path, "'"));
  }
  return absl::OkStatus();
}

}  // namespace shardd
