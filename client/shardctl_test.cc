#include "client/shardctl.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/hf_interop.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "testing/test_dir.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

struct Result {
  int code;
  std::string out;
  std::string err;
};

Result Shardctl(std::vector<std::string> args) {
  std::ostringstream out;
  std::ostringstream err;
  const int code = RunShardctl(args, out, err);
  return {code, out.str(), err.str()};
}

// Data files are in the runfiles tree, relative to the test's directory.
constexpr char kTinyMoe[] = "tests/data/tiny_moe.json";
constexpr char kMixtral[] = "tests/data/mixtral_8x7b.json";

int64_t Product(const nlohmann::json& shape) {
  int64_t n = 1;
  for (const auto& d : shape) n *= d.get<int64_t>();
  return n;
}

TEST(ShardctlTest, HelpIsExitZero) {
  Result overview = Shardctl({"--help"});
  EXPECT_EQ(overview.code, kShardctlOk);
  EXPECT_THAT(overview.out, HasSubstr("strategies"));
  Result plan = Shardctl({"plan", "--help"});
  EXPECT_EQ(plan.code, kShardctlOk);
  EXPECT_THAT(plan.out, HasSubstr("--reshard-after-forward"));
}

TEST(ShardctlTest, UsageErrorsAreExitTwo) {
  Result r = Shardctl({"plan", "--model", kTinyMoe, "--dp", "x"});
  EXPECT_EQ(r.code, kShardctlUsage);
  EXPECT_THAT(r.err,
              StartsWith("shardctl: --dp: expected an integer >= 1, got 'x'"));
  EXPECT_TRUE(r.out.empty());
  EXPECT_EQ(Shardctl({"status"}).code, kShardctlUsage);
  EXPECT_EQ(Shardctl({}).code, kShardctlUsage);
}

TEST(ShardctlTest, PlanErrorsAreExitOneWithCode) {
  Result r = Shardctl({"plan", "--model", kTinyMoe, "--dp", "2", "--strategy",
                       "no_such_strategy"});
  EXPECT_EQ(r.code, kShardctlError);
  EXPECT_THAT(r.err, StartsWith("shardctl: INVALID_ARGUMENT: "));
  EXPECT_THAT(r.err, HasSubstr("strategy"));

  Result missing = Shardctl(
      {"plan", "--hf-config", "/nonexistent/config.json", "--dp", "2"});
  EXPECT_EQ(missing.code, kShardctlError);
  EXPECT_THAT(missing.err, StartsWith("shardctl: NOT_FOUND: --hf-config"));

  // A native spec is not an HF config: no "architectures".
  Result wrong_kind = Shardctl({"plan", "--hf-config", kTinyMoe, "--dp", "2"});
  EXPECT_EQ(wrong_kind.code, kShardctlError);
  EXPECT_THAT(wrong_kind.err, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(wrong_kind.err, HasSubstr("architectures"));
}

TEST(ShardctlTest, UnreachableCoordinatorIsUnavailable) {
  // A port that was free a moment ago: nothing listens there.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  close(fd);

  Result r =
      Shardctl({"strategies", "--coordinator", address, "--timeout", "0.5"});
  EXPECT_EQ(r.code, kShardctlError);
  EXPECT_THAT(r.err, StartsWith("shardctl: UNAVAILABLE: "));
  EXPECT_THAT(r.err, HasSubstr(address));
}

TEST(ShardctlTest, StrategiesInProcess) {
  Result r = Shardctl({"strategies"});
  ASSERT_EQ(r.code, kShardctlOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("diffusion_gemma"));
  EXPECT_THAT(r.out, HasSubstr("DiffusionGemmaForBlockDiffusion"));
  EXPECT_THAT(r.out, HasSubstr("MixtralForCausalLM"));
  Result json = Shardctl({"strategies", "--json"});
  ASSERT_EQ(json.code, kShardctlOk) << json.err;
  auto parsed = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded());
  ASSERT_TRUE(parsed.contains("strategies"));
  EXPECT_GE(parsed["strategies"].size(), 4u);
}

// The JSON obeys the FSDP2 layout laws, checked here from the JSON alone.
TEST(ShardctlTest, PlanJsonFollowsTheLayoutLaws) {
  constexpr int kWorld = 4;
  Result r = Shardctl({"plan", "--model", kTinyMoe, "--dp", "4", "--json"});
  ASSERT_EQ(r.code, kShardctlOk) << r.err;
  auto json = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(json.is_discarded());
  ASSERT_TRUE(json.is_object());
  EXPECT_EQ(json["world_size"], kWorld);
  ASSERT_TRUE(json["units"].is_array());
  ASSERT_GE(json["units"].size(), 2u);

  int64_t total_numel = 0;
  int64_t total_shard_numel = 0;
  for (const auto& unit : json["units"]) {
    int64_t unit_numel = 0;
    int64_t unit_local = 0;
    for (const auto& param : unit["params"]) {
      const auto& shape = param["global_shape"];
      ASSERT_FALSE(shape.empty());
      const int64_t d0 = shape[0].get<int64_t>();
      const int64_t padded = (d0 + kWorld - 1) / kWorld * kWorld;
      EXPECT_EQ(param["shard_dim"], 0) << param["name"];
      EXPECT_EQ(param["padded_dim0"], padded) << param["name"];
      const int64_t row = Product(shape) / d0;
      EXPECT_EQ(param["local_numel"], padded / kWorld * row) << param["name"];
      unit_numel += Product(shape);
      unit_local += param["local_numel"].get<int64_t>();
    }
    EXPECT_EQ(unit["numel"], unit_numel) << unit["name"];
    EXPECT_EQ(unit["shard_numel"], unit_local) << unit["name"];
    total_numel += unit_numel;
    total_shard_numel += unit_local;
  }
  // Tied parameters are listed once, so the units add up to the total.
  EXPECT_EQ(json["total_params"], total_numel);
  // fp32 master shards: 4 bytes per local element.
  EXPECT_EQ(json["per_rank"]["sharded_param_bytes"], 4 * total_shard_numel);
  EXPECT_GT(json["per_rank"]["peak_unsharded_bytes"].get<int64_t>(), 0);
  EXPECT_GT(json["comm"]["all_gather_bytes"].get<int64_t>(), 0);
  EXPECT_GT(json["comm"]["reduce_scatter_bytes"].get<int64_t>(), 0);
}

TEST(ShardctlTest, MixtralTableAndJson) {
  Result table = Shardctl({"plan", "--hf-config", kMixtral, "--dp", "8"});
  ASSERT_EQ(table.code, kShardctlOk) << table.err;
  EXPECT_THAT(table.out, HasSubstr("MixtralForCausalLM"));
  EXPECT_THAT(table.out, HasSubstr("model.layers.31"));
  EXPECT_THAT(table.out, HasSubstr("world size 8"));
  EXPECT_THAT(table.out, HasSubstr("peak unsharded"));

  Result json_run =
      Shardctl({"plan", "--hf-config", kMixtral, "--dp", "8", "--json"});
  ASSERT_EQ(json_run.code, kShardctlOk) << json_run.err;
  auto json = nlohmann::json::parse(json_run.out, nullptr, false);
  ASSERT_FALSE(json.is_discarded());
  // Published total: 46.7B.
  const int64_t total = json["total_params"].get<int64_t>();
  EXPECT_GT(total, 46'650'000'000);
  EXPECT_LT(total, 46'750'000'000);
  // 32 decoder layers plus the root.
  EXPECT_EQ(json["units"].size(), 33u);
  EXPECT_EQ(json["strategy"], "default");
}

// Expert parallelism: the table shows the ep dimension, each unit's shard
// group and the all-to-all bytes; the JSON carries them, and the expert
// units' gathered buffers are one block over dp / ep ranks.
TEST(ShardctlTest, PlanWithExpertParallelism) {
  const std::vector<std::string> base = {"plan",  "--hf-config", kMixtral,
                                         "--dp",  "8",           "--ep",
                                         "4",     "--micro-batch-size",
                                         "1",     "--seq",       "512"};
  Result table = Shardctl(base);
  ASSERT_EQ(table.code, kShardctlOk) << table.err;
  EXPECT_THAT(table.out, HasSubstr("experts: ep 4 x ep_shard 2, 4 groups of 2 "
                                   "consecutive ranks"));
  EXPECT_THAT(table.out, HasSubstr("2 (1/4)"));
  EXPECT_THAT(table.out, HasSubstr("all-to-all"));
  EXPECT_THAT(table.out, HasSubstr("expert dispatch and combine"));
  EXPECT_THAT(table.out, HasSubstr("2x the balanced routed rows"));

  std::vector<std::string> json_args = base;
  json_args.push_back("--json");
  json_args.push_back("--ep-capacity-factor");
  json_args.push_back("1.5");
  Result json_run = Shardctl(json_args);
  ASSERT_EQ(json_run.code, kShardctlOk) << json_run.err;
  auto json = nlohmann::json::parse(json_run.out, nullptr, false);
  ASSERT_FALSE(json.is_discarded());
  EXPECT_EQ(json["mesh"]["ep"], 4);
  EXPECT_EQ(json["mesh"]["ep_shard"], 2);
  EXPECT_EQ(json["activations"]["ep_capacity_factor"], 1.5);
  int experts = 0;
  for (const auto& unit : json["units"]) {
    if (unit["kind"] != "experts") {
      EXPECT_EQ(unit["ep"], 1) << unit["name"];
      EXPECT_EQ(unit["shard_group"], 8) << unit["name"];
      continue;
    }
    ++experts;
    EXPECT_EQ(unit["ep"], 4) << unit["name"];
    EXPECT_EQ(unit["shard_group"], 2) << unit["name"];
    EXPECT_EQ(unit["gathered_numel"].get<int64_t>(),
              2 * unit["shard_numel"].get<int64_t>());
    // Mixtral's 8 experts in 4 blocks of 2, each block over 2 ranks.
    int64_t block_numel = 0;
    for (const auto& param : unit["params"]) {
      EXPECT_EQ(param["ep_blocks"], 4);
      block_numel += Product(param["global_shape"]) / 4;
    }
    EXPECT_EQ(unit["numel"].get<int64_t>(), 4 * block_numel);
  }
  EXPECT_EQ(experts, 32);
  // 32 MoE layers, 2 exchanges forward and 2 backward of 512 x top-2 rows
  // of 4096 floats and 3 more (expert id, weight, its gradient).
  EXPECT_EQ(json["comm"]["all_to_alls"], 32 * 4);
  EXPECT_EQ(json["comm"]["all_to_all_bytes"].get<int64_t>(),
            int64_t{32} * 512 * 2 * (4 * 4096 + 3) * 4);

  Result bad = Shardctl({"plan", "--hf-config", kMixtral, "--dp", "8", "--ep",
                         "3"});
  EXPECT_EQ(bad.code, kShardctlError);
  EXPECT_THAT(bad.err, HasSubstr("options.mesh.ep (--ep)"));
  Result factor = Shardctl({"plan", "--hf-config", kMixtral, "--dp", "8",
                            "--ep", "2", "--ep-capacity-factor", "0.5"});
  EXPECT_EQ(factor.code, kShardctlUsage);
  EXPECT_THAT(factor.err, HasSubstr("--ep-capacity-factor: expected a number"));
}

// The fit verdict is computed here from the JSON's own memory numbers.
TEST(ShardctlTest, PlanChecksTheFitAgainstDeviceMemory) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  for (const auto& [flag, device] :
       std::vector<std::pair<std::string, int64_t>>{
           {"", 80 * kGiB}, {"141GiB", 141 * kGiB}, {"1MiB", 1 << 20}}) {
    SCOPED_TRACE(flag);
    std::vector<std::string> args = {"plan", "--hf-config", kMixtral,
                                     "--dp", "8",           "--json"};
    if (!flag.empty()) {
      args.push_back("--device-memory");
      args.push_back(flag);
    }
    Result r = Shardctl(args);
    ASSERT_EQ(r.code, kShardctlOk) << r.err;
    auto json = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_FALSE(json.is_discarded());
    ASSERT_TRUE(json.contains("fit"));
    const int64_t peak = json["per_rank"]["peak_total_bytes"].get<int64_t>();
    EXPECT_EQ(json["fit"]["device_memory_bytes"], device);
    EXPECT_EQ(json["fit"]["headroom_bytes"], device - peak);
    EXPECT_EQ(json["fit"]["fits"], peak <= device);
  }
  // 1 MiB is less than the unsharded peak alone: nothing to suggest.
  Result tiny = Shardctl({"plan", "--hf-config", kMixtral, "--dp", "8",
                          "--device-memory", "1MiB"});
  ASSERT_EQ(tiny.code, kShardctlOk) << tiny.err;
  EXPECT_THAT(tiny.out, HasSubstr("  fits 1 MiB "));
  EXPECT_THAT(tiny.out, HasSubstr("NO: needs "));
  EXPECT_THAT(tiny.out, HasSubstr("the unsharded peak alone is"));
  Result big = Shardctl({"plan", "--hf-config", kMixtral, "--dp", "8",
                         "--device-memory", "1024TiB"});
  ASSERT_EQ(big.code, kShardctlOk) << big.err;
  EXPECT_THAT(big.out, HasSubstr("  fits 1 PiB "));
  EXPECT_THAT(big.out, HasSubstr("yes: "));

  Result bad = Shardctl({"plan", "--hf-config", kMixtral, "--dp", "8",
                         "--device-memory", "lots"});
  EXPECT_EQ(bad.code, kShardctlUsage);
  EXPECT_THAT(bad.err, StartsWith("shardctl: --device-memory: expected a size "
                                  "like 80GiB, 80GB or 80 (GiB), got 'lots'"));
}

// (section: timeline-svg)
std::string ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string TestTmp(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos;
       at = text.find(what, at + what.size())) {
    ++n;
  }
  return n;
}

TEST(ShardctlTest, PlanDrawsTheTimeline) {
  const std::string path = TestTmp("tiny_timeline.svg");
  Result r = Shardctl(
      {"plan", "--model", kTinyMoe, "--dp", "4", "--timeline-svg", path});
  ASSERT_EQ(r.code, kShardctlOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Timeline  wrote " + path));
  const std::string svg = ReadWhole(path);
  EXPECT_THAT(svg, StartsWith("<?xml"));
  EXPECT_THAT(svg, HasSubstr("tiny_moe.json: default, world size 4"));
  EXPECT_THAT(svg, HasSubstr("class=\"area\""));
  EXPECT_EQ(Count(svg, "<g class=\"peak\">"), 1u);
  EXPECT_THAT(svg, HasSubstr("gathered params: "));
  EXPECT_THAT(svg, HasSubstr("unsharded grads: "));
  EXPECT_THAT(svg, HasSubstr("</svg>"));

  // --json stays one JSON object, without the timeline the picture needed.
  Result json = Shardctl({"plan", "--model", kTinyMoe, "--dp", "4", "--json",
                          "--timeline-svg", path});
  ASSERT_EQ(json.code, kShardctlOk) << json.err;
  const nlohmann::json parsed = nlohmann::json::parse(json.out);
  EXPECT_FALSE(parsed["per_rank"].contains("timeline"));
  // Same plan, same picture.
  EXPECT_EQ(ReadWhole(path), svg);
}

TEST(ShardctlTest, PlanOverlaysACompareStrategy) {
  const std::string path = TestTmp("dg_compare.svg");
  Result r =
      Shardctl({"plan", "--hf-config", "tests/data/diffusion_gemma_26b.json",
                "--dp", "8", "--strategy", "default", "--compare-strategy",
                "diffusion_gemma", "--timeline-svg", path});
  ASSERT_EQ(r.code, kShardctlOk) << r.err;
  const std::string svg = ReadWhole(path);
  EXPECT_THAT(svg, HasSubstr("default vs diffusion_gemma, world size 8"));
  EXPECT_EQ(Count(svg, "<g class=\"peak\">"), 2u);
  EXPECT_THAT(svg, HasSubstr(">default peak "));
  EXPECT_THAT(svg, HasSubstr(">diffusion_gemma peak "));
  EXPECT_EQ(Count(svg, "class=\"line\""), 1u);
  EXPECT_THAT(svg, HasSubstr("diffusion_gemma total"));

  Result bad =
      Shardctl({"plan", "--model", kTinyMoe, "--dp", "4", "--compare-strategy",
                "no_such_strategy", "--timeline-svg", path});
  EXPECT_EQ(bad.code, kShardctlError);
  EXPECT_THAT(bad.err, HasSubstr("--compare-strategy no_such_strategy"));
  Result unwritable = Shardctl({"plan", "--model", kTinyMoe, "--dp", "4",
                                "--timeline-svg", "/nonexistent/dir/x.svg"});
  EXPECT_EQ(unwritable.code, kShardctlError);
  EXPECT_THAT(unwritable.err, HasSubstr("--timeline-svg: cannot write"));
}

// consolidate --hf gpt-oss / diffusion-gemma: a checkpoint imported from
// HF tensors in that naming is exported back to the very same tensors.
TEST(ShardctlTest, ConsolidateExportsGptOssAndDiffusionGemma) {
  using checkpoint::HfMoeNaming;
  using checkpoint::HostTensor;
  auto f32 = [](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    HostTensor t{name, "F32", std::move(shape),
                 std::vector<uint8_t>(static_cast<size_t>(4 * n))};
    for (size_t i = 0; i < t.bytes.size(); ++i) {
      t.bytes[i] = static_cast<uint8_t>(i * 37 + name.size());
    }
    return t;
  };
  // shardd tensors of one MoE layer (E = 2, D = 3, I = 2), as each naming's
  // model has them.
  const std::vector<HostTensor> gpt_oss = {
      f32("model.norm.weight", {3}),
      f32("model.layers.0.moe.gate.weight", {2, 3}),
      f32("model.layers.0.moe.gate.bias", {2}),
      f32("model.layers.0.moe.experts.gate_and_up_projs", {2, 3, 4}),
      f32("model.layers.0.moe.experts.gate_up_proj_bias", {2, 4}),
      f32("model.layers.0.moe.experts.down_projs", {2, 2, 3}),
      f32("model.layers.0.moe.experts.down_proj_bias", {2, 3})};
  const std::vector<HostTensor> diffusion_gemma = {
      f32("model.norm.weight", {3}),
      f32("model.layers.0.layer_scalar", {1}),
      f32("model.layers.0.moe.gate.scale", {3}),
      f32("model.layers.0.moe.gate.proj.weight", {2, 3}),
      f32("model.layers.0.moe.experts.gate_and_up_projs", {2, 3, 4}),
      f32("model.layers.0.moe.experts.down_projs", {2, 2, 3})};
  struct Case {
    std::string flag;
    HfMoeNaming naming;
    const std::vector<HostTensor>* shardd;
  };
  for (const Case& c : {Case{"gpt-oss", HfMoeNaming::kGptOss, &gpt_oss},
                        Case{"diffusion-gemma", HfMoeNaming::kDiffusionGemma,
                             &diffusion_gemma}}) {
    SCOPED_TRACE(c.flag);
    SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<HostTensor> hf,
                                checkpoint::ShardToHf(*c.shardd, c.naming));
    const std::string in = testing_util::FreshTestDir(c.flag + "_in");
    SHARDD_ASSERT_OK(checkpoint::WriteHfTensors(in, hf));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const std::string path,
        checkpoint::ImportHfToCheckpoint(
            in, testing_util::FreshTestDir(c.flag + "_ckpt")));
    const std::string out = testing_util::FreshTestDir(c.flag + "_out");
    Result r = Shardctl({"checkpoint", "consolidate", "--checkpoint", path,
                         "--out", out, "--hf", c.flag});
    ASSERT_EQ(r.code, kShardctlOk) << r.err;
    EXPECT_THAT(r.out, HasSubstr("(" + c.flag + " naming)"));
    SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<HostTensor> back,
                                checkpoint::ReadHfTensors(out));
    ASSERT_EQ(back.size(), hf.size());
    for (size_t i = 0; i < hf.size(); ++i) {
      EXPECT_EQ(back[i].name, hf[i].name);
      EXPECT_EQ(back[i].shape, hf[i].shape) << hf[i].name;
      EXPECT_TRUE(back[i].bytes == hf[i].bytes) << hf[i].name;
    }
  }
}

}  // namespace
}  // namespace shardd
