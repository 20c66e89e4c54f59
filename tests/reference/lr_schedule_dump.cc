// Prints the learning rates of steps [0, --steps) of one LrSchedule
// (worker/exec/lr_schedule.h) as a JSON list, for lr_schedule_test.py.
//
//   lr_schedule_dump --kind=cosine --lr=0.01 --warmup=5 --decay=40
//       --min_lr=0.001 --steps=60

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "worker/exec/lr_schedule.h"

ABSL_FLAG(std::string, kind, "constant", "constant, cosine or linear");
ABSL_FLAG(double, lr, 1e-3, "peak learning rate");
ABSL_FLAG(int64_t, warmup, 0, "warmup steps");
ABSL_FLAG(int64_t, decay, 0, "decay_steps");
ABSL_FLAG(double, min_lr, 0.0, "final learning rate");
ABSL_FLAG(int64_t, steps, 10, "steps to print");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  shardd::LrSchedule s;
  absl::Status status =
      shardd::ParseLrScheduleKind(absl::GetFlag(FLAGS_kind), &s.kind);
  const double lr = absl::GetFlag(FLAGS_lr);
  s.warmup_steps = absl::GetFlag(FLAGS_warmup);
  s.decay_steps = absl::GetFlag(FLAGS_decay);
  s.min_lr = absl::GetFlag(FLAGS_min_lr);
  if (status.ok()) status = shardd::ValidateLrSchedule(s, lr);
  if (!status.ok()) {
    std::fprintf(stderr, "lr_schedule_dump: %s\n", status.ToString().c_str());
    return 1;
  }
  std::printf("[");
  for (int64_t i = 0; i < absl::GetFlag(FLAGS_steps); ++i) {
    std::printf("%s%.17g", i == 0 ? "" : ", ", s.At(lr, i));
  }
  std::printf("]\n");
  return 0;
}
