#include "client/shardctl.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/coordinator_client.h"
#include "client/plan_printer.h"
#include "client/shardctl_args.h"
#include "google/protobuf/util/json_util.h"
#include "server/coordinator_service.h"
#include "server/native_spec.h"
#include "server/strategy_registry.h"

namespace shardd {
namespace {

// Larger files are refused before parsing (the coordinator's own limit on
// model descriptions is 16 MiB).
constexpr size_t kMaxInputFileBytes = size_t{64} << 20;

// Where requests go: a coordinator over gRPC, or a service in this process.
// Both paths run the same CoordinatorService code, so their plans are equal.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual absl::StatusOr<v1::ListStrategiesResponse> ListStrategies() = 0;
  virtual absl::StatusOr<v1::SubmitModelResponse> SubmitModel(
      const v1::SubmitModelRequest& request) = 0;
  virtual absl::StatusOr<v1::GetStatusResponse> GetStatus() = 0;
};

class RemoteBackend final : public Backend {
 public:
  explicit RemoteBackend(std::unique_ptr<CoordinatorClient> client)
      : client_(std::move(client)) {}
  absl::StatusOr<v1::ListStrategiesResponse> ListStrategies() override {
    return client_->ListStrategies();
  }
  absl::StatusOr<v1::SubmitModelResponse> SubmitModel(
      const v1::SubmitModelRequest& request) override {
    return client_->SubmitModel(request);
  }
  absl::StatusOr<v1::GetStatusResponse> GetStatus() override {
    return client_->GetStatus();
  }

 private:
  std::unique_ptr<CoordinatorClient> client_;
};

class LocalBackend final : public Backend {
 public:
  LocalBackend()
      : registry_(StrategyRegistry::CreateWithBuiltins()),
        service_(registry_.get()) {}
  absl::StatusOr<v1::ListStrategiesResponse> ListStrategies() override {
    return service_.ListStrategies({});
  }
  absl::StatusOr<v1::SubmitModelResponse> SubmitModel(
      const v1::SubmitModelRequest& request) override {
    return service_.SubmitModel(request);
  }
  absl::StatusOr<v1::GetStatusResponse> GetStatus() override {
    return service_.GetStatus({});
  }

 private:
  std::unique_ptr<StrategyRegistry> registry_;
  CoordinatorService service_;
};

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const ShardctlArgs& args) {
  if (args.coordinator.empty()) return std::make_unique<LocalBackend>();
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client =
      CoordinatorClient::Connect(args.coordinator, args.timeout);
  if (!client.ok()) return client.status();
  (*client)->set_call_timeout(args.timeout);
  return std::make_unique<RemoteBackend>(*std::move(client));
}

absl::StatusOr<std::string> ReadFile(absl::string_view flag,
                                     const std::string& path) {
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

std::string BaseName(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  const auto converted =
      google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!converted.ok()) {
    return absl::InternalError(
        absl::StrCat("json: ", std::string(converted.message())));
  }
  return json;
}

absl::Status RunStrategies(const ShardctlArgs& args, Backend* backend,
                           std::ostream& out) {
  absl::StatusOr<v1::ListStrategiesResponse> response =
      backend->ListStrategies();
  if (!response.ok()) return response.status();
  if (args.json) {
    absl::StatusOr<std::string> json = ToJson(*response);
    if (!json.ok()) return json.status();
    out << *json;
    return absl::OkStatus();
  }
  size_t name_width = 4;
  size_t arch_width = 13;
  for (const v1::StrategyInfo& info : response->strategies()) {
    name_width = std::max(name_width, info.name().size());
    arch_width =
        std::max(arch_width, absl::StrJoin(info.architectures(), ", ").size());
  }
  out << "Strategies\n";
  out << absl::StrFormat("  %-*s  %-*s  %s\n", name_width, "name", arch_width,
                         "architectures", "description");
  for (const v1::StrategyInfo& info : response->strategies()) {
    std::string archs = absl::StrJoin(info.architectures(), ", ");
    if (archs.empty()) {
      archs = info.name() == "default" ? "(any other)" : "(by name)";
    }
    out << absl::StrFormat("  %-*s  %-*s  %s\n", name_width, info.name(),
                           arch_width, archs, info.description());
  }
  out << "\nArchitectures read from a Hugging Face config.json\n";
  for (const std::string& arch : response->supported_architectures()) {
    out << "  " << arch << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunPlan(const ShardctlArgs& args, Backend* backend,
                     std::ostream& out) {
  v1::SubmitModelRequest request;
  *request.mutable_options() = args.options;
  if (!args.hf_config_path.empty()) {
    absl::StatusOr<std::string> text =
        ReadFile("--hf-config", args.hf_config_path);
    if (!text.ok()) return text.status();
    request.set_hf_config_json(*std::move(text));
    request.set_name(BaseName(args.hf_config_path));
  } else {
    absl::StatusOr<std::string> text = ReadFile("--model", args.model_path);
    if (!text.ok()) return text.status();
    // Parsed here because only this side knows the file may be either
    // format; the coordinator validates the spec again.
    absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromJson(*text);
    if (!spec.ok()) return spec.status();
    *request.mutable_spec() = *std::move(spec);
    request.set_name(BaseName(args.model_path));
  }
  absl::StatusOr<v1::SubmitModelResponse> response =
      backend->SubmitModel(request);
  if (!response.ok()) return response.status();
  if (args.json) {
    out << FormatPlanJson(response->plan(), &response->summary(),
                          args.device_memory_bytes);
  } else {
    out << FormatPlanTable(response->plan(), &response->summary(),
                           args.device_memory_bytes);
  }
  return absl::OkStatus();
}

absl::Status RunStatus(const ShardctlArgs& args, Backend* backend,
                       std::ostream& out) {
  absl::StatusOr<v1::GetStatusResponse> response = backend->GetStatus();
  if (!response.ok()) return response.status();
  if (args.json) {
    absl::StatusOr<std::string> json = ToJson(*response);
    if (!json.ok()) return json.status();
    out << *json;
    return absl::OkStatus();
  }
  out << "Coordinator  " << args.coordinator << "\n";
  out << absl::StrFormat("Incarnation  %016x\n",
                         response->coordinator_incarnation());
  out << "Uptime       "
      << absl::FormatDuration(absl::Milliseconds(response->uptime_ms()))
      << "\n";
  out << "\nModels (" << response->models_size() << ")\n";
  if (response->models_size() > 0) {
    out << absl::StrFormat("  %-18s  %-28s  %-32s  %-16s  %8s  %5s\n", "id",
                           "name", "architecture", "strategy", "params",
                           "world");
    for (const v1::ModelInfo& model : response->models()) {
      out << absl::StrFormat(
          "  %-18s  %-28s  %-32s  %-16s  %8s  %5d\n", model.model_id(),
          model.name(), model.architecture(), model.strategy(),
          HumanCount(model.total_params()), model.world_size());
    }
  }
  out << "\nWorkers (" << response->workers_size() << ")\n";
  for (const v1::WorkerInfo& worker : response->workers()) {
    out << absl::StrFormat("  rank %d  %s  %s  %s  last heartbeat %d ms ago\n",
                           worker.rank(), worker.address(), worker.device(),
                           worker.alive() ? "alive" : "dead",
                           worker.last_heartbeat_ms_ago());
  }
  return absl::OkStatus();
}

}  // namespace

int RunShardctl(const std::vector<std::string>& argv, std::ostream& out,
                std::ostream& err) {
  absl::StatusOr<ShardctlArgs> args = ParseShardctlArgs(argv);
  if (!args.ok()) {
    err << "shardctl: " << args.status().message()
        << "\nRun 'shardctl --help' for usage.\n";
    return kShardctlUsage;
  }
  if (args->command == ShardctlCommand::kHelp) {
    out << ShardctlUsage(args->help_for);
    return kShardctlOk;
  }
  absl::Status status;
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(*args);
  if (!backend.ok()) {
    status = backend.status();
  } else {
    switch (args->command) {
      case ShardctlCommand::kStrategies:
        status = RunStrategies(*args, backend->get(), out);
        break;
      case ShardctlCommand::kPlan:
        status = RunPlan(*args, backend->get(), out);
        break;
      case ShardctlCommand::kStatus:
        status = RunStatus(*args, backend->get(), out);
        break;
      case ShardctlCommand::kHelp:
        break;
    }
  }
  out.flush();
  if (!status.ok()) {
    err << "shardctl: " << absl::StatusCodeToString(status.code()) << ": "
        << status.message() << "\n";
    return kShardctlError;
  }
  return kShardctlOk;
}

}  // namespace shardd
