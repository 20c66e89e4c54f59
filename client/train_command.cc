#include "client/train_command.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "client/plan_printer.h"
#include "client/plan_timeline.h"
#include "client/shardctl_io.h"
#include "client/train_report.h"
#include "model/native_spec.h"
#include "nlohmann/json.hpp"
#include "viz/timeline_svg.h"

namespace shardd {
namespace {

// train --loss-svg: the loss curve of the finished job.
absl::Status WriteLossSvg(const ShardctlArgs& args,
                          const std::string& model_name,
                          const v1::ShardingPlan& plan, int world_size,
                          const std::vector<v1::StepEvent>& events,
                          const std::vector<v1::StepEvent>& evals,
                          double entropy_rate, std::ostream* out) {
  std::vector<std::pair<double, double>> losses;
  for (const v1::StepEvent& event : events) {
    losses.push_back({static_cast<double>(event.step()), event.loss()});
  }
  std::vector<std::pair<double, double>> eval_losses;
  for (const v1::StepEvent& event : evals) {
    eval_losses.push_back(
        {static_cast<double>(event.step()), event.eval_loss()});
  }
  if (losses.empty()) {
    return absl::FailedPreconditionError(
        "--loss-svg: the job reported no steps");
  }
  const ChartSpec chart =
      LossChart(absl::StrCat(model_name, ": training loss, ", plan.strategy(),
                             ", world size ", world_size),
                losses, entropy_rate, eval_losses);
  absl::StatusOr<std::string> svg = RenderChartSvg(chart);
  if (!svg.ok()) return svg.status();
  absl::Status written = WriteTextFile("--loss-svg", args.loss_svg_path, *svg);
  if (!written.ok()) return written;
  if (out != nullptr) *out << "Loss curve  " << args.loss_svg_path << "\n";
  return absl::OkStatus();
}

// One `shardctl train --json` line per step.
nlohmann::ordered_json StepEventJson(const v1::StepEvent& event) {
  nlohmann::ordered_json json;
  json["event"] = "step";
  json["step"] = event.step();
  json["loss"] = event.loss();
  json["grad_norm"] = event.grad_norm();
  json["lr"] = event.lr();
  json["tokens"] = event.tokens();
  json["step_seconds"] = event.step_seconds();
  json["tokens_per_second"] = event.tokens_per_second();
  json["peak_unsharded_bytes"] = event.peak_unsharded_bytes();
  if (event.all_to_alls() > 0) {
    // Expert parallelism's token exchanges (per rank, the most any sent).
    json["all_to_alls"] = event.all_to_alls();
    json["all_to_all_bytes"] = event.all_to_all_bytes();
  }
  if (!event.checkpoint().empty()) json["checkpoint"] = event.checkpoint();
  if (!event.checkpoint_error().empty()) {
    json["checkpoint_error"] = event.checkpoint_error();
  }
  if (event.checkpoints_deleted_size() > 0) {
    json["checkpoints_deleted"] = std::vector<std::string>(
        event.checkpoints_deleted().begin(), event.checkpoints_deleted().end());
  }
  return json;
}

}  // namespace

absl::Status RunTrain(const ShardctlArgs& args, bool tty, std::ostream& out) {
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> connected =
      ConnectTo(args);
  if (!connected.ok()) return connected.status();
  CoordinatorClient& client = **connected;
  client.set_call_timeout(args.timeout);

  std::string model_id = args.model_id;
  std::string model_name = args.model_id;
  v1::ShardingPlan plan;
  v1::ModelSummary model_summary;
  if (!args.model_path.empty()) {
    absl::StatusOr<std::string> text = ReadInputFile("--model", args.model_path);
    if (!text.ok()) return text.status();
    absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromJson(*text);
    if (!spec.ok()) return spec.status();
    v1::SubmitModelRequest request;
    *request.mutable_spec() = *std::move(spec);
    *request.mutable_options() = args.options;
    request.set_name(BaseName(args.model_path));
    model_name = request.name();
    v1::MeshSpec* mesh = request.mutable_options()->mutable_mesh();
    if (mesh->dp_shard() == 0) {
      // Default: shard over every live worker.
      absl::StatusOr<v1::GetStatusResponse> status = client.GetStatus();
      if (!status.ok()) return status.status();
      int live = 0;
      for (const v1::WorkerInfo& worker : status->workers()) {
        if (worker.alive()) ++live;
      }
      if (live == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "--dp: no live workers on the coordinator at ", args.coordinator,
            "; start shardd-worker processes with --coordinator ",
            args.coordinator, " (shardctl status lists them)"));
      }
      const int replicate = std::max(1, mesh->dp_replicate());
      if (live % replicate != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--replicate: ", replicate, " does not divide the ",
                         live, " live workers; pass --dp N"));
      }
      mesh->set_dp_shard(live / replicate);
    }
    absl::StatusOr<v1::SubmitModelResponse> submitted =
        client.SubmitModel(request);
    if (!submitted.ok()) return submitted.status();
    model_id = submitted->model_id();
    plan = submitted->plan();
    model_summary = submitted->summary();
  } else {
    v1::GetPlanRequest request;
    request.set_model_id(args.model_id);
    absl::StatusOr<v1::GetPlanResponse> stored = client.GetPlan(request);
    if (!stored.ok()) return stored.status();
    plan = stored->plan();
    model_summary = stored->summary();
  }

  v1::SubmitStepRequest step;
  step.set_model_id(model_id);
  *step.mutable_config() = args.train;
  absl::StatusOr<v1::SubmitStepResponse> job = client.SubmitStep(step);
  if (!job.ok()) return job.status();
  const v1::TrainConfig& config = args.train;

  if (!args.json) {
    // A LoRA job trains its adapters only (docs/lora.md).
    const v1::LoraConfig& lora = args.options.lora();
    const std::string trainable =
        lora.rank() > 0
            ? absl::StrFormat(", %s trainable: LoRA rank %d, alpha %g",
                              HumanCount(model_summary.trainable_params()),
                              lora.rank(), lora.alpha())
            : "";
    out << absl::StrFormat("Model   %s (%s, %s parameters%s), id %s\n",
                           model_name, plan.architecture(),
                           HumanCount(model_summary.total_params()), trainable,
                           model_id);
    out << absl::StrFormat(
        "Plan    strategy %s, %d units, dp_shard %d x dp_replicate %d on %d "
        "workers\n",
        plan.strategy(), plan.units_size(), plan.mesh().dp_shard(),
        plan.mesh().dp_replicate(), job->world_size());
    out << absl::StrFormat(
        "Job     %s: %d steps of %d sequences x %d tokens, %d micro-batch%s%s, "
        "lr %g, %s%s\n",
        job->job_id(), config.steps(), config.global_batch(), config.seq_len(),
        std::max(1, config.microbatches()),
        std::max(1, config.microbatches()) == 1 ? "" : "es",
        config.defer_grad_sync() ? " (deferred grad sync)" : "", config.lr(),
        config.data_path().empty()
            ? (config.synthetic_order() > 1
                   ? absl::StrCat("synthetic data of order ",
                                  config.synthetic_order(), " (seed ",
                                  config.seed(), ")")
                   : absl::StrCat("synthetic Markov data (seed ",
                                  config.seed(), ")"))
            : absl::StrCat("data ", config.data_path()),
        config.fine_grained() ? ", one RPC per command" : "");
    if (!config.resume_from().empty()) {
      out << "Resume  from checkpoint " << config.resume_from() << "\n";
    }
    if (!config.init_from().empty()) {
      out << "Init    from the Hugging Face weights in " << config.init_from()
          << "\n";
    }
    out << std::flush;
  }

  // The committed trajectory: a rollback to a checkpoint drops the steps
  // after it (they run again).
  std::vector<v1::StepEvent> events;
  // Evaluations, in order (a rollback keeps those of the dropped steps: they
  // were measured).
  std::vector<v1::StepEvent> evals;
  // Interruptions and recoveries, in order, as printed.
  std::vector<std::string> incidents;
  std::string failure;
  TrainProgress progress(out, tty && !args.json, config.steps(),
                         args.log_every);
  int64_t last_step = 0;
  auto on_event = [&](const v1::StepEvent& event) {
    if (!event.error().empty()) {
      failure = event.error();
      return true;
    }
    if (!event.interruption().empty() || !event.recovery().empty()) {
      const std::string line =
          event.interruption().empty()
              ? absl::StrCat("recovered at step ", event.step(), ": ",
                             event.recovery())
              : absl::StrCat("interrupted at step ", event.step(), ": ",
                             event.interruption());
      incidents.push_back(line);
      if (!event.recovery().empty()) {
        while (!events.empty() && events.back().step() > event.step()) {
          events.pop_back();
        }
        last_step = event.step();
      }
      if (args.json) {
        nlohmann::ordered_json line_json;
        line_json["event"] =
            event.interruption().empty() ? "recovery" : "interruption";
        line_json["step"] = event.step();
        line_json["message"] = event.interruption().empty()
                                   ? event.recovery()
                                   : event.interruption();
        out << line_json.dump() << "\n" << std::flush;
      } else {
        progress.Close();
        out << line << "\n" << std::flush;
      }
      return true;
    }
    if (event.has_eval_loss()) {
      evals.push_back(event);
      if (args.json) {
        nlohmann::ordered_json line_json;
        line_json["event"] = "eval";
        line_json["step"] = event.step();
        line_json["eval_loss"] = event.eval_loss();
        line_json["eval_tokens"] = event.eval_tokens();
        line_json["all_gathers"] = event.all_gathers();
        out << line_json.dump() << "\n" << std::flush;
      } else {
        progress.Eval(event);
      }
      return true;
    }
    events.push_back(event);
    last_step = event.step();
    if (args.json) {
      out << StepEventJson(event).dump() << "\n" << std::flush;
    } else {
      progress.Update(event);
    }
    return true;
  };
  // A coordinator that went away may be restarting (its jobs go on): keep
  // watching from the last step seen for up to --reconnect-timeout.
  absl::Status watched;
  absl::Time reconnect_deadline = absl::InfiniteFuture();
  while (true) {
    v1::WatchStepRequest watch;
    watch.set_job_id(job->job_id());
    watch.set_from_step(last_step + 1);
    const size_t seen = events.size() + incidents.size();
    watched = client.WatchStep(watch, args.watch_timeout, on_event);
    const bool lost = absl::IsUnavailable(watched) ||
                      (absl::IsInternal(watched) &&
                       absl::StrContains(watched.message(), "stream ended"));
    if (!lost) break;
    if (events.size() + incidents.size() > seen) {
      reconnect_deadline = absl::InfiniteFuture();  // It was making progress.
    }
    if (reconnect_deadline == absl::InfiniteFuture()) {
      reconnect_deadline = absl::Now() + args.reconnect_timeout;
      if (!args.json) {
        progress.Close();
        out << "lost the coordinator (" << watched.message()
            << "); reconnecting for up to "
            << absl::FormatDuration(args.reconnect_timeout) << "\n"
            << std::flush;
      }
    }
    if (absl::Now() >= reconnect_deadline) break;
    absl::SleepFor(absl::Milliseconds(500));
  }
  progress.Close();
  if (!watched.ok()) {
    return absl::Status(watched.code(), absl::StrCat("job ", job->job_id(),
                                                     ": ", watched.message()));
  }
  if (!failure.empty()) {
    // The error names the step, the rank and the cause.
    return absl::AbortedError(
        absl::StrCat("job ", job->job_id(), " failed: ", failure));
  }
  TrainSummary summary = SummarizeTraining(events, evals);
  // The planner's rule for DiffusionGemma's 3-pass step (one without
  // gradients): its loss is not a next-token loss.
  summary.block_diffusion =
      plan.architecture() == "DiffusionGemmaForBlockDiffusion" &&
      plan.step().passes() == 3 && plan.step().no_grad_passes() == 1;
  if (args.json) {
    nlohmann::ordered_json json;
    json["event"] = "summary";
    json["job_id"] = job->job_id();
    json["model_id"] = model_id;
    json["world_size"] = job->world_size();
    json["steps"] = summary.steps;
    json["first_loss"] = summary.first_loss;
    json["final_loss"] = summary.final_loss;
    json["final_window"] = summary.final_window;
    json["data_entropy_rate"] = summary.entropy_rate;
    json["data_one_token_loss"] = summary.one_token_loss;
    if (summary.block_diffusion) {
      // No comparable reference (see FormatTrainSummary).
      json["gap_percent"] = nullptr;
      json["loss_terms"] = "diffusion_ce+encoder_ce";
    } else {
      json["gap_percent"] = summary.gap_percent;
    }
    json["tokens"] = summary.tokens;
    json["step_seconds"] = summary.step_seconds;
    json["tokens_per_second"] = summary.tokens_per_second;
    json["peak_unsharded_bytes"] = summary.measured_peak;
    json["planned_peak_unsharded_bytes"] = summary.planned_peak;
    json["peak_activation_bytes"] = summary.measured_activations;
    json["planned_peak_activation_bytes"] = summary.planned_activations;
    json["all_gathers_per_step"] = summary.all_gathers;
    json["reduce_scatters_per_step"] = summary.reduce_scatters;
    json["all_to_alls_per_step"] = summary.all_to_alls;
    nlohmann::ordered_json losses = nlohmann::ordered_json::array();
    for (const v1::StepEvent& event : events) losses.push_back(event.loss());
    json["losses"] = std::move(losses);
    nlohmann::ordered_json steps = nlohmann::ordered_json::array();
    for (const v1::StepEvent& event : events) steps.push_back(event.step());
    json["step_numbers"] = std::move(steps);
    nlohmann::ordered_json checkpoints = nlohmann::ordered_json::array();
    for (const v1::StepEvent& event : events) {
      if (!event.checkpoint().empty())
        checkpoints.push_back(event.checkpoint());
    }
    json["checkpoints"] = std::move(checkpoints);
    nlohmann::ordered_json deleted = nlohmann::ordered_json::array();
    nlohmann::ordered_json failures = nlohmann::ordered_json::array();
    for (const v1::StepEvent& event : events) {
      for (const std::string& d : event.checkpoints_deleted()) {
        deleted.push_back(d);
      }
      if (!event.checkpoint_error().empty()) {
        failures.push_back({{"step", event.step()},
                            {"error", event.checkpoint_error()}});
      }
    }
    json["checkpoints_deleted"] = std::move(deleted);
    json["checkpoint_failures"] = std::move(failures);
    nlohmann::ordered_json eval_losses = nlohmann::ordered_json::array();
    nlohmann::ordered_json eval_steps = nlohmann::ordered_json::array();
    for (const v1::StepEvent& event : evals) {
      eval_losses.push_back(event.eval_loss());
      eval_steps.push_back(event.step());
    }
    json["eval_losses"] = std::move(eval_losses);
    json["eval_step_numbers"] = std::move(eval_steps);
    json["incidents"] = incidents;
    out << json.dump() << "\n";
  } else {
    out << FormatTrainSummary(summary);
    for (const v1::StepEvent& event : events) {
      if (!event.checkpoint().empty()) {
        out << "Checkpoint  " << event.checkpoint() << "\n";
      }
      for (const std::string& d : event.checkpoints_deleted()) {
        out << "Deleted     " << d << " (--keep-checkpoints)\n";
      }
      if (!event.checkpoint_error().empty()) {
        out << "Not saved   after step " << event.step() << ": "
            << event.checkpoint_error() << "\n";
      }
    }
  }
  if (!args.loss_svg_path.empty()) {
    absl::Status drawn =
        WriteLossSvg(args, model_name, plan, job->world_size(), events, evals,
                     summary.entropy_rate, args.json ? nullptr : &out);
    if (!drawn.ok()) return drawn;
  }
  return absl::OkStatus();
}


}  // namespace shardd
