#include "checkpoint/checkpoint_index.h"

#include <string>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;

// A [10, 4] F32 parameter cut in dim-0 rows 0-2 | 3-5 | 6-9 over three
// files, and its exp_avg as two flat ranges.
CheckpointIndex SampleIndex() {
  CheckpointIndex index;
  index.step = 123;
  index.data_position = {{"step", 123}, {"samples", 7872}, {"offset", -5}};
  index.saved_by = {"fsdp2", 3, {{"dp_shard", 3}, {"dp_replicate", 1}}};
  for (int r = 0; r < 3; ++r) {
    index.files.push_back({"rank-0000" + std::to_string(r) + ".safetensors",
                           1000 + r, 0xfedcba9876543210ULL + r});
  }
  TensorRecord& w = index.tensors["model.layers.0.w"];
  w.dtype = "F32";
  w.shape = {10, 4};
  // Out of order on purpose: validation sorts.
  w.chunks = {{"rank-00002.safetensors", "model.layers.0.w", 24, 40},
              {"rank-00000.safetensors", "model.layers.0.w", 0, 12},
              {"rank-00001.safetensors", "model.layers.0.w", 12, 24}};
  TensorRecord& m = index.tensors["model.layers.0.w/exp_avg"];
  m.dtype = "F32";
  m.shape = {10, 4};
  m.chunks = {{"rank-00000.safetensors", "model.layers.0.w/exp_avg", 0, 17},
              {"rank-00001.safetensors", "model.layers.0.w/exp_avg", 17, 40}};
  TensorRecord& empty = index.tensors["empty"];
  empty.dtype = "BF16";
  empty.shape = {0, 8};
  return index;
}

TEST(CheckpointIndexTest, SerializeParseRoundTrip) {
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string text, SerializeIndex(SampleIndex()));
  EXPECT_THAT(text, HasSubstr("\"xxh64\": \"fedcba9876543210\""));
  SHARDD_ASSERT_OK_AND_ASSIGN(CheckpointIndex back, ParseIndex(text));
  CheckpointIndex expected = SampleIndex();
  SHARDD_ASSERT_OK(ValidateIndex(&expected));  // Sorts the chunks.
  EXPECT_EQ(back.format_version, kIndexFormatVersion);
  EXPECT_EQ(back.step, 123);
  EXPECT_EQ(back.data_position, expected.data_position);
  EXPECT_EQ(back.saved_by.strategy, "fsdp2");
  EXPECT_EQ(back.saved_by.world_size, 3);
  EXPECT_EQ(back.saved_by.mesh, expected.saved_by.mesh);
  ASSERT_EQ(back.files.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back.files[i].name, expected.files[i].name);
    EXPECT_EQ(back.files[i].size_bytes, expected.files[i].size_bytes);
    EXPECT_EQ(back.files[i].xxh64, expected.files[i].xxh64);
  }
  ASSERT_EQ(back.tensors.size(), expected.tensors.size());
  for (const auto& [name, t] : expected.tensors) {
    const TensorRecord& b = back.tensors.at(name);
    EXPECT_EQ(b.dtype, t.dtype);
    EXPECT_EQ(b.shape, t.shape);
    ASSERT_EQ(b.chunks.size(), t.chunks.size()) << name;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      EXPECT_EQ(b.chunks[i].file, t.chunks[i].file);
      EXPECT_EQ(b.chunks[i].tensor, t.chunks[i].tensor);
      EXPECT_EQ(b.chunks[i].begin, t.chunks[i].begin);
      EXPECT_EQ(b.chunks[i].end, t.chunks[i].end);
    }
  }
  EXPECT_EQ(back.tensors.at("model.layers.0.w").chunks[0].begin, 0);
}

TEST(CheckpointIndexTest, TheModelTravelsAsOneObject) {
  CheckpointIndex index = SampleIndex();
  index.model_spec_json = R"({"architecture":"MixtralForCausalLM","dims":{"vocab_size":"64"}})";
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string text, SerializeIndex(index));
  SHARDD_ASSERT_OK_AND_ASSIGN(CheckpointIndex back, ParseIndex(text));
  EXPECT_EQ(back.model_spec_json, index.model_spec_json);
  // Absent: empty.
  SHARDD_ASSERT_OK_AND_ASSIGN(text, SerializeIndex(SampleIndex()));
  EXPECT_EQ(text.find("\"model\""), std::string::npos);
  SHARDD_ASSERT_OK_AND_ASSIGN(back, ParseIndex(text));
  EXPECT_TRUE(back.model_spec_json.empty());
  index.model_spec_json = "[1, 2]";
  EXPECT_THAT(SerializeIndex(index).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model_spec_json")));
  const size_t at = text.find("\"files\"");
  ASSERT_NE(at, std::string::npos);
  text.insert(at, "\"model\": 7, ");
  EXPECT_THAT(ParseIndex(text), StatusIs(absl::StatusCode::kDataLoss,
                                         HasSubstr("index.json.model")));
}

TEST(CheckpointIndexTest, TheTrainConfigTravelsAsOneObject) {
  CheckpointIndex index = SampleIndex();
  // Keys in the order the writer prints them (sorted).
  index.train_config_json =
      R"({"decay_steps":"6","lr":0.01,"lr_schedule":"cosine","warmup_steps":2})";
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string text, SerializeIndex(index));
  SHARDD_ASSERT_OK_AND_ASSIGN(CheckpointIndex back, ParseIndex(text));
  EXPECT_EQ(back.train_config_json, index.train_config_json);
  // Absent: empty.
  SHARDD_ASSERT_OK_AND_ASSIGN(text, SerializeIndex(SampleIndex()));
  EXPECT_EQ(text.find("\"train\""), std::string::npos);
  SHARDD_ASSERT_OK_AND_ASSIGN(back, ParseIndex(text));
  EXPECT_TRUE(back.train_config_json.empty());
  index.train_config_json = "\"cosine\"";
  EXPECT_THAT(SerializeIndex(index).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train_config_json")));
  const size_t at = text.find("\"files\"");
  ASSERT_NE(at, std::string::npos);
  text.insert(at, "\"train\": [], ");
  EXPECT_THAT(ParseIndex(text), StatusIs(absl::StatusCode::kDataLoss,
                                         HasSubstr("index.json.train")));
}

TEST(CheckpointIndexTest, OverlappingChunksAreRejected) {
  CheckpointIndex index = SampleIndex();
  index.tensors["model.layers.0.w"].chunks[0].begin = 23;
  EXPECT_THAT(ValidateIndex(&index),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor \"model.layers.0.w\": chunk [23, 40) "
                                 "in \"rank-00002.safetensors\" overlaps")));
}

TEST(CheckpointIndexTest, GapsAndShortCoverageAreRejected) {
  CheckpointIndex gap = SampleIndex();
  gap.tensors["model.layers.0.w"].chunks[2].begin = 13;
  EXPECT_THAT(ValidateIndex(&gap),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("elements [12, 13) are in no chunk")));
  CheckpointIndex tail = SampleIndex();
  tail.tensors["model.layers.0.w/exp_avg"].chunks.pop_back();
  EXPECT_THAT(ValidateIndex(&tail),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor \"model.layers.0.w/exp_avg\": "
                                 "elements [17, 40) are in no chunk")));
}

TEST(CheckpointIndexTest, ChunkFieldsAreChecked) {
  CheckpointIndex past = SampleIndex();
  past.tensors["model.layers.0.w"].chunks[0].end = 41;
  EXPECT_THAT(ValidateIndex(&past),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("0 <= begin < end <= numel (40)")));
  CheckpointIndex empty = SampleIndex();
  empty.tensors["model.layers.0.w"].chunks[0].end = 24;  // [24, 24).
  EXPECT_THAT(ValidateIndex(&empty),
              StatusIs(absl::StatusCode::kInvalidArgument));
  CheckpointIndex unlisted = SampleIndex();
  unlisted.tensors["model.layers.0.w"].chunks[1].file =
      "rank-00009.safetensors";
  EXPECT_THAT(ValidateIndex(&unlisted),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("file not in the index's files")));
  CheckpointIndex dtype = SampleIndex();
  dtype.tensors["empty"].dtype = "float32";
  EXPECT_THAT(ValidateIndex(&dtype),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor \"empty\": dtype \"float32\"")));
}

TEST(CheckpointIndexTest, FileNamesAreConfined) {
  for (const char* bad :
       {"../rank-00000.safetensors", "a/b", "..", "", "index.json"}) {
    CheckpointIndex index = SampleIndex();
    index.files.push_back({bad, 1, 1});
    EXPECT_THAT(ValidateIndex(&index),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("plain file name")))
        << bad;
  }
  CheckpointIndex twice = SampleIndex();
  twice.files.push_back(twice.files[0]);
  EXPECT_THAT(
      ValidateIndex(&twice),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listed twice")));
}

TEST(CheckpointIndexTest, ParseNamesTheBadField) {
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string good, SerializeIndex(SampleIndex()));
  auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) text.replace(at, from.size(), to);
    return text;
  };
  // Top-level fields are indented by one space.
  EXPECT_THAT(ParseIndex(with("\n \"step\": 123", "\n \"step\": -1")),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("index.json.step: must be a non-negative")));
  EXPECT_THAT(ParseIndex(with("\n \"step\": 123", "\n \"steps\": 123")),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("unknown field \"steps\"")));
  EXPECT_THAT(
      ParseIndex(with("\"xxh64\": \"fedcba9876543210\"", "\"xxh64\": \"xyz\"")),
      StatusIs(absl::StatusCode::kDataLoss,
               HasSubstr("index.json.files[0].xxh64")));
  EXPECT_THAT(ParseIndex(with("\"begin\": 12", "\"begin\": 11")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("overlaps")));
  EXPECT_THAT(
      ParseIndex(with("\"format_version\": 1", "\"format_version\": 2")),
      StatusIs(absl::StatusCode::kUnimplemented));
  EXPECT_THAT(
      ParseIndex(with("shardd-checkpoint", "other")),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("index.json.format")));
  EXPECT_THAT(ParseIndex(good.substr(0, good.size() / 2)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("malformed")));
  EXPECT_THAT(ParseIndex(with("\"samples\": 7872", "\"samples\": \"7872\"")),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("index.json.data_position[\"samples\"]")));
}

TEST(CheckpointIndexTest, RowsToElements) {
  SHARDD_ASSERT_OK_AND_ASSIGN(ElementRange r, RowsToElements({10, 3, 2}, 2, 5));
  EXPECT_EQ(r.begin, 12);
  EXPECT_EQ(r.end, 30);
  EXPECT_THAT(RowsToElements({10, 3}, 4, 11),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(RowsToElements({}, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
