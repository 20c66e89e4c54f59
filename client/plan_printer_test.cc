#include "client/plan_printer.h"

#include <string>

#include "absl/strings/str_split.h"
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
  e->set_local_numel(8);

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
  EXPECT_THAT(table, HasSubstr("3.00 MiB"));  // Peak unsharded.
  EXPECT_THAT(table, HasSubstr("2.00 MiB"));  // Of it, gathered params.
  EXPECT_THAT(table, HasSubstr("backward, unit model.layers.0"));
  EXPECT_THAT(table, HasSubstr("5.00 GiB"));
  EXPECT_THAT(table, HasSubstr("in 3 collectives"));
  EXPECT_THAT(table, HasSubstr("3.00 GiB"));
  EXPECT_THAT(table, Not(HasSubstr("all-reduce")));  // No HSDP.
}

}  // namespace
}  // namespace shardd
