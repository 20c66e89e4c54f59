#ifndef SHARDD_CLIENT_TRAIN_REPORT_H_
#define SHARDD_CLIENT_TRAIN_REPORT_H_

// What `shardctl train` prints about a job: the progress line while it runs
// and the summary at its end, computed from the job's StepEvents.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "proto/coordinator.pb.h"

namespace shardd {

// Draws progress: on a terminal one line rewritten in place ("step 12/300
// [===>   ] loss 2.3456 | 12.3K tok/s | ETA 41s"); otherwise a plain line
// for step 1, every `every` steps (0: about 20 lines per job) and the last.
// The ETA is the mean step time of the last 20 steps times the steps left.
class TrainProgress {
 public:
  TrainProgress(std::ostream& out, bool tty, int32_t total_steps,
                int32_t every);

  void Update(const v1::StepEvent& event);
  // An evaluation's event (eval_loss set): shown as "| eval X" on the
  // progress line from now on; without a terminal also a line of its own.
  void Eval(const v1::StepEvent& event);
  // Ends the terminal line, before other output.
  void Close();

 private:
  std::ostream& out_;
  const bool tty_;
  const int32_t total_;
  const int32_t every_;
  std::string Line(const v1::StepEvent& event) const;

  std::vector<double> recent_seconds_;
  bool line_open_ = false;
  v1::StepEvent last_;  // The last step's event (redrawn after an eval).
  bool has_last_ = false;
  double eval_loss_ = 0;
  bool has_eval_ = false;
};

struct TrainSummary {
  int64_t steps = 0;
  double first_loss = 0;
  // Mean over the last 10% of the steps (rounded, at least one).
  double final_loss = 0;
  int64_t final_window = 0;
  // From the events; 0 for token-file data (no known floor).
  double entropy_rate = 0;
  double gap_percent = 0;  // 100 * (final_loss - entropy) / entropy.
  // The floor of a model without attention (sees one previous token); 0
  // when unknown or equal to entropy_rate (first-order data).
  double one_token_loss = 0;
  int64_t tokens = 0;
  double step_seconds = 0;
  double tokens_per_second = 0;  // tokens / step_seconds.
  int64_t measured_peak = 0;     // Max over steps (and ranks).
  int64_t planned_peak = 0;
  // Activations, where the plan models them (0 otherwise).
  int64_t measured_activations = 0;  // Max over steps (and ranks).
  int64_t planned_activations = 0;
  int64_t all_gathers = 0;  // Per rank, in the last step.
  int64_t reduce_scatters = 0;
  int64_t all_to_alls = 0;  // Expert parallelism's token exchanges.
  // DiffusionGemma's block-diffusion step (set by the caller from the
  // plan): the loss is the canvas's diffusion cross-entropy plus the
  // encoder's next-token cross-entropy, which the data's entropy rate does
  // not bound, so the summary gives it no reference.
  bool block_diffusion = false;
  // The last evaluation (eval_step 0: none): held-out loss and tokens.
  int64_t eval_step = 0;
  double eval_loss = 0;
  int64_t eval_tokens = 0;
};

// Summarizes a job's step events (in step order, without the error event)
// and its evaluations' events (in order; may be empty).
TrainSummary SummarizeTraining(const std::vector<v1::StepEvent>& events,
                               const std::vector<v1::StepEvent>& evals = {});

// The summary block `shardctl train` prints.
std::string FormatTrainSummary(const TrainSummary& summary);

}  // namespace shardd

#endif  // SHARDD_CLIENT_TRAIN_REPORT_H_
