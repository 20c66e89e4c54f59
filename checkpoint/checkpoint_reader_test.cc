#include "checkpoint/checkpoint_reader.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "proto/plan.pb.h"
#include "model/model_util.h"
#include "layout/unit_layout.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_util.h"
#include "layout/shard_ranges.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;

std::string TestRoot() {
  std::string name =
      ::testing::UnitTest::GetInstance()->current_test_info()->name();
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  const std::string root = absl::StrCat(getenv("TEST_TMPDIR"), "/", name);
  std::filesystem::remove_all(root);
  return root;
}

// A unit of three parameters (w [10, 4], b [3, 5], n [7]) with known global
// values; each parameter also has exp_avg / exp_avg_sq state. A rank's
// state for one layout is its local shards, as ShardStore holds them.
class Unit {
 public:
  Unit() {
    int p = 0;
    for (auto& [name, shape] :
         std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"layer.w", {10, 4}}, {"layer.b", {3, 5}}, {"layer.n", {7}}}) {
      v1::TensorSpec& t = specs_.emplace_back();
      t.set_name(name);
      for (int64_t d : shape) t.add_shape(d);
      t.set_dtype(v1::FLOAT32);
      ParamRef ref;
      ref.fqn = name;
      ref.tensor = &t;
      refs_.push_back(ref);
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      // Distinct values for every element of every state tensor.
      const char* suffixes[] = {"", kExpAvgSuffix, kExpAvgSqSuffix};
      for (int s = 0; s < 3; ++s) {
        std::vector<float>& v = values_[name + suffixes[s]];
        for (int64_t i = 0; i < numel; ++i) {
          v.push_back(1000.0f * p + 0.5f * i + 0.125f * s);
        }
      }
      ++p;
    }
  }

  // The planner's layout of the unit over `world` shard ranks.
  v1::FsdpUnit Layout(bool flat, int world) const {
    v1::FsdpUnit unit;
    absl::Status s = flat ? LayoutFlatRanges(refs_, world, &unit)
                          : LayoutDim0Shards(refs_, world, &unit);
    EXPECT_THAT(s, IsOk());
    return unit;
  }

  const std::vector<float>& Global(const std::string& tensor) const {
    return values_.at(tensor);
  }

  static std::vector<std::string> Names(const v1::ParamLayout& p) {
    return {p.name(), p.name() + kExpAvgSuffix, p.name() + kExpAvgSqSuffix};
  }

  // Saves every rank's shards of `unit` (only owned elements, padding
  // dropped) and commits; returns the checkpoint path.
  std::string Save(const std::string& root, const v1::FsdpUnit& unit,
                   int world) const {
    absl::StatusOr<std::string> tmp = BeginCheckpoint(root, 9);
    EXPECT_THAT(tmp, IsOk());
    CheckpointIndex index;
    index.step = 9;
    for (int r = 0; r < world; ++r) {
      // One local shard buffer per state tensor, filled as ShardStore would.
      std::map<std::string, std::vector<float>> shards;
      std::vector<RankTensor> pieces;
      for (const v1::ParamLayout& p : unit.params()) {
        auto ranges = OwnedElementRanges(p, unit.shard_numel(), r);
        EXPECT_THAT(ranges, IsOk());
        for (const std::string& name : Names(p)) {
          std::vector<float>& shard = shards[name];
          shard.assign(unit.shard_numel(), -1.0f);
          for (const OwnedRange& o : *ranges) {
            for (int64_t i = o.begin; i < o.end; ++i) {
              shard[o.shard_offset + i - o.begin] = Global(name)[i];
            }
            pieces.push_back(
                {name, "F32",
                 std::vector<int64_t>(p.global_shape().begin(),
                                      p.global_shape().end()),
                 o.begin, o.end,
                 absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(
                                               shard.data() + o.shard_offset),
                                           (o.end - o.begin) * sizeof(float))});
          }
        }
      }
      absl::StatusOr<RankFile> file = WriteRankFile(*tmp, r, pieces);
      EXPECT_THAT(file, IsOk());
      EXPECT_THAT(AddRankFile(*file, &index), IsOk());
    }
    absl::StatusOr<std::string> path = CommitCheckpoint(root, *tmp, index);
    EXPECT_THAT(path, IsOk());
    return *path;
  }

  // Loads every rank of `unit` from the checkpoint, each rank through its own
  // reader, and checks the values and that each rank read exactly the bytes
  // of the elements it owns.
  void ExpectLoads(const std::string& path, const v1::FsdpUnit& unit,
                   int world) const {
    int64_t total = 0;
    for (int r = 0; r < world; ++r) {
      absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
          CheckpointReader::Open(path);
      ASSERT_THAT(reader, IsOk());
      int64_t owned_bytes = 0;
      for (const v1::ParamLayout& p : unit.params()) {
        auto ranges = OwnedElementRanges(p, unit.shard_numel(), r);
        ASSERT_THAT(ranges, IsOk());
        for (const std::string& name : Names(p)) {
          std::vector<float> shard(unit.shard_numel(), -7.0f);
          for (const OwnedRange& o : *ranges) {
            ASSERT_THAT((*reader)->ReadElements(name, o.begin, o.end,
                                                shard.data() + o.shard_offset),
                        IsOk());
            owned_bytes += (o.end - o.begin) * sizeof(float);
            for (int64_t i = o.begin; i < o.end; ++i) {
              ASSERT_EQ(shard[o.shard_offset + i - o.begin], Global(name)[i])
                  << name << " element " << i << " rank " << r;
            }
          }
        }
      }
      EXPECT_EQ((*reader)->data_bytes_read(), owned_bytes) << "rank " << r;
      total += owned_bytes;
    }
    // Over all ranks: every element once.
    int64_t all = 0;
    for (const auto& [name, v] : values_) all += v.size() * sizeof(float);
    EXPECT_EQ(total, all);
  }

 private:
  std::deque<v1::TensorSpec> specs_;
  std::vector<ParamRef> refs_;
  std::map<std::string, std::vector<float>> values_;
};

TEST(CheckpointReaderTest, Dim0SaveOn4LoadsOnAnyLayout) {
  Unit unit;
  const std::string path =
      unit.Save(TestRoot(), unit.Layout(/*flat=*/false, 4), 4);
  // 4 files; b's 3 rows leave rank 3 without a chunk of it.
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(path));
  EXPECT_EQ(reader->index().files.size(), 4u);
  EXPECT_EQ(reader->FindTensor("layer.b")->chunks.size(), 3u);
  SHARDD_EXPECT_OK(reader->VerifyAll());

  unit.ExpectLoads(path, unit.Layout(false, 3), 3);
  unit.ExpectLoads(path, unit.Layout(false, 4), 4);
  unit.ExpectLoads(path, unit.Layout(false, 1), 1);
  unit.ExpectLoads(path, unit.Layout(false, 8), 8);
  unit.ExpectLoads(path, unit.Layout(/*flat=*/true, 3), 3);
  unit.ExpectLoads(path, unit.Layout(true, 2), 2);
}

TEST(CheckpointReaderTest, FlatSaveOn3LoadsAsDim0) {
  Unit unit;
  const std::string path = unit.Save(TestRoot(), unit.Layout(true, 3), 3);
  unit.ExpectLoads(path, unit.Layout(false, 2), 2);
  unit.ExpectLoads(path, unit.Layout(false, 5), 5);
  unit.ExpectLoads(path, unit.Layout(true, 4), 4);
}

TEST(CheckpointReaderTest, ReadsAcrossChunkBoundariesReadOnlyTheRange) {
  Unit unit;
  const std::string path = unit.Save(TestRoot(), unit.Layout(false, 4), 4);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(path));
  // layer.w chunks: [0, 12) [12, 24) [24, 36) [36, 40); read [10, 37).
  std::vector<float> out(27);
  SHARDD_ASSERT_OK(reader->ReadElements("layer.w", 10, 37, out.data()));
  for (int i = 0; i < 27; ++i)
    EXPECT_EQ(out[i], unit.Global("layer.w")[10 + i]);
  EXPECT_EQ(reader->data_bytes_read(), 27 * 4);
  SHARDD_ASSERT_OK(reader->ReadElements("layer.w", 5, 5, out.data()));
  EXPECT_EQ(reader->data_bytes_read(), 27 * 4);
  EXPECT_THAT(reader->ReadElements("layer.w", 30, 41, out.data()),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("[0, 40]")));
  EXPECT_THAT(reader->ReadElements("layer.x", 0, 1, out.data()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("layer.x")));
}

TEST(CheckpointReaderTest, VerifyFileCatchesFlipsTruncationAndGrowth) {
  Unit unit;
  const std::string path = unit.Save(TestRoot(), unit.Layout(false, 2), 2);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(path));
  const std::string file = path + "/rank-00001.safetensors";
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string original,
                              ReadFileToString(file, 1 << 20));
  SHARDD_EXPECT_OK(reader->VerifyFile("rank-00001.safetensors"));

  std::string flipped = original;
  flipped[flipped.size() - 3] ^= 0x10;
  SHARDD_ASSERT_OK(WriteStringToFile(file, flipped));
  EXPECT_THAT(reader->VerifyFile("rank-00001.safetensors"),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("rank-00001.safetensors: xxh64")));
  SHARDD_EXPECT_OK(reader->VerifyFile("rank-00000.safetensors"));
  EXPECT_THAT(reader->VerifyAll(), StatusIs(absl::StatusCode::kDataLoss));

  SHARDD_ASSERT_OK(
      WriteStringToFile(file, original.substr(0, original.size() - 4)));
  EXPECT_THAT(reader->VerifyFile("rank-00001.safetensors"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("(truncated)")));
  SHARDD_ASSERT_OK(WriteStringToFile(file, original + "x"));
  EXPECT_THAT(reader->VerifyFile("rank-00001.safetensors"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("(extended)")));

  EXPECT_THAT(reader->VerifyFile("../rank-00001.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(reader->VerifyFile("rank-00009.safetensors"),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST(CheckpointReaderTest, TruncatedDataFileFailsTheRead) {
  Unit unit;
  const std::string path = unit.Save(TestRoot(), unit.Layout(false, 2), 2);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(path));
  const std::string file = path + "/rank-00000.safetensors";
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string original,
                              ReadFileToString(file, 1 << 20));
  ASSERT_EQ(::truncate(file.c_str(), original.size() - 8), 0);
  std::vector<float> out(40);
  EXPECT_THAT(reader->ReadElements("layer.w", 0, 20, out.data()),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("rank-00000.safetensors")));
  // Rank 1's half does not touch the damaged file.
  SHARDD_EXPECT_OK(reader->ReadElements("layer.w", 20, 40, out.data()));
}

TEST(CheckpointReaderTest, IndexAndFileDisagreementIsDataLoss) {
  const std::string root = TestRoot();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string tmp, BeginCheckpoint(root, 1));
  std::vector<float> v = {1, 2, 3, 4};
  const absl::Span<const uint8_t> bytes(
      reinterpret_cast<const uint8_t*>(v.data()), 16);
  SHARDD_ASSERT_OK_AND_ASSIGN(RankFile file,
                              WriteRankFile(tmp, 0,
                                            {{"a", "F32", {4}, 0, 4, bytes},
                                             {"b", "F32", {4}, 0, 4, bytes}}));
  CheckpointIndex index;
  SHARDD_ASSERT_OK(AddRankFile(file, &index));
  // The index claims "a" is BF16 [8] and "b" lives under another name.
  index.tensors["a"].dtype = "BF16";
  index.tensors["a"].shape = {8};
  index.tensors["a"].chunks[0].end = 8;
  index.tensors["b"].chunks[0].tensor = "c";
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string path,
                              CommitCheckpoint(root, tmp, index));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(path));
  std::vector<float> out(8);
  EXPECT_THAT(reader->ReadElements("a", 0, 8, out.data()),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("index records BF16 with 8")));
  EXPECT_THAT(reader->ReadElements("b", 0, 4, out.data()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"c\"")));
}

TEST(CheckpointReaderTest, OpenChecksTheDirectory) {
  const std::string root = TestRoot();
  EXPECT_THAT(CheckpointReader::OpenNamed(root, "../etc"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CheckpointReader::OpenNamed(root, "a/b"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CheckpointReader::OpenNamed(root, "step-00000001"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("not a committed checkpoint")));
  std::filesystem::create_directories(root + "/step-00000002");
  SHARDD_ASSERT_OK(
      WriteStringToFile(root + "/step-00000002/index.json", "{\"format\":1}"));
  EXPECT_THAT(CheckpointReader::OpenNamed(root, "step-00000002"),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("step-00000002: index.json")));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
