#include "client/shardctl_args.h"

#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<ShardctlArgs> Parse(std::vector<std::string> args) {
  return ParseShardctlArgs(args);
}

TEST(ShardctlArgsTest, PlanWithEveryFlag) {
  SHARDD_ASSERT_OK_AND_ASSIGN(ShardctlArgs args,
                              Parse({"plan",
                                     "--hf-config",
                                     "m.json",
                                     "--dp",
                                     "8",
                                     "--replicate=2",
                                     "--strategy",
                                     "diffusion_gemma",
                                     "--microbatches",
                                     "4",
                                     "--passes",
                                     "3",
                                     "--no-grad-passes",
                                     "1",
                                     "--defer-grad-sync",
                                     "--reshard-after-forward",
                                     "2",
                                     "--fwd-prefetch",
                                     "0",
                                     "--bwd-prefetch=3",
                                     "--no-mixed-precision",
                                     "--bucket-elements",
                                     "1000",
                                     "--timeline",
                                     "--json",
                                     "--coordinator",
                                     "127.0.0.1:7070",
                                     "--timeout",
                                     "2.5"}));
  EXPECT_EQ(args.command, ShardctlCommand::kPlan);
  EXPECT_EQ(args.hf_config_path, "m.json");
  EXPECT_TRUE(args.model_path.empty());
  const v1::PlanOptions& o = args.options;
  EXPECT_EQ(o.mesh().dp_shard(), 8);
  EXPECT_EQ(o.mesh().dp_replicate(), 2);
  EXPECT_EQ(o.strategy(), "diffusion_gemma");
  EXPECT_EQ(o.microbatches(), 4);
  EXPECT_EQ(o.passes(), 3);
  ASSERT_TRUE(o.has_no_grad_passes());
  EXPECT_EQ(o.no_grad_passes(), 1);
  ASSERT_TRUE(o.has_defer_grad_sync());
  EXPECT_TRUE(o.defer_grad_sync());
  EXPECT_EQ(o.reshard_after_forward().group_size(), 2);
  ASSERT_TRUE(o.has_forward_prefetch_depth());
  EXPECT_EQ(o.forward_prefetch_depth(), 0);
  EXPECT_EQ(o.backward_prefetch_depth(), 3);
  ASSERT_TRUE(o.has_mixed_precision());
  EXPECT_FALSE(o.mixed_precision());
  EXPECT_EQ(o.bucket_elements(), 1000);
  EXPECT_TRUE(o.include_timeline());
  EXPECT_TRUE(args.json);
  EXPECT_EQ(args.coordinator, "127.0.0.1:7070");
  EXPECT_EQ(args.timeout, absl::Milliseconds(2500));
}

TEST(ShardctlArgsTest, PlanDefaultsLeaveOptionsUnset) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs args, Parse({"plan", "--model", "x.json", "--dp", "2"}));
  EXPECT_EQ(args.model_path, "x.json");
  EXPECT_EQ(args.options.mesh().dp_shard(), 2);
  EXPECT_EQ(args.options.mesh().dp_replicate(), 1);
  EXPECT_FALSE(args.options.has_mixed_precision());
  EXPECT_FALSE(args.options.has_forward_prefetch_depth());
  EXPECT_FALSE(args.options.has_reshard_after_forward());
  EXPECT_TRUE(args.options.strategy().empty());
  EXPECT_TRUE(args.coordinator.empty());
  EXPECT_FALSE(args.json);
  EXPECT_EQ(args.timeout, absl::Seconds(30));
}

TEST(ShardctlArgsTest, ReshardAcceptsBoolsAndGroupSizes) {
  SHARDD_ASSERT_OK_AND_ASSIGN(auto t,
                              Parse({"plan", "--model", "x", "--dp", "2",
                                     "--reshard-after-forward", "true"}));
  EXPECT_EQ(t.options.reshard_after_forward().policy_case(),
            v1::ReshardPolicy::kReshard);
  EXPECT_TRUE(t.options.reshard_after_forward().reshard());
  SHARDD_ASSERT_OK_AND_ASSIGN(auto f,
                              Parse({"plan", "--model", "x", "--dp", "2",
                                     "--reshard-after-forward=false"}));
  EXPECT_EQ(f.options.reshard_after_forward().policy_case(),
            v1::ReshardPolicy::kReshard);
  EXPECT_FALSE(f.options.reshard_after_forward().reshard());
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "2",
                     "--reshard-after-forward", "maybe"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--reshard-after-forward: expected true, "
                                 "false or a group size >= 1, got 'maybe'")));
}

TEST(ShardctlArgsTest, BadNumbersNameTheFlag) {
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "x"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "--dp: expected an integer >= 1, got 'x'"));
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "0"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "--dp: expected an integer >= 1, got '0'"));
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "99999999999"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--dp")));
  EXPECT_THAT(
      Parse({"plan", "--model", "x", "--dp", "2", "--fwd-prefetch", "-1"}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               "--fwd-prefetch: expected an integer >= 0, got '-1'"));
  EXPECT_THAT(
      Parse({"plan", "--model", "x", "--dp", "2", "--timeout", "0"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--timeout")));
}

TEST(ShardctlArgsTest, UsageErrors) {
  EXPECT_THAT(Parse({}), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr("command is required")));
  EXPECT_THAT(Parse({"frobnicate"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown command 'frobnicate'")));
  EXPECT_THAT(Parse({"--dp", "2"}), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("expected a command")));
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "2", "--bogus"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown flag '--bogus'")));
  EXPECT_THAT(Parse({"strategies", "--dp", "2"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("strategies: unknown flag '--dp'")));
  EXPECT_THAT(
      Parse({"plan", "--model", "x", "--dp"}),
      StatusIs(absl::StatusCode::kInvalidArgument, "--dp: missing value"));
  EXPECT_THAT(
      Parse({"plan", "--model", "x", "--dp", "2", "--json=yes"}),
      StatusIs(absl::StatusCode::kInvalidArgument, "--json: takes no value"));
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "2", "--dp", "4"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "--dp: given more than once"));
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "2", "extra"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unexpected argument 'extra'")));
  EXPECT_THAT(Parse({"plan", "--dp", "2"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("exactly one of --hf-config")));
  EXPECT_THAT(Parse({"plan", "--model", "x", "--hf-config", "y", "--dp", "2"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("exactly one of --hf-config")));
  EXPECT_THAT(
      Parse({"plan", "--model", "x"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--dp N")));
  EXPECT_THAT(Parse({"status"}), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("--coordinator")));
}

TEST(ShardctlArgsTest, HelpForms) {
  SHARDD_ASSERT_OK_AND_ASSIGN(auto overview, Parse({"--help"}));
  EXPECT_EQ(overview.command, ShardctlCommand::kHelp);
  EXPECT_EQ(overview.help_for, ShardctlCommand::kHelp);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto plan_help, Parse({"plan", "--help"}));
  EXPECT_EQ(plan_help.command, ShardctlCommand::kHelp);
  EXPECT_EQ(plan_help.help_for, ShardctlCommand::kPlan);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto status_help, Parse({"help", "status"}));
  EXPECT_EQ(status_help.help_for, ShardctlCommand::kStatus);
  EXPECT_THAT(Parse({"help", "nope"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown command 'nope'")));
  EXPECT_THAT(ShardctlUsage(ShardctlCommand::kPlan), HasSubstr("--hf-config"));
  EXPECT_THAT(ShardctlUsage(ShardctlCommand::kHelp), HasSubstr("strategies"));
}

TEST(ShardctlArgsTest, StrategiesAndStatus) {
  SHARDD_ASSERT_OK_AND_ASSIGN(auto local, Parse({"strategies"}));
  EXPECT_EQ(local.command, ShardctlCommand::kStrategies);
  EXPECT_TRUE(local.coordinator.empty());
  SHARDD_ASSERT_OK_AND_ASSIGN(auto status,
                              Parse({"status", "--coordinator=h:1", "--json"}));
  EXPECT_EQ(status.command, ShardctlCommand::kStatus);
  EXPECT_EQ(status.coordinator, "h:1");
  EXPECT_TRUE(status.json);
}

}  // namespace
}  // namespace shardd
