#include "worker/memory/memory_timeline.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

std::string ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(MemoryTimelineTest, DrawsTheFirstRecordedStepOnce) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path =
      absl::StrCat(dir != nullptr ? dir : "/tmp", "/measured.svg");
  MemoryTracker tracker;
  StepTimelineCapture capture(path, &tracker);
  v1::ShardingPlan plan;
  plan.set_model_id("m-1");
  plan.set_strategy("default");
  plan.set_world_size(4);
  plan.mutable_memory()->set_peak_unsharded_bytes(3072);

  capture.BeginStep();
  tracker.Allocate(MemoryKind::kGatheredParams, 2048);
  tracker.Allocate(MemoryKind::kUnshardedGrads, 1024);
  tracker.Free(MemoryKind::kGatheredParams, 2048);
  tracker.Free(MemoryKind::kUnshardedGrads, 1024);
  ASSERT_TRUE(capture.EndStep(plan, 2, 7).ok());
  const std::string svg = ReadWhole(path);
  EXPECT_TRUE(
      absl::StrContains(svg, "m-1: default, world size 4 (measured, rank 2)"))
      << svg;
  EXPECT_TRUE(absl::StrContains(svg, ">measured peak 3 KiB<"));
  EXPECT_TRUE(absl::StrContains(svg, ">planned peak 3 KiB<"));
  EXPECT_TRUE(absl::StrContains(svg, "step 7"));

  // Later steps are not recorded or drawn again.
  capture.BeginStep();
  tracker.Allocate(MemoryKind::kGatheredParams, 1 << 20);
  EXPECT_TRUE(capture.EndStep(plan, 2, 8).ok());
  EXPECT_EQ(ReadWhole(path), svg);
  EXPECT_TRUE(tracker.StopTimeline().empty());

  // A step that changed nothing tracked is an error, and not drawn.
  const std::string empty_path = absl::StrCat(path, ".empty.svg");
  StepTimelineCapture idle(empty_path, &tracker);
  idle.BeginStep();
  EXPECT_EQ(idle.EndStep(plan, 0, 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(ReadWhole(empty_path).empty());
}

}  // namespace
}  // namespace shardd
