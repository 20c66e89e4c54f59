#include "checkpoint/checkpoint_writer.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/file_util.h"
#include "checkpoint/safetensors.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A fresh root directory per test.
std::string TestRoot() {
  const std::string root = absl::StrCat(
      getenv("TEST_TMPDIR"), "/",
      ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(root);
  return root;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

absl::Span<const uint8_t> Bytes(const std::vector<float>& v, int64_t begin,
                                int64_t end) {
  return absl::Span<const uint8_t>(
      reinterpret_cast<const uint8_t*>(v.data() + begin),
      (end - begin) * sizeof(float));
}

// A [6, 2] F32 parameter (values 0..11) and its exp_avg (100..111), saved by
// two ranks in dim-0 halves.
struct TwoRankSave {
  std::vector<float> param, exp_avg;
  TwoRankSave() {
    for (int i = 0; i < 12; ++i) {
      param.push_back(i);
      exp_avg.push_back(100 + i);
    }
  }
  std::vector<RankTensor> Rank(int r) const {
    const int64_t b = r * 6, e = b + 6;
    return {{"w", "F32", {6, 2}, b, e, Bytes(param, b, e)},
            {"w/exp_avg", "F32", {6, 2}, b, e, Bytes(exp_avg, b, e)}};
  }
  // Begin, write both ranks, build the index; returns the tmp dir.
  std::string Write(const std::string& root, int64_t step,
                    CheckpointIndex* index) const {
    absl::StatusOr<std::string> tmp = BeginCheckpoint(root, step);
    EXPECT_THAT(tmp, IsOk());
    index->step = step;
    index->data_position = {{"samples", step * 32}};
    index->saved_by = {"fsdp2", 2, {{"dp_shard", 2}}};
    for (int r = 0; r < 2; ++r) {
      absl::StatusOr<RankFile> file = WriteRankFile(*tmp, r, Rank(r));
      EXPECT_THAT(file, IsOk());
      EXPECT_THAT(AddRankFile(*file, index), IsOk());
    }
    return *tmp;
  }
};

TEST(CheckpointWriterTest, Names) {
  EXPECT_EQ(RankFileName(3), "rank-00003.safetensors");
  EXPECT_EQ(RankFileName(123456), "rank-123456.safetensors");
  EXPECT_EQ(CheckpointDirName(123), "step-00000123");
}

TEST(CheckpointWriterTest, RankFileHoldsThePiecesAndReportsChunks) {
  const std::string root = TestRoot();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string tmp, BeginCheckpoint(root, 5));
  EXPECT_TRUE(absl::StartsWith(tmp, root + "/.tmp-step-5-")) << tmp;
  std::vector<float> values(40);
  for (int i = 0; i < 40; ++i) values[i] = i * 0.25f;
  // Rows 2..4 of [10, 4]; two unaligned pieces of "flat"; an empty piece.
  const std::vector<RankTensor> pieces = {
      {"w", "F32", {10, 4}, 8, 20, Bytes(values, 8, 20)},
      {"flat", "F32", {40}, 3, 9, Bytes(values, 3, 9)},
      {"flat", "F32", {40}, 30, 31, Bytes(values, 30, 31)},
      {"pad", "F32", {2, 4}, 8, 8, {}},
  };
  SHARDD_ASSERT_OK_AND_ASSIGN(RankFile file, WriteRankFile(tmp, 3, pieces));
  EXPECT_EQ(file.file.name, "rank-00003.safetensors");
  ASSERT_EQ(file.chunks.size(), 3u);
  EXPECT_EQ(file.chunks[0].tensor, "w");
  EXPECT_EQ(file.chunks[0].chunk.tensor, "w");
  EXPECT_EQ(file.chunks[0].chunk.begin, 8);
  EXPECT_EQ(file.chunks[0].chunk.end, 20);
  EXPECT_EQ(file.chunks[1].chunk.tensor, "flat@3");
  EXPECT_EQ(file.chunks[2].chunk.tensor, "flat@30");

  const std::string path = tmp + "/rank-00003.safetensors";
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, SafetensorsReader::Open(path));
  EXPECT_EQ(reader->file_size(), file.file.size_bytes);
  EXPECT_EQ(reader->metadata().at("rank"), "3");
  EXPECT_THAT(reader->Find("w")->shape, ElementsAre(3, 4));  // Whole rows.
  EXPECT_THAT(reader->Find("flat@3")->shape, ElementsAre(6));
  EXPECT_EQ(reader->Find("pad"), nullptr);
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> w,
                              reader->ReadTensor(*reader->Find("w")));
  EXPECT_EQ(0, memcmp(w.data(), values.data() + 8, 12 * sizeof(float)));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string contents,
                              ReadFileToString(path, 1 << 20));
  Xxh64Hasher hasher;
  hasher.Update(contents.data(), contents.size());
  EXPECT_EQ(file.file.xxh64, hasher.Digest());
}

TEST(CheckpointWriterTest, RankFileRejectsBadPieces) {
  const std::string root = TestRoot();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string tmp, BeginCheckpoint(root, 1));
  std::vector<float> v(8);
  EXPECT_THAT(WriteRankFile(tmp, -1, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
  EXPECT_THAT(
      WriteRankFile(tmp, 0, {{"w", "F32", {8}, 4, 9, Bytes(v, 0, 5)}}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("tensor \"w\" [4, 9): range must lie within [0, 8]")));
  EXPECT_THAT(WriteRankFile(tmp, 0, {{"w", "F32", {8}, 0, 4, Bytes(v, 0, 3)}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("12 bytes given")));
  EXPECT_THAT(WriteRankFile(tmp, 0,
                            {{"w", "F32", {8}, 0, 4, Bytes(v, 0, 4)},
                             {"w", "F32", {8}, 3, 5, Bytes(v, 3, 5)}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("overlaps piece [0, 4)")));
  EXPECT_THAT(WriteRankFile(tmp, 0,
                            {{"w", "F32", {8}, 0, 4, Bytes(v, 0, 4)},
                             {"w", "F32", {4, 2}, 4, 8, Bytes(v, 4, 8)}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("differs from another piece")));
  EXPECT_THAT(WriteRankFile(tmp, 0, {{"w", "f32", {8}, 0, 8, Bytes(v, 0, 8)}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("f32")));
  EXPECT_THAT(WriteRankFile(root + "/missing", 0, {}),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST(CheckpointWriterTest, AddRankFileChecksAgreement) {
  RankFile a{{"rank-00000.safetensors", 10, 1},
             {{"w", "F32", {4}, {"rank-00000.safetensors", "w", 0, 2}}}};
  RankFile b{{"rank-00001.safetensors", 10, 2},
             {{"w", "BF16", {4}, {"rank-00001.safetensors", "w", 2, 4}}}};
  CheckpointIndex index;
  SHARDD_ASSERT_OK(AddRankFile(a, &index));
  EXPECT_THAT(AddRankFile(a, &index),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("already in the index")));
  EXPECT_THAT(
      AddRankFile(b, &index),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("tensor \"w\": rank-00001.safetensors has BF16")));
  EXPECT_EQ(index.files.size(), 1u);  // The failed add changed nothing.
}

TEST(CheckpointWriterTest, CommitMakesTheCheckpointVisible) {
  const std::string root = TestRoot();
  TwoRankSave save;
  CheckpointIndex index;
  const std::string tmp = save.Write(root, 7, &index);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto before, ListCheckpoints(root));
  EXPECT_TRUE(before.empty());
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string path,
                              CommitCheckpoint(root, tmp, index));
  EXPECT_EQ(path, root + "/step-00000007");
  EXPECT_FALSE(Exists(tmp));
  EXPECT_TRUE(Exists(path + "/index.json"));
  EXPECT_TRUE(Exists(path + "/rank-00001.safetensors"));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto list, ListCheckpoints(root));
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].name, "step-00000007");
  EXPECT_EQ(list[0].path, path);
  EXPECT_EQ(list[0].step, 7);

  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(path));
  EXPECT_EQ(reader->index().step, 7);
  EXPECT_EQ(reader->index().data_position.at("samples"), 224);
  EXPECT_EQ(reader->index().saved_by.strategy, "fsdp2");
  SHARDD_EXPECT_OK(reader->VerifyAll());
  std::vector<float> m(12);
  SHARDD_ASSERT_OK(reader->ReadElements("w/exp_avg", 0, 12, m.data()));
  EXPECT_EQ(m, save.exp_avg);

  // The same step again is refused; the committed one is untouched.
  CheckpointIndex again;
  const std::string tmp2 = save.Write(root, 7, &again);
  EXPECT_THAT(CommitCheckpoint(root, tmp2, again),
              StatusIs(absl::StatusCode::kAlreadyExists));
  SHARDD_EXPECT_OK(CheckpointReader::Open(path));
}

TEST(CheckpointWriterTest, CommitRefusesIncompleteOrForeignSaves) {
  const std::string root = TestRoot();
  TwoRankSave save;
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string tmp, BeginCheckpoint(root, 3));
  CheckpointIndex index;
  index.step = 3;
  // Only rank 0 reported: half of every tensor is in no chunk.
  SHARDD_ASSERT_OK_AND_ASSIGN(RankFile r0, WriteRankFile(tmp, 0, save.Rank(0)));
  SHARDD_ASSERT_OK(AddRankFile(r0, &index));
  EXPECT_THAT(CommitCheckpoint(root, tmp, index),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("elements [6, 12) are in no chunk")));
  // Rank 1's record without its file.
  RankFile r1{{"rank-00001.safetensors", 100, 0}, {}};
  for (const RankTensor& t : save.Rank(1)) {
    r1.chunks.push_back({t.name,
                         t.dtype,
                         t.global_shape,
                         {r1.file.name, t.name, t.begin, t.end}});
  }
  SHARDD_ASSERT_OK(AddRankFile(r1, &index));
  EXPECT_THAT(CommitCheckpoint(root, tmp, index),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("rank-00001.safetensors")));
  // Directories that are not this root's temporaries.
  EXPECT_THAT(CommitCheckpoint(root, root + "/step-00000003", index),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CommitCheckpoint(root, root + "/.tmp-x/../../elsewhere", index),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CommitCheckpoint(root, "/tmp/.tmp-step-3-abc", index),
              StatusIs(absl::StatusCode::kInvalidArgument));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto list, ListCheckpoints(root));
  EXPECT_TRUE(list.empty());
}

TEST(CheckpointWriterTest, CrashBeforeCommitLeavesThePreviousCheckpoint) {
  const std::string root = TestRoot();
  TwoRankSave save;
  CheckpointIndex first;
  SHARDD_ASSERT_OK(
      CommitCheckpoint(root, save.Write(root, 100, &first), first).status());
  // A save that dies after writing its files, and one that dies while
  // writing index.json (a torn index in the temporary directory).
  CheckpointIndex second;
  save.Write(root, 200, &second);
  CheckpointIndex third;
  const std::string torn = save.Write(root, 300, &third);
  SHARDD_ASSERT_OK(
      WriteStringToFile(torn + "/index.json", "{\"format\": \"sh"));

  SHARDD_ASSERT_OK_AND_ASSIGN(auto list, ListCheckpoints(root));
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].step, 100);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader,
                              CheckpointReader::Open(list[0].path));
  SHARDD_EXPECT_OK(reader->VerifyAll());
  std::vector<float> w(12);
  SHARDD_ASSERT_OK(reader->ReadElements("w", 0, 12, w.data()));
  EXPECT_EQ(w, save.param);

  SHARDD_ASSERT_OK_AND_ASSIGN(int removed, RemoveStaleTemporaries(root));
  EXPECT_EQ(removed, 2);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(root),
                          std::filesystem::directory_iterator()),
            1);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto after, ListCheckpoints(root));
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].step, 100);
}

TEST(CheckpointWriterTest, ListIsNewestFirstAndSkipsInvalidDirectories) {
  const std::string root = TestRoot();
  SHARDD_ASSERT_OK_AND_ASSIGN(auto none, ListCheckpoints(root));
  EXPECT_TRUE(none.empty());  // Missing root.
  TwoRankSave save;
  for (int64_t step : {20, 3, 100}) {
    CheckpointIndex index;
    SHARDD_ASSERT_OK(
        CommitCheckpoint(root, save.Write(root, step, &index), index).status());
  }
  // A step directory whose index is corrupt, one whose index names another
  // step, and unrelated entries.
  std::filesystem::create_directory(root + "/step-00000500");
  SHARDD_ASSERT_OK(WriteStringToFile(root + "/step-00000500/index.json", "{}"));
  std::filesystem::copy(root + "/step-00000020", root + "/step-00000021",
                        std::filesystem::copy_options::recursive);
  std::filesystem::create_directory(root + "/other");
  SHARDD_ASSERT_OK(WriteStringToFile(root + "/step-00000999", "not a dir"));

  SHARDD_ASSERT_OK_AND_ASSIGN(auto list, ListCheckpoints(root));
  std::vector<int64_t> steps;
  for (const CheckpointInfo& c : list) steps.push_back(c.step);
  EXPECT_THAT(steps, ElementsAre(100, 20, 3));
}

TEST(CheckpointWriterTest, BeginRejectsBadArguments) {
  EXPECT_THAT(BeginCheckpoint("", 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(BeginCheckpoint(TestRoot(), -1),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
