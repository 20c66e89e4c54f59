#ifndef SHARDD_CLIENT_SHARDCTL_IO_H_
#define SHARDD_CLIENT_SHARDCTL_IO_H_

// What shardctl's commands share: a connection to the coordinator with the
// flags' security, and reading and writing the files the flags name.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/coordinator_client.h"
#include "client/shardctl_args.h"

namespace shardd {

// Connects to args.coordinator with the TLS flags and the bearer token of
// --token-file. Errors: those of reading the token file and of
// CoordinatorClient::Connect.
absl::StatusOr<std::unique_ptr<CoordinatorClient>> ConnectTo(
    const ShardctlArgs& args);

// The contents of `path` (for --model, a directory means its config.json).
// Errors, naming `flag` and the path: NOT_FOUND (cannot open; a directory
// without config.json), RESOURCE_EXHAUSTED (over 64 MiB), DATA_LOSS (a
// read error).
absl::StatusOr<std::string> ReadInputFile(absl::string_view flag,
                                          const std::string& path);

// Writes `text` to `path` whole. Errors: INTERNAL naming `flag` and the path.
absl::Status WriteTextFile(absl::string_view flag, const std::string& path,
                           const std::string& text);

// The last component of `path`, trailing slashes ignored.
std::string BaseName(std::string path);

}  // namespace shardd

#endif  // SHARDD_CLIENT_SHARDCTL_IO_H_
