#include "client/shardctl.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "client/plan_printer.h"
#include "client/plan_timeline.h"
#include "client/shardctl_args.h"
#include "client/shardctl_io.h"
#include "client/shardctl_usage.h"
#include "client/train_command.h"
#include "viz/timeline_svg.h"
#include "client/train_report.h"
#include "common/grpc_security.h"
#include "common/job_state_name.h"
#include "google/protobuf/util/json_util.h"
#include "server/coordinator_service.h"
#include "model/native_spec.h"
#include "planner/strategy_registry.h"
#include "checkpoint/consolidate.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/hf_interop.h"
#include "checkpoint/peft_adapters.h"

namespace shardd {
namespace {

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
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client = ConnectTo(args);
  if (!client.ok()) return client.status();
  (*client)->set_call_timeout(args.timeout);
  return std::make_unique<RemoteBackend>(*std::move(client));
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

// ---- pictures (section: timeline-svg)

// plan --timeline-svg [--compare-strategy]: draws `plan`'s timeline, with
// the compared strategy's plan of the same request overlaid.
absl::Status WritePlanTimelineSvg(const ShardctlArgs& args, Backend* backend,
                                  const v1::SubmitModelRequest& request,
                                  const v1::ShardingPlan& plan,
                                  std::ostream* out) {
  v1::ShardingPlan compare;
  if (!args.compare_strategy.empty()) {
    v1::SubmitModelRequest other = request;
    other.mutable_options()->set_strategy(args.compare_strategy);
    other.mutable_options()->set_include_timeline(true);
    absl::StatusOr<v1::SubmitModelResponse> planned =
        backend->SubmitModel(other);
    if (!planned.ok()) {
      return absl::Status(
          planned.status().code(),
          absl::StrCat("--compare-strategy ", args.compare_strategy, ": ",
                       planned.status().message()));
    }
    compare = planned->plan();
  }
  absl::StatusOr<ChartSpec> chart = PlanTimelineChart(
      plan, request.name(), args.compare_strategy.empty() ? nullptr : &compare);
  if (!chart.ok()) return chart.status();
  absl::StatusOr<std::string> svg = RenderChartSvg(*chart);
  if (!svg.ok()) return svg.status();
  absl::Status written =
      WriteTextFile("--timeline-svg", args.timeline_svg_path, *svg);
  if (!written.ok()) return written;
  if (out != nullptr) {
    *out << "\nTimeline  wrote " << args.timeline_svg_path << " (peak "
         << HumanBytes(plan.memory().peak_unsharded_bytes()) << " "
         << plan.strategy();
    if (!args.compare_strategy.empty()) {
      *out << ", " << HumanBytes(compare.memory().peak_unsharded_bytes()) << " "
           << compare.strategy();
    }
    *out << ")\n";
  }
  return absl::OkStatus();
}

absl::Status RunPlan(const ShardctlArgs& args, Backend* backend,
                     std::ostream& out) {
  v1::SubmitModelRequest request;
  *request.mutable_options() = args.options;
  if (!args.timeline_svg_path.empty()) {
    request.mutable_options()->set_include_timeline(true);
  }
  if (!args.hf_config_path.empty()) {
    absl::StatusOr<std::string> text =
        ReadInputFile("--hf-config", args.hf_config_path);
    if (!text.ok()) return text.status();
    request.set_hf_config_json(*std::move(text));
    request.set_name(BaseName(args.hf_config_path));
  } else {
    absl::StatusOr<std::string> text = ReadInputFile("--model", args.model_path);
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
  // The timeline asked for by --timeline-svg only goes into the picture.
  v1::ShardingPlan without_timeline;
  const v1::ShardingPlan* shown = &response->plan();
  if (!args.options.include_timeline() && shown->memory().timeline_size() > 0) {
    without_timeline = *shown;
    without_timeline.mutable_memory()->clear_timeline();
    shown = &without_timeline;
  }
  if (args.json) {
    out << FormatPlanJson(*shown, &response->summary(),
                          args.device_memory_bytes);
  } else {
    out << FormatPlanTable(*shown, &response->summary(),
                           args.device_memory_bytes);
  }
  if (!args.timeline_svg_path.empty()) {
    absl::Status drawn = WritePlanTimelineSvg(
        args, backend, request, response->plan(), args.json ? nullptr : &out);
    if (!drawn.ok()) return drawn;
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
  if (!response->insecure().empty()) {
    out << "WARNING      " << response->insecure() << "\n";
  }
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
  int alive = 0;
  for (const v1::WorkerInfo& worker : response->workers()) {
    alive += worker.alive() ? 1 : 0;
  }
  out << "\nWorkers (" << response->workers_size();
  if (response->workers_size() > 0) {
    out << ": " << alive << " alive, " << response->workers_size() - alive
        << " dead";
  }
  out << ")\n";
  for (const v1::WorkerInfo& worker : response->workers()) {
    out << absl::StrFormat(
        "  rank %d  %s  %s  %s  last heartbeat %d ms ago%s\n", worker.rank(),
        worker.address(), worker.device(), worker.alive() ? "alive" : "dead",
        worker.last_heartbeat_ms_ago(),
        worker.insecure() ? "  INSECURE (no TLS or tokens, --insecure)" : "");
  }
  out << "\nJobs (" << response->jobs_size() << ")\n";
  if (response->jobs_size() > 0) {
    out << absl::StrFormat(
        "  %-6s  %-18s  %-10s  %5s  %13s  %9s  %11s  %5s  %-24s  %s\n", "id",
        "model", "state", "world", "steps", "loss", "tokens/s", "recov",
        "last checkpoint", "error");
    for (const v1::JobInfo& job : response->jobs()) {
      out << absl::StrFormat(
          "  %-6s  %-18s  %-10s  %5d  %13s  %9s  %11s  %5d  %-24s  %s\n",
          job.job_id(), job.model_id(), JobStateName(job.state()),
          job.world_size(),
          absl::StrCat(job.steps_done(), "/", job.total_steps()),
          job.steps_done() > 0 ? absl::StrFormat("%.4f", job.loss()) : "-",
          job.steps_done() > 0
              ? HumanCount(static_cast<int64_t>(job.tokens_per_second()))
              : "-",
          job.recoveries(),
          job.last_checkpoint().empty() ? "-" : job.last_checkpoint(),
          job.error());
      if (job.checkpoint_failures() > 0) {
        out << absl::StrFormat("          %d checkpoint save(s) failed; last: %s\n",
                               job.checkpoint_failures(),
                               job.last_checkpoint_error());
      }
    }
  }
  if (response->checkpoint_failures_total() > 0 ||
      response->checkpoints_deleted_total() > 0) {
    out << absl::StrFormat(
        "\nCheckpoints: %d save(s) failed, %d deleted by retention\n",
        response->checkpoint_failures_total(),
        response->checkpoints_deleted_total());
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// checkpoint list / save / load: one call to the coordinator each

// Connects, makes the call `call(client)` and prints its response as JSON
// (--json) or with `print_text`.
template <typename Response>
absl::Status CallAndPrint(
    const ShardctlArgs& args, std::ostream& out,
    const std::function<absl::StatusOr<Response>(CoordinatorClient&)>& call,
    const std::function<void(const Response&)>& print_text) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> connected =
      ConnectTo(args);
  if (!connected.ok()) return connected.status();
  (*connected)->set_call_timeout(args.timeout);
  absl::StatusOr<Response> response = call(**connected);
  if (!response.ok()) return response.status();
  if (args.json) {
    absl::StatusOr<std::string> json = ToJson(*response);
    if (!json.ok()) return json.status();
    out << *json;
    return absl::OkStatus();
  }
  print_text(*response);
  return absl::OkStatus();
}

absl::Status RunCheckpointList(const ShardctlArgs& args, std::ostream& out) {
  v1::ListCheckpointsRequest request;
  request.set_job_id(args.checkpoint_job);
  return CallAndPrint<v1::ListCheckpointsResponse>(
      args, out,
      [&](CoordinatorClient& client) {
        return client.ListCheckpoints(request);
      },
      [&](const v1::ListCheckpointsResponse& response) {
        out << "Checkpoints (" << response.checkpoints_size() << ")\n";
        if (response.checkpoints_size() == 0) return;
        out << absl::StrFormat("  %-28s  %10s  %5s  %s\n", "name", "step",
                               "world", "strategy");
        for (const v1::CheckpointInfo& info : response.checkpoints()) {
          out << absl::StrFormat("  %-28s  %10d  %5d  %s\n", info.name(),
                                 info.step(), info.world_size(),
                                 info.strategy());
        }
      });
}

absl::Status RunCheckpointSave(const ShardctlArgs& args, std::ostream& out) {
  v1::SaveCheckpointRequest request;
  request.set_job_id(args.checkpoint_job);
  return CallAndPrint<v1::SaveCheckpointResponse>(
      args, out,
      [&](CoordinatorClient& client) { return client.SaveCheckpoint(request); },
      [&](const v1::SaveCheckpointResponse& response) {
        out << "Saved checkpoint " << response.checkpoint() << " (step "
            << response.step() << ")\n";
      });
}

absl::Status RunCheckpointLoad(const ShardctlArgs& args, std::ostream& out) {
  v1::LoadCheckpointRequest request;
  request.set_job_id(args.checkpoint_job);
  request.set_checkpoint(args.checkpoint_path);
  return CallAndPrint<v1::LoadCheckpointResponse>(
      args, out,
      [&](CoordinatorClient& client) { return client.LoadCheckpoint(request); },
      [&](const v1::LoadCheckpointResponse& response) {
        out << "Job " << args.checkpoint_job << " rolled back to "
            << args.checkpoint_path << "; it trains on from step "
            << response.step() << "\n";
      });
}

// ---------------------------------------------------------------------------
// checkpoint consolidate

absl::Status RunCheckpointConsolidate(const ShardctlArgs& args,
                                      std::ostream& out) {
  if (args.hf_naming.empty()) {
    absl::StatusOr<std::string> written =
        checkpoint::ConsolidateCheckpoint(args.checkpoint_path, args.out_path);
    if (!written.ok()) return written.status();
    out << "Consolidated " << args.checkpoint_path << " into " << *written
        << "\n";
    return absl::OkStatus();
  }
  // ParseShardctlArgs accepts only these and "none".
  checkpoint::HfMoeNaming naming = checkpoint::HfMoeNaming::kNone;
  if (args.hf_naming == "qwen3-moe") {
    naming = checkpoint::HfMoeNaming::kQwen3Moe;
  } else if (args.hf_naming == "mixtral") {
    naming = checkpoint::HfMoeNaming::kMixtral;
  } else if (args.hf_naming == "gpt-oss") {
    naming = checkpoint::HfMoeNaming::kGptOss;
  } else if (args.hf_naming == "diffusion-gemma") {
    naming = checkpoint::HfMoeNaming::kDiffusionGemma;
  }
  absl::Status exported = checkpoint::ExportCheckpointToHf(
      args.checkpoint_path, naming, args.out_path);
  if (!exported.ok()) return exported;
  out << "Exported " << args.checkpoint_path << " as HF safetensors ("
      << args.hf_naming << " naming) into " << args.out_path << "\n";
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// checkpoint export

absl::Status RunCheckpointExport(const ShardctlArgs& args, std::ostream& out) {
  // A LoRA checkpoint's trained state is its adapters: export those as PEFT
  // loads them onto the base model.
  const absl::StatusOr<bool> lora =
      checkpoint::CheckpointHasLora(args.checkpoint_path);
  if (!lora.ok()) return lora.status();
  if (*lora) {
    const absl::Status exported =
        checkpoint::ExportPeftAdapters(args.checkpoint_path, args.out_path,
                                       args.base_path);
    if (!exported.ok()) return exported;
    out << "Exported " << args.checkpoint_path
        << " as PEFT LoRA adapters (adapter_model.safetensors, "
           "adapter_config.json) into "
        << args.out_path << "\n";
    return absl::OkStatus();
  }
  const absl::Status exported = checkpoint::ExportHfModel(
      args.checkpoint_path, args.out_path, args.max_shard_bytes);
  if (!exported.ok()) return exported;
  out << "Exported " << args.checkpoint_path
      << " as a Hugging Face model (safetensors and config.json) into "
      << args.out_path << "\n";
  return absl::OkStatus();
}

}  // namespace

int RunShardctl(const std::vector<std::string>& argv, std::ostream& out,
                std::ostream& err) {
  return RunShardctl(argv, out, err, ShardctlEnvironment());
}

int RunShardctl(const std::vector<std::string>& argv, std::ostream& out,
                std::ostream& err, const ShardctlEnvironment& environment) {
  absl::StatusOr<ShardctlArgs> args = ParseShardctlArgs(argv);
  if (!args.ok()) {
    err << "shardctl: " << args.status().message()
        << "\nRun 'shardctl --help' for usage.\n";
    return kShardctlUsage;
  }
  if (args->token_file.empty()) args->token_file = environment.token_file;
  if (args->command == ShardctlCommand::kHelp) {
    out << ShardctlUsage(args->help_for);
    return kShardctlOk;
  }
  absl::Status status;
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      args->command == ShardctlCommand::kTrain ||
              args->command == ShardctlCommand::kCheckpointList ||
              args->command == ShardctlCommand::kCheckpointConsolidate ||
              args->command == ShardctlCommand::kCheckpointExport ||
              args->command == ShardctlCommand::kCheckpointSave ||
              args->command == ShardctlCommand::kCheckpointLoad
          ? absl::StatusOr<std::unique_ptr<Backend>>(nullptr)
          : MakeBackend(*args);
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
      case ShardctlCommand::kTrain:
        status = RunTrain(*args, environment.out_is_tty, out);
        break;
      case ShardctlCommand::kCheckpointList:
        status = RunCheckpointList(*args, out);
        break;
      case ShardctlCommand::kCheckpointConsolidate:
        status = RunCheckpointConsolidate(*args, out);
        break;
      case ShardctlCommand::kCheckpointExport:
        status = RunCheckpointExport(*args, out);
        break;
      case ShardctlCommand::kCheckpointSave:
        status = RunCheckpointSave(*args, out);
        break;
      case ShardctlCommand::kCheckpointLoad:
        status = RunCheckpointLoad(*args, out);
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
