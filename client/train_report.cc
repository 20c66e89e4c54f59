#include "client/train_report.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/plan_printer.h"

namespace shardd {
namespace {

constexpr size_t kWindow = 20;
constexpr int kBarWidth = 24;

int Digits(int64_t n) { return static_cast<int>(absl::StrCat(n).size()); }

std::string ShortDuration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
}

}  // namespace

TrainProgress::TrainProgress(std::ostream& out, bool tty, int32_t total_steps,
                             int32_t every)
    : out_(out),
      tty_(tty),
      total_(std::max(1, total_steps)),
      every_(every > 0 ? every : std::max(1, total_ / 20)) {}

void TrainProgress::Update(const v1::StepEvent& event) {
  recent_seconds_.push_back(event.step_seconds());
  if (recent_seconds_.size() > kWindow) {
    recent_seconds_.erase(recent_seconds_.begin());
  }
  last_ = event;
  has_last_ = true;
  if (tty_) {
    // \r returns to the line start; \x1b[K clears what a longer line left.
    out_ << "\r" << Line(event) << "\x1b[K" << std::flush;
    line_open_ = true;
  } else if (event.step() == 1 || event.step() % every_ == 0 ||
             event.step() >= total_ || event.done()) {
    out_ << Line(event) << "\n" << std::flush;
  }
}

void TrainProgress::Eval(const v1::StepEvent& event) {
  eval_loss_ = event.eval_loss();
  has_eval_ = true;
  if (tty_) {
    if (has_last_) {
      out_ << "\r" << Line(last_) << "\x1b[K" << std::flush;
      line_open_ = true;
    }
    return;
  }
  out_ << absl::StrFormat(
              "eval after step %*d/%d  held-out loss %.4f (%s "
              "tokens)\n",
              Digits(total_), event.step(), total_, event.eval_loss(),
              HumanCount(event.eval_tokens()))
       << std::flush;
}

std::string TrainProgress::Line(const v1::StepEvent& event) const {
  double mean_seconds = 0;
  for (double seconds : recent_seconds_) mean_seconds += seconds;
  mean_seconds /= static_cast<double>(recent_seconds_.size());
  const int64_t left = std::max<int64_t>(0, total_ - event.step());
  // The learning rate when the workers report it (they all do; an event
  // from an older coordinator carries 0).
  const std::string lr =
      event.lr() > 0 ? absl::StrFormat(" | lr %.3g", event.lr()) : "";
  const std::string eval =
      has_eval_ ? absl::StrFormat(" | eval %.4f", eval_loss_) : "";
  const std::string stats = absl::StrFormat(
      "loss %.4f%s%s | %s tok/s | ETA %s", event.loss(), eval, lr,
      HumanCount(static_cast<int64_t>(event.tokens_per_second())),
      ShortDuration(mean_seconds * static_cast<double>(left)));
  if (!tty_) {
    return absl::StrFormat("step %*d/%d  %s", Digits(total_), event.step(),
                           total_, stats);
  }
  const int filled = static_cast<int>(
      std::min<int64_t>(kBarWidth, kBarWidth * event.step() / total_));
  std::string bar(kBarWidth, ' ');
  for (int i = 0; i < filled; ++i) bar[i] = '=';
  if (filled < kBarWidth) bar[filled] = '>';
  return absl::StrFormat("step %*d/%d [%s] %s", Digits(total_), event.step(),
                         total_, bar, stats);
}

void TrainProgress::Close() {
  if (line_open_) out_ << "\n";
  line_open_ = false;
}

TrainSummary SummarizeTraining(const std::vector<v1::StepEvent>& events,
                               const std::vector<v1::StepEvent>& evals) {
  TrainSummary summary;
  if (!evals.empty()) {
    summary.eval_step = evals.back().step();
    summary.eval_loss = evals.back().eval_loss();
    summary.eval_tokens = evals.back().eval_tokens();
  }
  if (events.empty()) return summary;
  summary.steps = events.back().step();
  summary.first_loss = events.front().loss();
  summary.final_window = std::max<int64_t>(
      1, static_cast<int64_t>(std::llround(0.1 * events.size())));
  double sum = 0;
  for (size_t i = events.size() - summary.final_window; i < events.size();
       ++i) {
    sum += events[i].loss();
  }
  summary.final_loss = sum / static_cast<double>(summary.final_window);
  summary.entropy_rate = events.back().data_entropy_rate();
  summary.one_token_loss = events.back().data_one_token_loss();
  if (summary.entropy_rate > 0) {
    summary.gap_percent = 100.0 * (summary.final_loss - summary.entropy_rate) /
                          summary.entropy_rate;
  }
  for (const v1::StepEvent& event : events) {
    summary.tokens += event.tokens();
    summary.step_seconds += event.step_seconds();
    summary.measured_peak =
        std::max(summary.measured_peak, event.peak_unsharded_bytes());
    summary.measured_activations =
        std::max(summary.measured_activations, event.peak_activation_bytes());
  }
  if (summary.step_seconds > 0) {
    summary.tokens_per_second =
        static_cast<double>(summary.tokens) / summary.step_seconds;
  }
  summary.planned_peak = events.back().planned_peak_unsharded_bytes();
  summary.planned_activations = events.back().planned_peak_activation_bytes();
  summary.all_gathers = events.back().all_gathers();
  summary.reduce_scatters = events.back().reduce_scatters();
  summary.all_to_alls = events.back().all_to_alls();
  return summary;
}

std::string FormatTrainSummary(const TrainSummary& s) {
  std::string out = "Summary\n";
  absl::StrAppend(&out,
                  absl::StrFormat("  steps                %d\n", s.steps));
  absl::StrAppend(&out,
                  absl::StrFormat("  loss                 %.4f at step 1 -> "
                                  "%.4f (mean of the last %d steps)\n",
                                  s.first_loss, s.final_loss, s.final_window));
  if (s.entropy_rate > 0 && s.block_diffusion) {
    absl::StrAppend(
        &out,
        absl::StrFormat("  data entropy rate    %.4f nats/token, the floor of "
                        "a next-token loss; this loss is block diffusion's "
                        "(canvas diffusion CE + encoder next-token CE), which "
                        "it does not bound: no gap is given\n",
                        s.entropy_rate));
  } else if (s.entropy_rate > 0) {
    absl::StrAppend(
        &out, absl::StrFormat("  data entropy rate    %.4f nats/token (the "
                              "best reachable loss); gap %+.2f%%\n",
                              s.entropy_rate, s.gap_percent));
  } else {
    absl::StrAppend(&out,
                    "  data entropy rate    unknown (data from a file)\n");
  }
  if (s.eval_step > 0) {
    absl::StrAppend(
        &out,
        absl::StrFormat("  held-out loss        %.4f after step %d (%s "
                        "eval tokens)\n",
                        s.eval_loss, s.eval_step, HumanCount(s.eval_tokens)));
  }
  if (s.one_token_loss > s.entropy_rate + 1e-9 && s.entropy_rate > 0 &&
      !s.block_diffusion) {
    absl::StrAppend(
        &out,
        absl::StrFormat("  without attention    %.4f nats/token (the floor of "
                        "a model that sees one token back); %s\n",
                        s.one_token_loss,
                        s.final_loss < s.one_token_loss
                            ? "beaten: attention is at work"
                            : "not beaten"));
  }
  absl::StrAppend(
      &out,
      absl::StrFormat("  throughput           %s tokens/s (%s tokens in %.1f s "
                      "of steps)\n",
                      HumanCount(static_cast<int64_t>(s.tokens_per_second)),
                      HumanCount(s.tokens), s.step_seconds));
  auto verdict = [](int64_t measured, int64_t planned) -> std::string {
    if (measured == planned) return "equal";
    return absl::StrFormat("differ by %s%s", measured > planned ? "+" : "-",
                           HumanBytes(std::abs(measured - planned)));
  };
  absl::StrAppend(
      &out,
      absl::StrFormat("  peak unsharded/rank  measured %s, planned %s "
                      "(%s)\n",
                      HumanBytes(s.measured_peak), HumanBytes(s.planned_peak),
                      verdict(s.measured_peak, s.planned_peak)));
  if (s.planned_activations > 0) {
    absl::StrAppend(
        &out, absl::StrFormat(
                  "  activations/rank    measured %s, planned %s (%s)\n",
                  HumanBytes(s.measured_activations),
                  HumanBytes(s.planned_activations),
                  verdict(s.measured_activations, s.planned_activations)));
  }
  absl::StrAppend(&out,
                  absl::StrFormat("  collectives/step     %d all-gathers, %d "
                                  "reduce-scatters%s per rank\n",
                                  s.all_gathers, s.reduce_scatters,
                                  s.all_to_alls > 0
                                      ? absl::StrFormat(
                                            ", %d all-to-alls (expert "
                                            "dispatch and combine)",
                                            s.all_to_alls)
                                      : ""));
  return out;
}

}  // namespace shardd
