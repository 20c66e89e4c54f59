#include "checkpoint/consolidate.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;

std::string Root(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/consolidate_", name);
}

std::vector<float> Iota(int n, float start) {
  std::vector<float> out(n);
  for (int i = 0; i < n; ++i) out[i] = start + static_cast<float>(i);
  return out;
}

absl::Span<const uint8_t> Bytes(const std::vector<float>& v, int begin,
                                int end) {
  return absl::Span<const uint8_t>(
      reinterpret_cast<const uint8_t*>(v.data() + begin),
      static_cast<size_t>(end - begin) * sizeof(float));
}

// A checkpoint of step 7 saved by two ranks: "w" [4, 3] as rows 0-1 and
// 2-3, "w/exp_avg" as flat ranges [0, 5) and [5, 12).
std::string SaveTwoRanks(const std::string& root, const std::vector<float>& w,
                         const std::vector<float>& m) {
  absl::StatusOr<std::string> tmp = BeginCheckpoint(root, 7);
  EXPECT_THAT(tmp.status(), IsOk());
  CheckpointIndex index;
  index.step = 7;
  index.data_position = {{"step", 7}};
  index.saved_by.strategy = "megatron_fsdp";
  index.saved_by.world_size = 2;
  index.saved_by.mesh = {{"dp_shard", 2}};
  const std::vector<int64_t> shape = {4, 3};
  const std::vector<RankTensor> rank0 = {
      {"w", "F32", shape, 0, 6, Bytes(w, 0, 6)},
      {"w/exp_avg", "F32", shape, 0, 5, Bytes(m, 0, 5)}};
  const std::vector<RankTensor> rank1 = {
      {"w", "F32", shape, 6, 12, Bytes(w, 6, 12)},
      {"w/exp_avg", "F32", shape, 5, 12, Bytes(m, 5, 12)}};
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<RankFile> file =
        WriteRankFile(*tmp, rank, rank == 0 ? rank0 : rank1);
    EXPECT_THAT(file.status(), IsOk());
    EXPECT_THAT(AddRankFile(*file, &index), IsOk());
  }
  absl::StatusOr<std::string> dir = CommitCheckpoint(root, *tmp, index);
  EXPECT_THAT(dir.status(), IsOk());
  return dir.ok() ? *dir : "";
}

TEST(ConsolidateTest, OneFileHoldsEveryTensorWhole) {
  const std::vector<float> w = Iota(12, 1.0f);
  const std::vector<float> m = Iota(12, 100.0f);
  const std::string source = SaveTwoRanks(Root("src"), w, m);
  ASSERT_FALSE(source.empty());
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string out,
                              ConsolidateCheckpoint(source, Root("out")));
  EXPECT_EQ(out, Root("out") + "/step-00000007");

  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                              CheckpointReader::Open(out));
  EXPECT_THAT(reader->VerifyAll(), IsOk());
  const CheckpointIndex& index = reader->index();
  EXPECT_EQ(index.step, 7);
  EXPECT_EQ(index.data_position.at("step"), 7);
  EXPECT_EQ(index.saved_by.world_size, 1);
  EXPECT_EQ(index.saved_by.strategy, "consolidated");
  ASSERT_EQ(index.files.size(), 1u);
  for (const auto& [name, record] : index.tensors) {
    ASSERT_EQ(record.chunks.size(), 1u) << name;
    EXPECT_EQ(record.chunks[0].begin, 0);
    EXPECT_EQ(record.chunks[0].end, 12);
  }
  std::vector<float> got(12);
  ASSERT_THAT(reader->ReadElements("w", 0, 12, got.data()), IsOk());
  EXPECT_EQ(got, w);
  ASSERT_THAT(reader->ReadElements("w/exp_avg", 0, 12, got.data()), IsOk());
  EXPECT_EQ(got, m);

  // The step exists there now.
  EXPECT_THAT(ConsolidateCheckpoint(source, Root("out")).status(),
              StatusIs(absl::StatusCode::kAlreadyExists));
}

TEST(ConsolidateTest, ACorruptedSourceIsRefusedNamingTheFile) {
  const std::vector<float> w = Iota(12, 1.0f);
  const std::vector<float> m = Iota(12, 100.0f);
  const std::string source = SaveTwoRanks(Root("bad"), w, m);
  ASSERT_FALSE(source.empty());
  const std::string file = source + "/" + RankFileName(1);
  {
    std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(io.is_open());
    io.seekg(-3, std::ios::end);
    char byte = 0;
    io.read(&byte, 1);
    byte = static_cast<char>(byte ^ 1);
    io.seekp(-3, std::ios::end);
    io.write(&byte, 1);
  }
  EXPECT_THAT(
      ConsolidateCheckpoint(source, Root("bad_out")).status(),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr(RankFileName(1))));
  EXPECT_THAT(ConsolidateCheckpoint(Root("none"), Root("none_out")).status(),
              StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
