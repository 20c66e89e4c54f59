#include "client/plan_printer.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(HumanBytesTest, BinaryUnits) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1024), "1.00 KiB");
  EXPECT_EQ(HumanBytes(1536), "1.50 KiB");
  EXPECT_EQ(HumanBytes(int64_t{5} << 20), "5.00 MiB");
  EXPECT_EQ(HumanBytes(int64_t{3} << 30), "3.00 GiB");
  EXPECT_EQ(HumanBytes((int64_t{1} << 40) + (int64_t{1} << 39)), "1.50 TiB");
  EXPECT_EQ(HumanBytes(-2048), "-2.00 KiB");
}

TEST(HumanCountTest, DecimalUnits) {
  EXPECT_EQ(HumanCount(0), "0");
  EXPECT_EQ(HumanCount(950), "950");
  EXPECT_EQ(HumanCount(1200), "1.20K");
  EXPECT_EQ(HumanCount(181'410'000), "181.41M");
  EXPECT_EQ(HumanCount(46'700'000'000), "46.70B");
  EXPECT_EQ(HumanCount(671'000'000'000'000), "671.00T");
}

// Two units over 4 ranks: a layer with w [10, 4] (rows 3 per rank, padded to
// 12) and the root with e [8, 4] (2 rows per rank, no padding).
v1::ShardingPlan TwoUnitPlan() {
  v1::ShardingPlan plan;
  plan.set_model_id("m-0123456789abcdef");
  plan.set_architecture("TestForCausalLM");
  plan.set_strategy("default");
  plan.mutable_mesh()->set_dp_shard(4);
  plan.mutable_mesh()->set_dp_replicate(1);
  plan.mutable_mesh()->set_tp(1);
  plan.mutable_mesh()->set_cp(1);
  plan.set_world_size(4);
  plan.mutable_precision()->set_param_dtype(v1::FLOAT32);
  plan.mutable_precision()->set_compute_dtype(v1::BFLOAT16);
  plan.mutable_precision()->set_reduce_dtype(v1::FLOAT32);
  plan.set_total_params(10 * 4 + 8 * 4);
  plan.set_fingerprint(0xabcdef);

  v1::FsdpUnit* layer = plan.add_units();
  layer->set_name("model.layers.0");
  layer->set_kind(v1::UNIT_LAYER);
  layer->set_layer_index(0);
  layer->set_index(0);
  layer->set_parent(-1);
  layer->set_numel(40);
  layer->set_shard_numel(12);     // 3 rows x 4.
  layer->set_gathered_numel(48);  // 12 x 4 ranks.
  layer->mutable_reshard_after_forward()->set_reshard(true);
  layer->add_forward_prefetch(1);
  v1::ParamLayout* w = layer->add_params();
  w->set_name("model.layers.0.w");
  w->add_global_shape(10);
  w->add_global_shape(4);
  w->set_dtype(v1::FLOAT32);
  w->set_shard_dim(0);
  w->set_padded_dim0(12);
  w->set_rows_per_rank(3);
  w->add_local_shape(3);
  w->add_local_shape(4);
  w->set_local_numel(12);
  w->set_numel(40);
  for (int rows : {3, 3, 3, 1}) w->add_valid_rows(rows);

  v1::FsdpUnit* root = plan.add_units();
  root->set_name("<root>");
  root->set_kind(v1::UNIT_ROOT);
  root->set_layer_index(-1);
  root->set_index(1);
  root->set_parent(-1);
  root->set_numel(32);
  root->set_shard_numel(8);
  root->set_gathered_numel(32);
  root->mutable_reshard_after_forward()->set_group_size(2);
  root->add_backward_prefetch(0);
  v1::ParamLayout* e = root->add_params();
  e->set_name("model.e");
  e->add_global_shape(8);
  e->add_global_shape(4);
  e->set_dtype(v1::FLOAT32);
  e->set_padded_dim0(8);
  e->set_rows_per_rank(2);
  e->set_local_numel(8);
  e->set_numel(32);
  for (int rows : {2, 2, 2, 2}) e->add_valid_rows(rows);

  v1::MemoryReport* memory = plan.mutable_memory();
  memory->set_sharded_param_bytes((12 + 8) * 4);
  memory->set_grad_bytes((12 + 8) * 4);
  memory->set_optimizer_bytes((12 + 8) * 8);
  memory->set_persistent_bytes(80 + 80 + 160);
  memory->set_peak_unsharded_bytes(3 << 20);
  memory->set_peak_param_bytes(2 << 20);
  memory->set_peak_grad_bytes(1 << 20);
  memory->set_peak_total_bytes((3 << 20) + 320);
  memory->set_peak_where("backward, unit model.layers.0");
  plan.mutable_comm()->set_all_gather_bytes(int64_t{5} << 30);
  plan.mutable_comm()->set_reduce_scatter_bytes(int64_t{3} << 30);
  plan.mutable_comm()->set_all_gathers(3);
  plan.mutable_comm()->set_reduce_scatters(2);
  return plan;
}

TEST(PlanToJsonTest, HasTheDocumentedFields) {
  const v1::ShardingPlan plan = TwoUnitPlan();
  v1::ModelSummary summary;
  summary.set_total_params(72);
  summary.set_trainable_params(72);
  const nlohmann::ordered_json json = PlanToJson(plan, &summary);
  EXPECT_EQ(json["total_params"], 72);
  EXPECT_EQ(json["strategy"], "default");
  EXPECT_EQ(json["world_size"], 4);
  EXPECT_EQ(json["model_id"], "m-0123456789abcdef");
  EXPECT_EQ(json["fingerprint"], "0000000000abcdef");
  EXPECT_EQ(json["summary"]["trainable_params"], 72);
  EXPECT_EQ(json["precision"]["compute_dtype"], "bfloat16");
  ASSERT_EQ(json["units"].size(), 2u);
  const auto& unit = json["units"][0];
  EXPECT_EQ(unit["name"], "model.layers.0");
  EXPECT_EQ(unit["kind"], "layer");
  // 48 gathered elements in bf16.
  EXPECT_EQ(unit["gathered_bytes"], 96);
  EXPECT_EQ(unit["reshard_after_forward"], true);
  EXPECT_EQ(unit["forward_prefetch"], nlohmann::ordered_json::array({1}));
  ASSERT_EQ(unit["params"].size(), 1u);
  const auto& param = unit["params"][0];
  EXPECT_EQ(param["name"], "model.layers.0.w");
  EXPECT_EQ(param["global_shape"], nlohmann::ordered_json::array({10, 4}));
  EXPECT_EQ(param["dtype"], "float32");
  EXPECT_EQ(param["shard_dim"], 0);
  EXPECT_EQ(param["padded_dim0"], 12);
  EXPECT_EQ(param["local_numel"], 12);
  EXPECT_EQ(json["units"][1]["kind"], "root");
  EXPECT_EQ(json["units"][1]["reshard_after_forward"], 2);
  EXPECT_EQ(json["per_rank"]["sharded_param_bytes"], 80);
  EXPECT_EQ(json["per_rank"]["grad_bytes"], 80);
  EXPECT_EQ(json["per_rank"]["optimizer_bytes"], 160);
  EXPECT_EQ(json["per_rank"]["peak_unsharded_bytes"], 3 << 20);
  EXPECT_EQ(json["comm"]["all_gather_bytes"], int64_t{5} << 30);
  EXPECT_EQ(json["comm"]["reduce_scatter_bytes"], int64_t{3} << 30);
  EXPECT_FALSE(json.contains("timeline"));
  EXPECT_FALSE(json["per_rank"].contains("timeline"));
  // One save's files (checkpoint/checkpoint_size.h): the 40 + 32 fp32
  // parameters of the two units, 3x with the AdamW moments, plus headers.
  ASSERT_TRUE(json.contains("checkpoint"));
  EXPECT_EQ(json["checkpoint"]["rank_bytes"].size(), 4u);
  const int64_t total = json["checkpoint"]["total_bytes"];
  const int64_t weights = json["checkpoint"]["total_bytes_without_optimizer"];
  EXPECT_GE(weights, 72 * 4);
  EXPECT_GE(total - weights, 72 * 8);
  EXPECT_LT(total, 72 * 12 + 4 * 8192);
}

TEST(PlanToJsonTest, DumpIsOneParsableObject) {
  const std::string text = FormatPlanJson(TwoUnitPlan(), nullptr);
  const auto parsed = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded());
  EXPECT_TRUE(parsed.is_object());
  EXPECT_FALSE(parsed.contains("summary"));
  EXPECT_EQ(text.back(), '\n');
}

TEST(PlanToJsonTest, InvalidUtf8DoesNotThrow) {
  v1::ShardingPlan plan = TwoUnitPlan();
  plan.mutable_memory()->set_peak_where(std::string("bad \xff byte"));
  const std::string text = FormatPlanJson(plan, nullptr);
  EXPECT_FALSE(nlohmann::json::parse(text, nullptr, false).is_discarded());
}

TEST(FormatPlanTableTest, ShowsUnitsMemoryAndComm) {
  const std::string table = FormatPlanTable(TwoUnitPlan(), nullptr);
  EXPECT_THAT(table, HasSubstr("TestForCausalLM (m-0123456789abcdef)"));
  EXPECT_THAT(table, HasSubstr("default, 2 units"));
  EXPECT_THAT(table, HasSubstr("dp_shard 4 x dp_replicate 1"));
  EXPECT_THAT(table, HasSubstr("world size 4"));
  EXPECT_THAT(table,
              HasSubstr("param float32, compute bfloat16, reduce float32"));
  // One row per unit, with kind, gathered bf16 bytes, reshard and prefetch.
  std::vector<std::string> lines = absl::StrSplit(table, '\n');
  std::string layer_row;
  std::string root_row;
  for (const std::string& line : lines) {
    if (line.find("model.layers.0 ") != std::string::npos) layer_row = line;
    if (line.find("<root>") != std::string::npos) root_row = line;
  }
  EXPECT_THAT(layer_row, HasSubstr("layer"));
  EXPECT_THAT(layer_row, HasSubstr("96 B"));
  EXPECT_THAT(layer_row, HasSubstr("yes"));
  EXPECT_THAT(layer_row, HasSubstr("fwd 1"));
  EXPECT_THAT(root_row, HasSubstr("root"));
  EXPECT_THAT(root_row, HasSubstr("to 2"));
  EXPECT_THAT(root_row, HasSubstr("bwd 0"));
  EXPECT_THAT(table, HasSubstr("Checkpoint (one save)"));
  EXPECT_THAT(table, HasSubstr("weights only"));
  EXPECT_THAT(table, HasSubstr("3.00 MiB"));  // Peak unsharded.
  EXPECT_THAT(table, HasSubstr("2.00 MiB"));  // Of it, gathered params.
  EXPECT_THAT(table, HasSubstr("backward, unit model.layers.0"));
  EXPECT_THAT(table, HasSubstr("5.00 GiB"));
  EXPECT_THAT(table, HasSubstr("in 3 collectives"));
  EXPECT_THAT(table, HasSubstr("3.00 GiB"));
  EXPECT_THAT(table, Not(HasSubstr("all-reduce")));  // No HSDP.
}

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

// Sets a unit's only parameter to `shape` (the fit estimate reads shapes).
void SetShape(v1::FsdpUnit* unit, std::vector<int64_t> shape) {
  v1::ParamLayout* param = unit->mutable_params(0);
  param->clear_global_shape();
  for (int64_t d : shape) param->add_global_shape(d);
}

// The two-unit plan over `dp` ranks with a memory report of 48 GiB
// persistent state (8 params + 8 grads + 32 optimizer) and a 6 GiB unsharded
// peak (4 gathered params + 2 unsharded grads): 54 GiB. Dim 0 of both
// parameters is 3 * 2^16, which every dp used here divides, so re-sharding
// pads nothing and the estimate is persistent * dp / N + peak unsharded.
v1::ShardingPlan FitPlan(int32_t dp) {
  v1::ShardingPlan plan = TwoUnitPlan();
  SetShape(plan.mutable_units(0), {3 << 16, 1024});
  SetShape(plan.mutable_units(1), {3 << 16, 16});
  plan.mutable_mesh()->set_dp_shard(dp);
  plan.set_world_size(dp);
  v1::MemoryReport* memory = plan.mutable_memory();
  memory->set_sharded_param_bytes(8 * kGiB);
  memory->set_grad_bytes(8 * kGiB);
  memory->set_optimizer_bytes(32 * kGiB);
  memory->set_persistent_bytes(48 * kGiB);
  memory->set_peak_param_bytes(4 * kGiB);
  memory->set_peak_grad_bytes(2 * kGiB);
  memory->set_peak_unsharded_bytes(6 * kGiB);
  memory->set_peak_total_bytes(54 * kGiB);
  return plan;
}

// The table line that starts with "  fits ".
std::string FitLine(const std::string& table) {
  for (absl::string_view line : absl::StrSplit(table, '\n')) {
    if (absl::StartsWith(line, "  fits ")) return std::string(line);
  }
  return "";
}

TEST(CheckPlanFitTest, FitsWithHeadroom) {
  const PlanFit fit = CheckPlanFit(FitPlan(4), 80 * kGiB);
  EXPECT_EQ(fit.device_memory_bytes, 80 * kGiB);
  EXPECT_TRUE(fit.fits);
  EXPECT_EQ(fit.headroom_bytes, 26 * kGiB);  // 80 - 54.
  EXPECT_EQ(fit.suggested_dp, 0);
}

TEST(CheckPlanFitTest, ExactlyFullFits) {
  const PlanFit fit = CheckPlanFit(FitPlan(4), 54 * kGiB);
  EXPECT_TRUE(fit.fits);
  EXPECT_EQ(fit.headroom_bytes, 0);
  const PlanFit over = CheckPlanFit(FitPlan(4), 54 * kGiB - 1);
  EXPECT_FALSE(over.fits);
  EXPECT_EQ(over.headroom_bytes, -1);
}

TEST(CheckPlanFitTest, SuggestsTheSmallestPowerOfTwoMultiple) {
  // 40 GiB: at dp 8 the state halves, 24 + 6 = 30 <= 40.
  PlanFit fit = CheckPlanFit(FitPlan(4), 40 * kGiB);
  EXPECT_FALSE(fit.fits);
  EXPECT_EQ(fit.headroom_bytes, -14 * kGiB);
  EXPECT_EQ(fit.suggested_dp, 8);
  // 30 GiB: the estimate at dp 8 is exactly 30, which fits.
  EXPECT_EQ(CheckPlanFit(FitPlan(4), 30 * kGiB).suggested_dp, 8);
  // 20 GiB: dp 8 gives 30, dp 16 gives 12 + 6 = 18.
  EXPECT_EQ(CheckPlanFit(FitPlan(4), 20 * kGiB).suggested_dp, 16);
  // dp 6 (not a power of two): 12 -> 30, 24 -> 18 <= 20.
  EXPECT_EQ(CheckPlanFit(FitPlan(6), 20 * kGiB).suggested_dp, 24);
}

// With activations (10 GiB at their peak, 8 GiB of them at the step's):
// they do not shrink with more ranks. 40 GiB: dp 8 gives 24 + 6 + 10 = 40.
TEST(CheckPlanFitTest, ActivationsStayWhenRanksGrow) {
  v1::ShardingPlan plan = FitPlan(4);
  v1::MemoryReport* memory = plan.mutable_memory();
  plan.mutable_activations()->set_micro_batch_size(2);
  plan.mutable_activations()->set_seq_len(4096);
  plan.mutable_activations()->set_checkpointing("none");
  memory->set_peak_activation_bytes(10 * kGiB);
  memory->set_peak_step_activation_bytes(8 * kGiB);
  memory->set_peak_step_bytes(13 * kGiB);
  memory->set_peak_total_bytes(61 * kGiB);
  EXPECT_EQ(CheckPlanFit(plan, 40 * kGiB).suggested_dp, 8);
  EXPECT_EQ(CheckPlanFit(plan, 40 * kGiB - 1).suggested_dp, 16);
  const std::string table = FormatPlanTable(plan, nullptr, 40 * kGiB);
  EXPECT_THAT(table, HasSubstr("  activations     10.00 GiB  peak per rank: "
                               "micro-batch 2 x 4096 tokens, checkpointing "
                               "none\n"));
  EXPECT_THAT(table, HasSubstr("  peak in step    13.00 GiB  unsharded + "
                               "activations 8.00 GiB at one point\n"));
  EXPECT_THAT(table, HasSubstr("  peak total      61.00 GiB  persistent + "
                               "peak in step\n"));
  // 8 of 13 GiB are activations: recomputing is suggested.
  EXPECT_THAT(FitLine(table),
              HasSubstr("--activation-checkpointing all recomputes them"));
  plan.mutable_activations()->set_checkpointing("all");
  EXPECT_THAT(FitLine(FormatPlanTable(plan, nullptr, 40 * kGiB)),
              Not(HasSubstr("--activation-checkpointing")));
}

TEST(CheckPlanFitTest, NoSuggestionBeyondTheCapOrUnderTheUnshardedPeak) {
  // 1 MiB of room beside the 6 GiB peak: 48 GiB / N <= 1 MiB needs
  // N >= 49152, so from dp 1 the first power of two is 65536 (the cap,
  // 48 GiB / 65536 = 768 KiB); 32768 leaves 1.5 MiB.
  EXPECT_EQ(CheckPlanFit(FitPlan(1), 6 * kGiB + kMiB).suggested_dp, 65536);
  // From dp 2 the largest multiple is 65536, a factor of 32768: 1.5 MiB.
  EXPECT_EQ(CheckPlanFit(FitPlan(2), 6 * kGiB + kMiB).suggested_dp, 0);
  // The unsharded peak alone fills the device: no dp helps.
  EXPECT_EQ(CheckPlanFit(FitPlan(4), 6 * kGiB).suggested_dp, 0);
  EXPECT_EQ(CheckPlanFit(FitPlan(4), 5 * kGiB).suggested_dp, 0);
  // Already at the cap.
  EXPECT_EQ(CheckPlanFit(FitPlan(65536), 20 * kGiB).suggested_dp, 0);
}

// Stacked experts pad: 8 expert rows over 16 ranks still leave a whole row
// on each rank and gather 16 rows. Unit 0 holds experts [8, 2^20], unit 1 a
// dense [2^16, 2^8]. At dp 8 a rank holds 2^20 + 2^21 elements; at N it
// holds 2^20 + 2^24 / N, so the state scales by (2^20 + 2^24 / N) / (3 *
// 2^20): 2/3 at 16, 1/2 at 32, 5/12 at 64, 3/8 at 128; the expert buffer
// gathers N / 8 times as much. With 96 GiB persistent and a 4 GiB
// unsharded peak the estimates are 64 + 8 = 72 GiB at 16, 48 + 16 = 64 at
// 32, 40 + 32 = 72 at 64 and 36 + 64 = 100 at 128: never below 64 GiB.
v1::ShardingPlan PaddedExpertsPlan() {
  v1::ShardingPlan plan = TwoUnitPlan();
  SetShape(plan.mutable_units(0), {8, 1 << 20});
  SetShape(plan.mutable_units(1), {1 << 16, 1 << 8});
  plan.mutable_mesh()->set_dp_shard(8);
  v1::MemoryReport* memory = plan.mutable_memory();
  memory->set_persistent_bytes(96 * kGiB);
  memory->set_peak_unsharded_bytes(4 * kGiB);
  memory->set_peak_total_bytes(100 * kGiB);
  return plan;
}

TEST(CheckPlanFitTest, PaddingKeepsStateAndGrowsTheGatheredPeak) {
  // 70 GiB: 72 at dp 16 is over, 64 at dp 32 fits. (Scaling the state by
  // dp / N alone would claim 48 + 4 = 52 at dp 16.)
  EXPECT_EQ(CheckPlanFit(PaddedExpertsPlan(), 70 * kGiB).suggested_dp, 32);
  EXPECT_EQ(CheckPlanFit(PaddedExpertsPlan(), 64 * kGiB).suggested_dp, 32);
  // 60 GiB: no N gets below 64.
  const PlanFit none = CheckPlanFit(PaddedExpertsPlan(), 60 * kGiB);
  EXPECT_FALSE(none.fits);
  EXPECT_EQ(none.suggested_dp, 0);
  EXPECT_EQ(FitLine(FormatPlanTable(PaddedExpertsPlan(), nullptr, 60 * kGiB)),
            "  fits 60 GiB     NO: needs 100.00 GiB, 40.00 GiB over; does not "
            "fit at any --dp up to 65536 with this strategy (estimate)");
}

TEST(CheckPlanFitTest, FlatBucketsPadTheUnitTotal) {
  // One flat unit of 12 elements at dp 4: 3 per rank; at 8: 2 (state 2/3,
  // gathered 16 / 12 = 4/3); at 16: 1 (1/3, 4/3); at 32: 1 (1/3, 32 / 12 =
  // 8/3). With 30 GiB persistent and 3 GiB unsharded: 20 + 4 = 24 GiB at 8,
  // 10 + 4 = 14 at 16, 10 + 8 = 18 at 32.
  v1::ShardingPlan plan = FitPlan(4);
  plan.set_flat_buckets(true);
  plan.mutable_units()->DeleteSubrange(1, 1);
  plan.mutable_units(0)->set_numel(12);
  v1::MemoryReport* memory = plan.mutable_memory();
  memory->set_persistent_bytes(30 * kGiB);
  memory->set_peak_unsharded_bytes(3 * kGiB);
  memory->set_peak_total_bytes(33 * kGiB);
  EXPECT_EQ(CheckPlanFit(plan, 25 * kGiB).suggested_dp, 8);
  EXPECT_EQ(CheckPlanFit(plan, 15 * kGiB).suggested_dp, 16);
  EXPECT_EQ(CheckPlanFit(plan, 12 * kGiB).suggested_dp, 0);
}

TEST(CheckPlanFitTest, PlanWithoutLayoutsScalesByRanks) {
  // No units: the state scales by dp / N. 48 / 2 + 6 = 30 <= 40 at dp 8.
  v1::ShardingPlan plan = FitPlan(4);
  plan.clear_units();
  EXPECT_EQ(CheckPlanFit(plan, 40 * kGiB).suggested_dp, 8);
  EXPECT_EQ(CheckPlanFit(plan, 20 * kGiB).suggested_dp, 16);
}

TEST(FormatPlanTableTest, FitLineWhenItFits) {
  const std::string table = FormatPlanTable(FitPlan(4), nullptr, 80 * kGiB);
  EXPECT_EQ(FitLine(table),
            "  fits 80 GiB     yes: 54.00 GiB of 80.00 GiB, 26.00 GiB left for "
            "activations and workspace");
  // Right after "peak total".
  const size_t total = table.find("  peak total");
  ASSERT_NE(total, std::string::npos);
  EXPECT_EQ(table.find("  fits ", total), table.find('\n', total) + 1);
}

TEST(FormatPlanTableTest, FitLineDoesNotWidenTheMemoryColumns) {
  const std::string table = FormatPlanTable(FitPlan(4), nullptr, 80 * kGiB);
  const size_t begin = table.find("Per-rank memory\n");
  const size_t end = table.find("\n\nCheckpoint");
  ASSERT_NE(begin, std::string::npos);
  ASSERT_NE(end, std::string::npos);
  // Labels are 14 wide ("sharded params"), values 9 ("32.00 GiB"); the
  // verdict starts in the value column and runs on.
  EXPECT_EQ(
      table.substr(begin, end + 1 - begin),
      "Per-rank memory\n"
      "  sharded params   8.00 GiB  master shards, float32\n"
      "  sharded grads    8.00 GiB  float32\n"
      "  optimizer       32.00 GiB  AdamW exp_avg + exp_avg_sq\n"
      "  persistent      48.00 GiB  params + grads + optimizer\n"
      "  peak unsharded   6.00 GiB  gathered params 4.00 GiB + "
      "unsharded grads 2.00 GiB\n"
      "  peak total      54.00 GiB  persistent + peak unsharded "
      "(activations not counted: --micro-batch-size N --seq N counts them)\n"
      "  fits 80 GiB     yes: 54.00 GiB of 80.00 GiB, 26.00 GiB left for "
      "activations and workspace\n"
      "  peak at: backward, unit model.layers.0\n");
}

TEST(FormatPlanTableTest, FitLineWithASuggestion) {
  const std::string table = FormatPlanTable(FitPlan(4), nullptr, 20 * kGiB);
  EXPECT_EQ(FitLine(table),
            "  fits 20 GiB     NO: needs 54.00 GiB, 34.00 GiB over; fits from "
            "about --dp 16 (estimate: the same units sharded over more "
            "ranks)");
}

TEST(FormatPlanTableTest, FitLineWithoutASuggestion) {
  EXPECT_EQ(FitLine(FormatPlanTable(FitPlan(4), nullptr, 5 * kGiB)),
            "  fits 5 GiB      NO: needs 54.00 GiB, 49.00 GiB over; does not "
            "fit at any --dp with this strategy: the unsharded peak alone is "
            "6.00 GiB");
  EXPECT_EQ(FitLine(FormatPlanTable(FitPlan(2), nullptr, 6 * kGiB + kMiB)),
            // 47.999 GiB over, rounded.
            "  fits 6.00 GiB   NO: needs 54.00 GiB, 48.00 GiB over; does not "
            "fit at any --dp up to 65536 with this strategy (estimate)");
}

TEST(FormatPlanTableTest, FitLabelShowsDecimalSizesInGiB) {
  // 80 GB = 80e9 B = 74.505... GiB; 80e9 B - 54 GiB = 20.505... GiB.
  EXPECT_EQ(FitLine(FormatPlanTable(FitPlan(4), nullptr, 80'000'000'000)),
            "  fits 74.51 GiB  yes: 54.00 GiB of 74.51 GiB, 20.51 GiB left "
            "for activations and workspace");
  EXPECT_EQ(FitLine(FormatPlanTable(FitPlan(4), nullptr, 1024 * kGiB)),
            "  fits 1 TiB      yes: 54.00 GiB of 1.00 TiB, 970.00 GiB left "
            "for activations and workspace");
}

TEST(FormatPlanTableTest, NoFitLineWithoutDeviceMemory) {
  EXPECT_EQ(FitLine(FormatPlanTable(FitPlan(4), nullptr, 0)), "");
  // The default is an H100.
  EXPECT_THAT(FitLine(FormatPlanTable(FitPlan(4), nullptr)),
              ::testing::StartsWith("  fits 80 GiB "));
}

TEST(PlanToJsonTest, FitObject) {
  const nlohmann::ordered_json fits =
      PlanToJson(FitPlan(4), nullptr, 80 * kGiB);
  ASSERT_TRUE(fits.contains("fit"));
  EXPECT_EQ(fits["fit"]["device_memory_bytes"], 80 * kGiB);
  EXPECT_EQ(fits["fit"]["fits"], true);
  EXPECT_EQ(fits["fit"]["headroom_bytes"], 26 * kGiB);
  EXPECT_FALSE(fits["fit"].contains("suggested_dp"));

  const nlohmann::ordered_json over =
      PlanToJson(FitPlan(4), nullptr, 40 * kGiB);
  EXPECT_EQ(over["fit"]["fits"], false);
  EXPECT_EQ(over["fit"]["headroom_bytes"], -14 * kGiB);
  EXPECT_EQ(over["fit"]["suggested_dp"], 8);

  const nlohmann::ordered_json hopeless =
      PlanToJson(FitPlan(4), nullptr, 5 * kGiB);
  EXPECT_EQ(hopeless["fit"]["fits"], false);
  EXPECT_EQ(hopeless["fit"]["headroom_bytes"], -49 * kGiB);
  EXPECT_FALSE(hopeless["fit"].contains("suggested_dp"));

  EXPECT_FALSE(PlanToJson(FitPlan(4), nullptr, 0).contains("fit"));
}

}  // namespace
}  // namespace shardd
