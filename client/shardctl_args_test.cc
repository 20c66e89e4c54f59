#include "client/shardctl_args.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/shardctl_usage.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

absl::StatusOr<ShardctlArgs> Parse(std::vector<std::string> args) {
  return ParseShardctlArgs(args);
}

TEST(ShardctlArgsTest, SecurityFlags) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs args,
      Parse({"status", "--coordinator", "h:1", "--tls-ca", "ca.pem",
             "--tls-cert=c.pem", "--tls-key", "c.key", "--token-file", "t"}));
  EXPECT_EQ(args.tls_ca_file, "ca.pem");
  EXPECT_EQ(args.tls_cert_file, "c.pem");
  EXPECT_EQ(args.tls_key_file, "c.key");
  EXPECT_EQ(args.token_file, "t");
  EXPECT_THAT(
      Parse({"status", "--coordinator", "h:1", "--token-file="}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--token-file")));
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

TEST(ShardctlArgsTest, ActivationFlags) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto plan,
      Parse({"plan", "--model", "x", "--dp", "2", "--micro-batch-size", "4",
             "--seq", "2048", "--activation-checkpointing", "every:2"}));
  EXPECT_EQ(plan.options.micro_batch_size(), 4);
  EXPECT_EQ(plan.options.seq_len(), 2048);
  EXPECT_EQ(plan.options.activation_checkpointing(), "every:2");
  EXPECT_THAT(
      Parse({"plan", "--model", "x", "--dp", "2", "--seq", "8"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("give both")));
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "2",
                     "--activation-checkpointing", "all"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("needs --micro-batch-size N and --seq N")));
  EXPECT_THAT(
      Parse({"plan", "--model", "x", "--dp", "2", "--micro-batch-size", "1",
             "--seq", "8", "--activation-checkpointing", "every:0"}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("--activation-checkpointing: "
                         "activation_checkpointing: must be none")));
  // train: the job's batch sets the micro-batch; the policy is the model's.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto train, Parse({"train", "--coordinator=h:1", "--model", "x",
                         "--activation-checkpointing", "experts"}));
  EXPECT_EQ(train.options.activation_checkpointing(), "experts");
  EXPECT_EQ(train.options.seq_len(), 0);
  // Whose activations plan counts; a job takes it from its workers.
  EXPECT_EQ(plan.options.worker_device(), v1::WORKER_DEVICE_CPU);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto gpu, Parse({"plan", "--model", "x", "--dp", "2", "--worker-device",
                       "cuda", "--micro-batch-size", "1", "--seq", "8"}));
  EXPECT_EQ(gpu.options.worker_device(), v1::WORKER_DEVICE_CUDA);
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "2", "--worker-device",
                     "tpu"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--worker-device: expected cpu or cuda, got "
                                 "'tpu'")));
  EXPECT_THAT(Parse({"train", "--coordinator=h:1", "--model", "x",
                     "--worker-device", "cuda"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--worker-device")));
}

TEST(ShardctlArgsTest, ExpertParallelFlags) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto plan, Parse({"plan", "--model", "x", "--dp", "8", "--ep", "4",
                        "--ep-capacity-factor", "1.25"}));
  EXPECT_EQ(plan.options.mesh().ep(), 4);
  EXPECT_EQ(plan.options.ep_capacity_factor(), 1.25);
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "8", "--ep", "0"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--ep: expected an integer >= 1")));
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "8",
                     "--ep-capacity-factor", "x"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--ep-capacity-factor: expected a number")));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto train,
      Parse({"train", "--coordinator=h:1", "--model", "x", "--ep", "2"}));
  EXPECT_EQ(train.options.mesh().ep(), 2);
  EXPECT_THAT(Parse({"train", "--coordinator=h:1", "--model-id", "m-1",
                     "--ep", "2"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--ep cannot be combined with --model-id")));
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

TEST(ShardctlArgsTest, CheckpointFlagsAndCheckpointList) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs train,
      Parse({"train", "--coordinator", "h:1", "--model", "m.json",
             "--checkpoint-every", "3", "--resume-from", "j-1/step-00000003"}));
  EXPECT_EQ(train.train.checkpoint_every(), 3);
  EXPECT_EQ(train.train.resume_from(), "j-1/step-00000003");
  EXPECT_THAT(Parse({"train", "--coordinator", "h:1", "--model", "m.json",
                     "--checkpoint-every", "0"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--checkpoint-every")));
  EXPECT_THAT(
      Parse({"train", "--coordinator", "h:1", "--model", "m.json",
             "--resume-from="}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--resume-from")));

  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs kept,
      Parse({"train", "--coordinator", "h:1", "--model", "m.json",
             "--checkpoint-every", "2", "--keep-checkpoints", "3",
             "--keep-every", "10", "--on-checkpoint-failure", "skip"}));
  EXPECT_EQ(kept.train.keep_checkpoints(), 3);
  EXPECT_EQ(kept.train.keep_every(), 10);
  EXPECT_EQ(kept.train.on_checkpoint_failure(), "skip");
  EXPECT_THAT(Parse({"train", "--coordinator", "h:1", "--model", "m.json",
                     "--keep-checkpoints", "0"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--keep-checkpoints")));
  EXPECT_THAT(Parse({"train", "--coordinator", "h:1", "--model", "m.json",
                     "--on-checkpoint-failure", "retry"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("allowed: fail (the default), skip")));

  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs list, Parse({"checkpoint", "list", "--coordinator", "h:1",
                                "--job", "j-2", "--json"}));
  EXPECT_EQ(list.command, ShardctlCommand::kCheckpointList);
  EXPECT_EQ(list.checkpoint_job, "j-2");
  EXPECT_TRUE(list.json);
  EXPECT_THAT(
      Parse({"checkpoint", "list"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--coordinator")));
  EXPECT_THAT(
      Parse({"checkpoint", "frobnicate"}),
      StatusIs(
          absl::StatusCode::kInvalidArgument,
          HasSubstr("subcommand 'list', 'save', 'load', 'consolidate' or 'export'")));
  EXPECT_THAT(
      Parse({"checkpoint"}),
      StatusIs(
          absl::StatusCode::kInvalidArgument,
          HasSubstr("subcommand 'list', 'save', 'load', 'consolidate' or 'export'")));
  SHARDD_ASSERT_OK_AND_ASSIGN(ShardctlArgs help,
                              Parse({"checkpoint", "list", "--help"}));
  EXPECT_EQ(help.command, ShardctlCommand::kHelp);
  EXPECT_EQ(help.help_for, ShardctlCommand::kCheckpointList);
  EXPECT_THAT(ShardctlUsage(ShardctlCommand::kCheckpointList),
              HasSubstr("shardctl checkpoint list"));

  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs consolidate,
      Parse({"checkpoint", "consolidate", "--checkpoint", "c/j-1/step-1",
             "--out", "o", "--hf", "mixtral"}));
  EXPECT_EQ(consolidate.command, ShardctlCommand::kCheckpointConsolidate);
  EXPECT_EQ(consolidate.checkpoint_path, "c/j-1/step-1");
  EXPECT_EQ(consolidate.out_path, "o");
  EXPECT_EQ(consolidate.hf_naming, "mixtral");
  EXPECT_THAT(Parse({"checkpoint", "consolidate", "--checkpoint", "c"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--out")));
  EXPECT_THAT(Parse({"checkpoint", "consolidate", "--checkpoint", "c", "--out",
                     "o", "--hf", "llama"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--hf: expected the HF naming qwen3-moe, "
                                 "mixtral, gpt-oss, diffusion-gemma or none, "
                                 "got 'llama'")));
  for (const char* naming :
       {"qwen3-moe", "mixtral", "gpt-oss", "diffusion-gemma", "none"}) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        ShardctlArgs hf, Parse({"checkpoint", "consolidate", "--checkpoint",
                                "c", "--out", "o", "--hf", naming}));
    EXPECT_EQ(hf.hf_naming, naming);
    EXPECT_THAT(ShardctlUsage(ShardctlCommand::kCheckpointConsolidate),
                HasSubstr(naming));
  }

  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs exported,
      Parse({"checkpoint", "export", "--checkpoint", "c/j-1/step-1", "--hf",
             "out/model", "--max-shard-bytes", "1000"}));
  EXPECT_EQ(exported.command, ShardctlCommand::kCheckpointExport);
  EXPECT_EQ(exported.checkpoint_path, "c/j-1/step-1");
  EXPECT_EQ(exported.out_path, "out/model");
  EXPECT_EQ(exported.max_shard_bytes, 1000);
  EXPECT_THAT(Parse({"checkpoint", "export", "--checkpoint", "c"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--hf")));
  EXPECT_THAT(Parse({"checkpoint", "export", "--checkpoint", "c", "--hf", "o",
                     "--max-shard-bytes", "0"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--max-shard-bytes")));
  EXPECT_THAT(Parse({"checkpoint", "export", "--checkpoint", "c", "--hf", "o",
                     "--out", "x"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--out")));

  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs save,
      Parse({"checkpoint", "save", "--coordinator", "h:1", "--job", "j-3"}));
  EXPECT_EQ(save.command, ShardctlCommand::kCheckpointSave);
  EXPECT_EQ(save.checkpoint_job, "j-3");
  EXPECT_THAT(Parse({"checkpoint", "save", "--coordinator", "h:1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--job")));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs load,
      Parse({"checkpoint", "load", "--coordinator", "h:1", "--job", "j-3",
             "--checkpoint", "j-3/step-00000004"}));
  EXPECT_EQ(load.command, ShardctlCommand::kCheckpointLoad);
  EXPECT_EQ(load.checkpoint_path, "j-3/step-00000004");
  EXPECT_THAT(
      Parse({"checkpoint", "load", "--coordinator", "h:1", "--job", "j-3"}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("--checkpoint NAME")));
  EXPECT_THAT(Parse({"checkpoint", "save", "--coordinator", "h:1", "--job",
                     "j-3", "--out", "x"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--out")));

  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs recovering,
      Parse({"train", "--coordinator", "h:1", "--model-id", "m-1",
             "--max-recoveries", "0", "--reconnect-timeout", "5"}));
  EXPECT_EQ(recovering.train.max_recoveries(), -1);  // 0 asks for never.
  EXPECT_EQ(recovering.reconnect_timeout, absl::Seconds(5));
  EXPECT_THAT(Parse({"train", "--coordinator", "h:1", "--model-id", "m-1",
                     "--reconnect-timeout", "-1"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--reconnect-timeout")));
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

TEST(ShardctlArgsTest, DeviceMemoryDefaultsToAnH100) {
  SHARDD_ASSERT_OK_AND_ASSIGN(auto args,
                              Parse({"plan", "--model", "x", "--dp", "2"}));
  EXPECT_EQ(args.device_memory_bytes, int64_t{80} * 1024 * 1024 * 1024);
}

TEST(ShardctlArgsTest, DeviceMemorySizes) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  const std::vector<std::pair<std::string, int64_t>> cases = {
      {"80GiB", 80 * kGiB},
      {"141GiB", 141 * kGiB},
      {"80GB", 80'000'000'000},  // Decimal.
      {"1024MiB", kGiB},
      {"80", 80 * kGiB},  // A plain number is GiB.
      {"1.5", kGiB + kGiB / 2},
      {"0.5TiB", 512 * kGiB},
      {"80 GiB", 80 * kGiB},
      {"80gib", 80 * kGiB},
      {"2048KiB", 2 << 20},
      {"94.5GB", 94'500'000'000},
      {"4096B", 4096},
      {"1TB", 1'000'000'000'000},
      {"1024TiB", 1024 * 1024 * kGiB},  // The upper limit.
  };
  for (const auto& [text, bytes] : cases) {
    SCOPED_TRACE(text);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        auto args,
        Parse({"plan", "--model", "x", "--dp", "2", "--device-memory", text}));
    EXPECT_EQ(args.device_memory_bytes, bytes);
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto inline_value,
      Parse({"plan", "--model", "x", "--dp", "2", "--device-memory=141GiB"}));
  EXPECT_EQ(inline_value.device_memory_bytes, 141 * kGiB);
}

TEST(ShardctlArgsTest, BadDeviceMemoryNamesTheFlagAndTheForms) {
  for (const std::string bad :
       {"x", "", "GiB", "80XB", "80G", "-80GiB", "1e3", "0x10", "inf", "nan",
        "80GiBs", "1.2.3", "80 GiB x"}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(
        Parse({"plan", "--model", "x", "--dp", "2", "--device-memory", bad}),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 absl::StrCat("--device-memory: expected a size like "
                              "80GiB, 80GB or 80 (GiB), got '",
                              bad, "'")));
  }
  for (const std::string out_of_range :
       {"0", "0GiB", "0.0", "0.1B", "1025TiB", "99999999999999999999"}) {
    SCOPED_TRACE(out_of_range);
    EXPECT_THAT(
        Parse({"plan", "--model", "x", "--dp", "2", "--device-memory",
               out_of_range}),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 absl::StrCat("--device-memory: expected a size > 0 and at "
                              "most 1024TiB, got '",
                              out_of_range, "'")));
  }
  EXPECT_THAT(Parse({"plan", "--model", "x", "--dp", "2", "--device-memory"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "--device-memory: missing value"));
  EXPECT_THAT(Parse({"strategies", "--device-memory", "80GiB"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown flag '--device-memory'")));
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
  EXPECT_THAT(ShardctlUsage(ShardctlCommand::kPlan),
              HasSubstr("--device-memory SIZE"));
  EXPECT_THAT(ShardctlUsage(ShardctlCommand::kPlan),
              HasSubstr("compute workspace is not modelled"));
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

TEST(ShardctlArgsTest, TrainWithEveryFlag) {
  SHARDD_ASSERT_OK_AND_ASSIGN(ShardctlArgs args,
                              Parse({"train",
                                     "--coordinator=127.0.0.1:7070",
                                     "--model",
                                     "tests/data/small_moe.json",
                                     "--steps",
                                     "300",
                                     "--global-batch",
                                     "64",
                                     "--seq",
                                     "32",
                                     "--microbatches",
                                     "2",
                                     "--data",
                                     "/data/tokens.bin",
                                     "--lr",
                                     "0.003",
                                     "--seed",
                                     "18446744073709551615",
                                     "--dp",
                                     "2",
                                     "--replicate",
                                     "2",
                                     "--strategy",
                                     "default",
                                     "--defer-grad-sync",
                                     "--fine-grained",
                                     "--passes",
                                     "3",
                                     "--no-grad-passes",
                                     "1",
                                     "--no-mixed-precision",
                                     "--grad-clip",
                                     "0.5",
                                     "--weight-decay",
                                     "0.01",
                                     "--log-every",
                                     "7",
                                     "--watch-timeout",
                                     "90",
                                     "--json"}));
  EXPECT_EQ(args.command, ShardctlCommand::kTrain);
  EXPECT_EQ(args.model_path, "tests/data/small_moe.json");
  const v1::TrainConfig& t = args.train;
  EXPECT_EQ(t.steps(), 300);
  EXPECT_EQ(t.global_batch(), 64);
  EXPECT_EQ(t.seq_len(), 32);
  EXPECT_EQ(t.microbatches(), 2);
  EXPECT_TRUE(t.defer_grad_sync());
  EXPECT_TRUE(t.fine_grained());
  EXPECT_EQ(t.data_path(), "/data/tokens.bin");
  EXPECT_DOUBLE_EQ(t.lr(), 0.003);
  EXPECT_EQ(t.seed(), 18446744073709551615ull);
  EXPECT_DOUBLE_EQ(t.grad_clip(), 0.5);
  EXPECT_DOUBLE_EQ(t.weight_decay(), 0.01);
  // The step shape belongs to the job, not to the model's plan options.
  const v1::PlanOptions& o = args.options;
  EXPECT_EQ(o.microbatches(), 0);
  EXPECT_FALSE(o.has_defer_grad_sync());
  EXPECT_EQ(o.mesh().dp_shard(), 2);
  EXPECT_EQ(o.mesh().dp_replicate(), 2);
  EXPECT_EQ(o.strategy(), "default");
  EXPECT_EQ(o.passes(), 3);
  EXPECT_EQ(o.no_grad_passes(), 1);
  EXPECT_FALSE(o.mixed_precision());
  EXPECT_EQ(args.log_every, 7);
  EXPECT_EQ(args.watch_timeout, absl::Seconds(90));
  EXPECT_TRUE(args.json);
}

TEST(ShardctlArgsTest, TrainDefaults) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs args,
      Parse({"train", "--coordinator", "h:1", "--model-id", "m-1"}));
  EXPECT_EQ(args.model_id, "m-1");
  EXPECT_EQ(args.train.steps(), 100);
  EXPECT_EQ(args.train.global_batch(), 32);
  EXPECT_EQ(args.train.seq_len(), 64);
  EXPECT_EQ(args.train.microbatches(), 1);
  EXPECT_DOUBLE_EQ(args.train.lr(), 1e-3);
  EXPECT_DOUBLE_EQ(args.train.grad_clip(), 1.0);
  EXPECT_DOUBLE_EQ(args.train.weight_decay(), 0.0);
  EXPECT_FALSE(args.train.fine_grained());
  // No --dp: the client shards over the live workers.
  EXPECT_EQ(args.options.mesh().dp_shard(), 0);
  EXPECT_EQ(args.options.mesh().dp_replicate(), 1);
}

TEST(ShardctlArgsTest, TrainUsageErrors) {
  auto usage = [](std::vector<std::string> argv, const std::string& message) {
    EXPECT_THAT(Parse(argv), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr(message)))
        << message;
  };
  usage({"train", "--model", "m.json"}, "--coordinator HOST:PORT is required");
  usage({"train", "--coordinator", "h:1"}, "exactly one of --model");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--model-id", "b"},
        "exactly one of --model");
  usage({"train", "--coordinator", "h:1", "--model-id", "m-1", "--dp", "2"},
        "--dp cannot be combined with --model-id");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--steps", "0"},
        "--steps: expected an integer >= 1");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--lr", "0"},
        "--lr: expected a number > 0");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--grad-clip", "-1"},
        "--grad-clip: expected a number >= 0");
  SHARDD_ASSERT_OK_AND_ASSIGN(ShardctlArgs no_clip,
                              Parse({"train", "--coordinator", "h:1", "--model",
                                     "a", "--grad-clip", "0"}));
  EXPECT_LT(no_clip.train.grad_clip(), 0);  // "Off" on the wire.
  usage({"train", "--coordinator", "h:1", "--model", "a", "--weight-decay",
         "nan"},
        "--weight-decay");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--seed", "-3"},
        "--seed");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--eval-every", "5"},
        "--eval-every and --eval-batches need --eval-data FILE");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--eval-data",
         "held.bin", "--eval-batches", "0"},
        "--eval-batches: expected an integer >= 1");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs evaluated,
      Parse({"train", "--coordinator", "h:1", "--model", "a", "--eval-data",
             "held.bin", "--eval-every", "10", "--eval-batches", "3"}));
  EXPECT_EQ(evaluated.train.eval_data_path(), "held.bin");
  EXPECT_EQ(evaluated.train.eval_every(), 10);
  EXPECT_EQ(evaluated.train.eval_batches(), 3);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs adam,
      Parse({"train", "--coordinator", "h:1", "--model", "a", "--beta1", "0.8",
             "--beta2", "0.999", "--eps", "1e-6"}));
  EXPECT_EQ(adam.train.beta1(), 0.8);
  EXPECT_EQ(adam.train.beta2(), 0.999);
  EXPECT_EQ(adam.train.eps(), 1e-6);
  usage({"train", "--coordinator", "h:1", "--model", "a", "--beta2", "1"},
        "--beta2: expected a number in (0, 1)");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--eps", "0"},
        "--eps: expected a number > 0");
  SHARDD_ASSERT_OK_AND_ASSIGN(ShardctlArgs strided,
                              Parse({"train", "--coordinator", "h:1", "--model",
                                     "a", "--data-order", "strided"}));
  EXPECT_EQ(strided.train.data_order(), "strided");
  EXPECT_FALSE(strided.train.no_packing());
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs padded, Parse({"train", "--coordinator", "h:1", "--model",
                                  "a", "--data", "/sft", "--no-packing"}));
  EXPECT_TRUE(padded.train.no_packing());
  usage({"train", "--coordinator", "h:1", "--model", "a", "--data-order",
         "sorted"},
        "--data-order: expected random or strided");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs diffusion,
      Parse({"train", "--coordinator", "h:1", "--model", "a",
             "--encoder-loss-weight", "0", "--diffusion-loss-weight", "2.5",
             "--diffusion-noise-eps", "0.01", "--self-conditioning-p", "1",
             "--response-length", "24"}));
  const v1::DiffusionTraining& d = diffusion.train.diffusion();
  EXPECT_TRUE(d.has_encoder_loss_weight());  // 0 is a value, not "unset"
  EXPECT_EQ(d.encoder_loss_weight(), 0.0);
  EXPECT_EQ(d.diffusion_loss_weight(), 2.5);
  EXPECT_EQ(d.noise_eps(), 0.01);
  EXPECT_EQ(d.self_conditioning_p(), 1.0);
  EXPECT_EQ(d.response_length(), 24);
  EXPECT_FALSE(adam.train.has_diffusion());
  usage({"train", "--coordinator", "h:1", "--model", "a",
         "--diffusion-noise-eps", "1"},
        "--diffusion-noise-eps: expected a number in [0, 1)");
  usage({"train", "--coordinator", "h:1", "--model", "a",
         "--self-conditioning-p", "1.5"},
        "--self-conditioning-p: expected a number in [0, 1]");
  usage({"train", "--coordinator", "h:1", "--model", "a",
         "--encoder-loss-weight", "-1"},
        "--encoder-loss-weight: expected a number >= 0");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs schedule,
      Parse({"train", "--coordinator", "h:1", "--model", "a", "--lr-schedule",
             "cosine", "--warmup-steps", "10", "--decay-steps", "100",
             "--min-lr", "1e-5"}));
  EXPECT_EQ(schedule.train.lr_schedule(), "cosine");
  EXPECT_EQ(schedule.train.warmup_steps(), 10);
  EXPECT_EQ(schedule.train.decay_steps(), 100);
  EXPECT_EQ(schedule.train.min_lr(), 1e-5);
  usage({"train", "--coordinator", "h:1", "--model", "a", "--lr-schedule",
         "step"},
        "--lr-schedule: expected constant, cosine or linear");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--min-lr", "-1"},
        "--min-lr: expected a number >= 0");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs muon,
      Parse({"train", "--coordinator", "h:1", "--model", "a", "--optimizer",
             "muon", "--muon-lr", "0.05", "--muon-momentum", "0.9",
             "--muon-ns-steps", "6"}));
  EXPECT_EQ(muon.train.optimizer(), "muon");
  EXPECT_EQ(muon.train.muon_lr(), 0.05);
  EXPECT_EQ(muon.train.muon_momentum(), 0.9);
  EXPECT_EQ(muon.train.muon_ns_steps(), 6);
  usage({"train", "--coordinator", "h:1", "--model", "a", "--optimizer", "sgd"},
        "--optimizer: expected adamw or muon, got 'sgd'");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--muon-lr", "0"},
        "--muon-lr: expected a number > 0");
  usage(
      {"train", "--coordinator", "h:1", "--model", "a", "--muon-momentum", "1"},
      "--muon-momentum: expected a number in (0, 1)");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--muon-ns-steps",
         "101"},
        "--muon-ns-steps: expected an integer in [1, 100]");
  usage({"train", "--coordinator", "h:1", "--model", "a", "--hf-config", "x"},
        "unknown flag '--hf-config'");
  usage({"plan", "--model", "a", "--dp", "2", "--steps", "3"},
        "unknown flag '--steps'");
}

// Every flag a command accepts is in its help text.
TEST(ShardctlArgsTest, EveryAcceptedFlagIsDocumented) {
  for (ShardctlCommand command :
       {ShardctlCommand::kStrategies, ShardctlCommand::kPlan,
        ShardctlCommand::kStatus, ShardctlCommand::kTrain,
        ShardctlCommand::kCheckpointList, ShardctlCommand::kCheckpointSave,
        ShardctlCommand::kCheckpointLoad,
        ShardctlCommand::kCheckpointConsolidate,
        ShardctlCommand::kCheckpointExport}) {
    const std::string usage = ShardctlUsage(command);
    for (const std::string& flag : ShardctlFlags(command)) {
      EXPECT_THAT(usage, HasSubstr(flag))
          << "command " << static_cast<int>(command);
    }
  }
}

TEST(ShardctlArgsTest, TrainHasHelp) {
  SHARDD_ASSERT_OK_AND_ASSIGN(ShardctlArgs args, Parse({"train", "--help"}));
  EXPECT_EQ(args.command, ShardctlCommand::kHelp);
  EXPECT_EQ(args.help_for, ShardctlCommand::kTrain);
  EXPECT_THAT(ShardctlUsage(ShardctlCommand::kTrain),
              HasSubstr("--global-batch B"));
  EXPECT_THAT(ShardctlUsage(ShardctlCommand::kHelp), HasSubstr("train"));
}

TEST(ShardctlArgsTest, LoraFlags) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs args,
      Parse({"train", "--coordinator", "127.0.0.1:1", "--model", "m.json",
             "--lora-rank", "8",
             "--lora-targets", "q_proj,v_proj,experts", "--lora-from",
             "/a/adapters"}));
  EXPECT_EQ(args.options.lora().rank(), 8);
  EXPECT_EQ(args.options.lora().alpha(), 8);  // PEFT's default.
  EXPECT_THAT(args.options.lora().targets(),
              ElementsAre("q_proj", "v_proj", "experts"));
  EXPECT_EQ(args.train.lora_from(), "/a/adapters");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ShardctlArgs plan, Parse({"plan", "--model", "m.json", "--dp", "2",
                                "--lora-rank", "4", "--lora-alpha", "2.5",
                                "--lora-targets", "experts"}));
  EXPECT_EQ(plan.options.lora().alpha(), 2.5);
  const struct {
    std::vector<std::string> extra;
    const char* message;
  } bad[] = {
      {{"--lora-rank", "0", "--lora-targets", "q_proj"},
       "--lora-rank: expected an integer >= 1, got '0'"},
      {{"--lora-rank", "4", "--lora-alpha", "0", "--lora-targets", "q_proj"},
       "--lora-alpha: expected a number > 0, got '0'"},
      {{"--lora-rank", "4", "--lora-targets", "q_proj,,v_proj"},
       "--lora-targets: expected module names separated by commas"},
      {{"--lora-rank", "4"}, "--lora-rank needs --lora-targets"},
      {{"--lora-targets", "q_proj"}, "--lora-targets needs --lora-rank"},
      {{"--lora-from", "/a"}, "--lora-from needs --lora-rank"},
  };
  for (const auto& c : bad) {
    std::vector<std::string> argv = {"train", "--coordinator", "127.0.0.1:1",
                                     "--model", "m.json"};
    argv.insert(argv.end(), c.extra.begin(), c.extra.end());
    const absl::StatusOr<ShardctlArgs> parsed = Parse(argv);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument)
        << c.message;
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.message));
  }
}

// (section: timeline-svg)
TEST(ShardctlArgsTest, PictureFlags) {
  absl::StatusOr<ShardctlArgs> plan =
      Parse({"plan", "--model", "m.json", "--dp", "8", "--timeline-svg",
             "out.svg", "--compare-strategy=diffusion_gemma"});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->timeline_svg_path, "out.svg");
  EXPECT_EQ(plan->compare_strategy, "diffusion_gemma");
  // The picture does not turn on the JSON timeline.
  EXPECT_FALSE(plan->options.include_timeline());

  absl::StatusOr<ShardctlArgs> alone =
      Parse({"plan", "--model", "m.json", "--dp", "8", "--compare-strategy",
             "default"});
  ASSERT_FALSE(alone.ok());
  EXPECT_THAT(std::string(alone.status().message()),
              HasSubstr("--timeline-svg"));
  absl::StatusOr<ShardctlArgs> empty =
      Parse({"plan", "--model", "m.json", "--dp", "8", "--timeline-svg="});
  ASSERT_FALSE(empty.ok());
  EXPECT_THAT(std::string(empty.status().message()),
              HasSubstr("--timeline-svg: expected a file path"));

  // --timeline FILE.svg is the short form; a bare --timeline stays JSON.
  absl::StatusOr<ShardctlArgs> short_form =
      Parse({"plan", "--model", "m.json", "--timeline", "t.svg", "--dp", "8",
             "--compare-strategy", "default"});
  ASSERT_TRUE(short_form.ok()) << short_form.status();
  EXPECT_EQ(short_form->timeline_svg_path, "t.svg");
  EXPECT_FALSE(short_form->options.include_timeline());
  absl::StatusOr<ShardctlArgs> inline_form =
      Parse({"plan", "--model", "m.json", "--dp", "8", "--timeline=Out.SVG"});
  ASSERT_TRUE(inline_form.ok()) << inline_form.status();
  EXPECT_EQ(inline_form->timeline_svg_path, "Out.SVG");
  absl::StatusOr<ShardctlArgs> bare =
      Parse({"plan", "--model", "m.json", "--timeline", "--dp", "8"});
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_TRUE(bare->options.include_timeline());
  EXPECT_TRUE(bare->timeline_svg_path.empty());
  absl::StatusOr<ShardctlArgs> not_svg =
      Parse({"plan", "--model", "m.json", "--dp", "8", "--timeline", "t.png"});
  ASSERT_FALSE(not_svg.ok());
  EXPECT_THAT(std::string(not_svg.status().message()),
              HasSubstr("ending in .svg"));
  absl::StatusOr<ShardctlArgs> both =
      Parse({"plan", "--model", "m.json", "--dp", "8", "--timeline", "a.svg",
             "--timeline-svg", "b.svg"});
  ASSERT_FALSE(both.ok());
  EXPECT_THAT(std::string(both.status().message()),
              HasSubstr("more than once"));

  absl::StatusOr<ShardctlArgs> train =
      Parse({"train", "--coordinator", "h:1", "--model", "m.json", "--loss-svg",
             "loss.svg"});
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ(train->loss_svg_path, "loss.svg");
  // Each flag belongs to its command.
  EXPECT_FALSE(Parse({"train", "--coordinator", "h:1", "--model", "m.json",
                      "--timeline-svg", "x.svg"})
                   .ok());
  EXPECT_FALSE(
      Parse({"plan", "--model", "m.json", "--dp", "8", "--loss-svg", "x.svg"})
          .ok());
  EXPECT_THAT(ShardctlUsage(ShardctlCommand::kPlan),
              HasSubstr("--compare-strategy NAME"));
  EXPECT_THAT(ShardctlUsage(ShardctlCommand::kTrain),
              HasSubstr("--loss-svg FILE"));
}

}  // namespace
}  // namespace shardd
