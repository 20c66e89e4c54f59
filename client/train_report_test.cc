#include "client/train_report.h"

#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/coordinator.pb.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::StepEvent Event(int64_t step, double loss) {
  v1::StepEvent event;
  event.set_step(step);
  event.set_loss(loss);
  event.set_tokens(1000);
  event.set_step_seconds(0.5);
  event.set_tokens_per_second(2000);
  event.set_data_entropy_rate(1.0);
  event.set_peak_unsharded_bytes(4096);
  event.set_planned_peak_unsharded_bytes(4096);
  event.set_all_gathers(4);
  event.set_reduce_scatters(3);
  return event;
}

TEST(SummarizeTrainingTest, FinalLossIsTheMeanOfTheLastTenthOfSteps) {
  // Loss 5 - 0.2 (s - 1) for s = 1..20: the last 2 steps have 1.4 and 1.2.
  std::vector<v1::StepEvent> events;
  for (int s = 1; s <= 20; ++s) events.push_back(Event(s, 5 - 0.2 * (s - 1)));
  events[7].set_peak_unsharded_bytes(5000);  // One step peaked higher.
  const TrainSummary summary = SummarizeTraining(events);
  EXPECT_EQ(summary.steps, 20);
  EXPECT_DOUBLE_EQ(summary.first_loss, 5.0);
  EXPECT_EQ(summary.final_window, 2);
  EXPECT_NEAR(summary.final_loss, 1.3, 1e-12);
  EXPECT_DOUBLE_EQ(summary.entropy_rate, 1.0);
  EXPECT_NEAR(summary.gap_percent, 30.0, 1e-9);
  EXPECT_EQ(summary.tokens, 20000);
  EXPECT_DOUBLE_EQ(summary.step_seconds, 10.0);
  EXPECT_DOUBLE_EQ(summary.tokens_per_second, 2000.0);
  EXPECT_EQ(summary.measured_peak, 5000);
  EXPECT_EQ(summary.planned_peak, 4096);
  EXPECT_EQ(summary.all_gathers, 4);
  EXPECT_EQ(summary.reduce_scatters, 3);
}

TEST(SummarizeTrainingTest, ShortJobsAverageAtLeastOneStep) {
  const TrainSummary three =
      SummarizeTraining({Event(1, 3), Event(2, 2), Event(3, 1.5)});
  EXPECT_EQ(three.final_window, 1);
  EXPECT_DOUBLE_EQ(three.final_loss, 1.5);
  // 15 steps: round(1.5) = 2.
  std::vector<v1::StepEvent> events;
  for (int s = 1; s <= 15; ++s) events.push_back(Event(s, s));
  const TrainSummary fifteen = SummarizeTraining(events);
  EXPECT_EQ(fifteen.final_window, 2);
  EXPECT_DOUBLE_EQ(fifteen.final_loss, 14.5);
  EXPECT_EQ(SummarizeTraining({}).steps, 0);
}

TEST(FormatTrainSummaryTest, SaysWhetherPeaksMatchAndWhenTheFloorIsUnknown) {
  std::vector<v1::StepEvent> events = {Event(1, 2.0), Event(2, 1.1)};
  std::string text = FormatTrainSummary(SummarizeTraining(events));
  EXPECT_THAT(text, HasSubstr("2.0000 at step 1 -> 1.1000"));
  EXPECT_THAT(text, HasSubstr("1.0000 nats/token"));
  EXPECT_THAT(text, HasSubstr("gap +10.00%"));
  EXPECT_THAT(text, HasSubstr("measured 4.00 KiB, planned 4.00 KiB (equal)"));
  EXPECT_THAT(text, HasSubstr("4 all-gathers, 3 reduce-scatters per rank"));

  events[1].set_peak_unsharded_bytes(4096 + 1024);
  events[1].set_data_entropy_rate(0);
  text = FormatTrainSummary(SummarizeTraining(events));
  EXPECT_THAT(text, HasSubstr("differ by +1.00 KiB"));
  EXPECT_THAT(text, HasSubstr("unknown (data from a file)"));
  EXPECT_THAT(text, Not(HasSubstr("gap")));
}

// Issue 32 item 5: DiffusionGemma's block-diffusion loss (diffusion CE on
// the canvas + the encoder's next-token CE) is not a next-token loss, so
// the entropy rate is shown for what it is and no gap is given.
TEST(FormatTrainSummaryTest, BlockDiffusionGetsNoNextTokenGap) {
  std::vector<v1::StepEvent> events = {Event(1, 9.0), Event(2, 6.7)};
  events[1].set_data_one_token_loss(1.5);
  TrainSummary summary = SummarizeTraining(events);
  summary.block_diffusion = true;
  const std::string text = FormatTrainSummary(summary);
  EXPECT_THAT(text, HasSubstr("9.0000 at step 1 -> 6.7000"));
  EXPECT_THAT(text, HasSubstr("1.0000 nats/token, the floor of a next-token "
                              "loss"));
  EXPECT_THAT(text, HasSubstr("canvas diffusion CE + encoder next-token CE"));
  EXPECT_THAT(text, HasSubstr("no gap is given"));
  EXPECT_THAT(text, Not(HasSubstr("gap +")));
  EXPECT_THAT(text, Not(HasSubstr("without attention")));
  // The same events as a next-token job keep their gap.
  EXPECT_THAT(FormatTrainSummary(SummarizeTraining(events)),
              HasSubstr("gap +570.00%"));
}

TEST(FormatTrainSummaryTest, ShowsTheAttentionFreeFloorOfOrderKData) {
  std::vector<v1::StepEvent> events = {Event(1, 3.0), Event(2, 1.1)};
  // First-order data: the floor equals the best loss and is not shown.
  events[1].set_data_one_token_loss(1.0);
  EXPECT_THAT(FormatTrainSummary(SummarizeTraining(events)),
              Not(HasSubstr("without attention")));
  events[1].set_data_one_token_loss(2.5);
  EXPECT_THAT(FormatTrainSummary(SummarizeTraining(events)),
              HasSubstr("without attention    2.5000 nats/token (the floor of "
                        "a model that sees one token back); beaten"));
  events[1].set_loss(2.6);
  EXPECT_THAT(FormatTrainSummary(SummarizeTraining(events)),
              HasSubstr("not beaten"));
}

TEST(TrainProgressTest, PlainLinesAtStepOneEveryNAndTheLast) {
  std::ostringstream out;
  TrainProgress progress(out, /*tty=*/false, 10, 4);
  for (int s = 1; s <= 10; ++s) {
    v1::StepEvent event = Event(s, 1.0);
    event.set_done(s == 10);
    progress.Update(event);
  }
  progress.Close();
  std::vector<std::string> lines =
      absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);  // Steps 1, 4, 8, 10.
  EXPECT_THAT(lines[0], HasSubstr("step  1/10"));
  EXPECT_THAT(lines[1], HasSubstr("step  4/10"));
  EXPECT_THAT(lines[2], HasSubstr("step  8/10"));
  EXPECT_THAT(lines[3], HasSubstr("step 10/10"));
  EXPECT_THAT(lines[1], HasSubstr("loss 1.0000 | 2.00K tok/s"));
  EXPECT_THAT(out.str(), Not(HasSubstr("| lr")));  // none reported
  std::ostringstream with_lr;
  TrainProgress scheduled(with_lr, /*tty=*/false, 10, 4);
  v1::StepEvent event = Event(1, 1.0);
  event.set_lr(2.5e-4);
  scheduled.Update(event);
  EXPECT_THAT(with_lr.str(), HasSubstr("loss 1.0000 | lr 0.00025 | 2.00K"));
  // 6 steps left at 0.5 s each.
  EXPECT_THAT(lines[1], HasSubstr("ETA 3s"));
  EXPECT_THAT(out.str(), Not(HasSubstr("\r")));
}

v1::StepEvent EvalEvent(int64_t step, double loss) {
  v1::StepEvent event;
  event.set_step(step);
  event.set_eval_loss(loss);
  event.set_eval_tokens(2048);
  return event;
}

TEST(TrainProgressTest, EvaluationsGetALineAndJoinTheProgressLine) {
  std::ostringstream out;
  TrainProgress progress(out, /*tty=*/false, 10, 5);
  for (int s = 1; s <= 10; ++s) {
    progress.Update(Event(s, 2.0));
    if (s == 4) progress.Eval(EvalEvent(4, 2.25));
  }
  progress.Eval(EvalEvent(10, 1.75));
  std::vector<std::string> lines =
      absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
  // Steps 1, 5 and 10 (the last one though no event says done), and the
  // two evaluations.
  ASSERT_EQ(lines.size(), 5u) << out.str();
  EXPECT_THAT(lines[0], Not(HasSubstr("eval")));
  EXPECT_EQ(lines[1],
            "eval after step  4/10  held-out loss 2.2500 (2.05K tokens)");
  EXPECT_THAT(lines[2], HasSubstr("step  5/10  loss 2.0000 | eval 2.2500 |"));
  EXPECT_THAT(lines[3], HasSubstr("step 10/10"));
  EXPECT_THAT(lines[4], HasSubstr("eval after step 10/10  held-out loss "
                                  "1.7500"));

  // On a terminal the line is redrawn with the new held-out loss.
  std::ostringstream tty;
  TrainProgress live(tty, /*tty=*/true, 4, 0);
  live.Update(Event(4, 1.0));
  live.Eval(EvalEvent(4, 1.5));
  live.Close();
  EXPECT_THAT(tty.str(), HasSubstr("\rstep 4/4 [========================] "
                                   "loss 1.0000 | eval 1.5000 |"));
}

TEST(SummarizeTrainingTest, TheLastEvaluationIsSummarized) {
  const TrainSummary summary = SummarizeTraining(
      {Event(1, 3), Event(2, 2)}, {EvalEvent(1, 2.5), EvalEvent(2, 2.125)});
  EXPECT_EQ(summary.eval_step, 2);
  EXPECT_DOUBLE_EQ(summary.eval_loss, 2.125);
  EXPECT_EQ(summary.eval_tokens, 2048);
  EXPECT_THAT(FormatTrainSummary(summary),
              HasSubstr("held-out loss        2.1250 after step 2 (2.05K eval "
                        "tokens)"));
  EXPECT_THAT(FormatTrainSummary(SummarizeTraining({Event(1, 3)})),
              Not(HasSubstr("held-out")));
}

TEST(TrainProgressTest, DefaultIntervalGivesAboutTwentyLines) {
  std::ostringstream out;
  TrainProgress progress(out, /*tty=*/false, 100, 0);
  for (int s = 1; s <= 100; ++s) progress.Update(Event(s, 1.0));
  std::vector<std::string> lines =
      absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 21u);  // Step 1 and every 5th.
}

TEST(TrainProgressTest, TerminalLineIsRewrittenInPlace) {
  std::ostringstream out;
  TrainProgress progress(out, /*tty=*/true, 4, 0);
  progress.Update(Event(1, 2.0));
  EXPECT_THAT(out.str(), Not(HasSubstr("\n")));
  progress.Update(Event(4, 1.0));
  progress.Close();
  const std::string text = out.str();
  EXPECT_EQ(text.front(), '\r');
  EXPECT_EQ(text.back(), '\n');
  EXPECT_THAT(text, HasSubstr("step 1/4 [======>                 ]"));
  EXPECT_THAT(text, HasSubstr("step 4/4 [========================]"));
  EXPECT_THAT(text, HasSubstr("ETA 0s"));
}

}  // namespace
}  // namespace shardd
