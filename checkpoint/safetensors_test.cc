#include "checkpoint/safetensors.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "checkpoint/file_util.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A path unique to the running test.
std::string TmpPath(const std::string& name) {
  std::string test =
      ::testing::UnitTest::GetInstance()->current_test_info()->name();
  for (char& c : test) {
    if (c == '/') c = '_';
  }
  return absl::StrCat(getenv("TEST_TMPDIR"), "/", test, "-", name);
}

template <typename T>
absl::Span<const uint8_t> Bytes(const std::vector<T>& v) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()),
                                   v.size() * sizeof(T));
}

template <typename T>
std::vector<T> Iota(int64_t n, T start) {
  std::vector<T> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<T>(start + i);
  return v;
}

// A file with the given header text (unpadded) and `data_size` data bytes.
std::string RawFile(const std::string& name, const std::string& header,
                    int64_t data_size) {
  std::string contents(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) contents[i] = static_cast<char>(n >> (8 * i));
  contents += header;
  contents.append(data_size, '\x5a');
  const std::string path = TmpPath(name);
  EXPECT_THAT(WriteStringToFile(path, contents), IsOk());
  return path;
}

TEST(SafetensorsTest, RoundTripKeepsDTypesShapesBytesAndMetadata) {
  const std::vector<float> f32 = Iota<float>(24, 0.5f);
  const std::vector<uint16_t> bf16 = Iota<uint16_t>(6, 0x3f80);
  const std::vector<int64_t> i64 = {-1, int64_t{1} << 40, 7};
  const std::vector<int32_t> scalar = {42};
  const std::vector<TensorView> tensors = {
      {"model.layers.0.w", "F32", {2, 3, 4}, Bytes(f32)},
      {"b", "BF16", {6}, Bytes(bf16)},
      {"steps", "I64", {3}, Bytes(i64)},
      {"scalar", "I32", {}, Bytes(scalar)},
      {"empty", "F16", {0, 5}, {}},
  };
  const std::string path = TmpPath("t.safetensors");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      FileDigest digest, WriteSafetensors(path, tensors, {{"format", "pt"}}));

  // The digest is the size and XXH64 of the bytes on disk.
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string contents,
                              ReadFileToString(path, 1 << 20));
  EXPECT_EQ(digest.size_bytes, static_cast<int64_t>(contents.size()));
  Xxh64Hasher hasher;
  hasher.Update(contents.data(), contents.size());
  EXPECT_EQ(digest.xxh64, hasher.Digest());

  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, SafetensorsReader::Open(path));
  EXPECT_EQ(reader->header().data_start % 8, 0);
  EXPECT_EQ(reader->file_size(), digest.size_bytes);
  EXPECT_EQ(reader->metadata().at("format"), "pt");
  ASSERT_EQ(reader->tensors().size(), tensors.size());
  for (const TensorView& t : tensors) {
    const SafetensorsEntry* e = reader->Find(t.name);
    ASSERT_NE(e, nullptr) << t.name;
    EXPECT_EQ(e->dtype, t.dtype);
    EXPECT_EQ(e->shape, t.shape);
    SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> data,
                                reader->ReadTensor(*e));
    EXPECT_EQ(data, std::vector<uint8_t>(t.bytes.begin(), t.bytes.end()))
        << t.name;
  }
  EXPECT_EQ(reader->Find("missing"), nullptr);
  // Data in the given order, back to back.
  EXPECT_EQ(reader->Find("model.layers.0.w")->data_begin, 0);
  EXPECT_EQ(reader->Find("b")->data_begin, 96);
}

TEST(SafetensorsTest, ReadBytesReadsOnlyTheRangeAsked) {
  const std::vector<float> values = Iota<float>(1000, 0.0f);
  const std::string path = TmpPath("r.safetensors");
  SHARDD_ASSERT_OK(
      WriteSafetensors(path, {{"x", "F32", {10, 100}, Bytes(values)}})
          .status());
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, SafetensorsReader::Open(path));
  const SafetensorsEntry& x = *reader->Find("x");
  std::vector<float> out(5);
  SHARDD_ASSERT_OK(reader->ReadBytes(x, 4 * 321, 4 * 5, out.data()));
  EXPECT_EQ(out, std::vector<float>({321, 322, 323, 324, 325}));
  EXPECT_EQ(reader->data_bytes_read(), 20);
  EXPECT_THAT(reader->ReadBytes(x, 3996, 8, out.data()),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("\"x\"")));
  EXPECT_THAT(reader->ReadBytes(x, -4, 4, out.data()),
              StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_EQ(reader->data_bytes_read(), 20);
}

TEST(SafetensorsTest, AcceptsUnpaddedHeaderAndUnorderedEntries) {
  // Any writer may order entries freely and skip the padding.
  const std::string path =
      RawFile("u.safetensors",
              R"({"b":{"dtype":"U8","shape":[3],"data_offsets":[2,5]},)"
              R"("a":{"dtype":"I16","shape":[1],"data_offsets":[0,2]}})",
              5);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, SafetensorsReader::Open(path));
  ASSERT_EQ(reader->tensors().size(), 2u);
  EXPECT_EQ(reader->tensors()[0].name, "a");
  EXPECT_EQ(reader->tensors()[1].name, "b");
  EXPECT_TRUE(reader->metadata().empty());
}

struct BadHeader {
  std::string label;
  std::string header;
  int64_t data_size;
  std::string message;  // Expected in the error.
};

class BadHeaderTest : public ::testing::TestWithParam<BadHeader> {};

TEST_P(BadHeaderTest, IsDataLossNamingTheField) {
  const BadHeader& p = GetParam();
  const std::string path = RawFile(p.label, p.header, p.data_size);
  EXPECT_THAT(SafetensorsReader::Open(path),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr(p.message))));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, BadHeaderTest,
    ::testing::Values(
        BadHeader{"malformed", R"({"a":{"dtype":"F32",)", 0, "malformed JSON"},
        BadHeader{"not_object", "[1, 2]", 0, "must be a JSON object"},
        BadHeader{"repeated",
                  R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                  R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                  2, "appears twice"},
        BadHeader{"entry_not_object", R"({"a":[1]})", 0,
                  "tensor \"a\": must be an object"},
        BadHeader{"unknown_dtype",
                  R"({"a":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})",
                  4, "tensor \"a\": dtype \"F31\" unknown"},
        BadHeader{"missing_dtype",
                  R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4,
                  "tensor \"a\": dtype must be a string"},
        BadHeader{"extra_field",
                  R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],)"
                  R"("offset":0}})",
                  1, "tensor \"a\": unknown field \"offset\""},
        BadHeader{"negative_dim",
                  R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})",
                  0, "tensor \"a\": shape[0] must be a non-negative integer"},
        BadHeader{"float_dim",
                  R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,0]}})",
                  0, "shape[0]"},
        BadHeader{"shape_overflow",
                  R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],)"
                  R"("data_offsets":[0,0]}})",
                  0, "overflows int64"},
        BadHeader{"offsets_three",
                  R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})",
                  1, "tensor \"a\": data_offsets must be [begin, end]"},
        BadHeader{"offsets_reversed",
                  R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[2,1]}})", 2,
                  "end before begin"},
        BadHeader{"offsets_past_end",
                  R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 3,
                  "past the end of the data section (3 bytes)"},
        BadHeader{"size_mismatch",
                  R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})",
                  4, "hold 4 bytes, shape [2] of F32 needs 8"},
        BadHeader{"overlap",
                  R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})",
                  5, "tensor \"b\": data_offsets [3, 5] overlap tensor \"a\""},
        BadHeader{"gap",
                  R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                  R"("b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})",
                  5, "leave bytes [2, 3) of the data section unowned"},
        BadHeader{"trailing",
                  R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 3,
                  "trailing bytes unowned"},
        BadHeader{"metadata_not_strings", R"({"__metadata__":{"x":1}})", 0,
                  "__metadata__[\"x\"] must be a string"}),
    [](const ::testing::TestParamInfo<BadHeader>& info) {
      return info.param.label;
    });

TEST(SafetensorsTest, BadLengthPrefixIsDataLoss) {
  const std::string tiny = TmpPath("tiny");
  SHARDD_ASSERT_OK(WriteStringToFile(tiny, "abc"));
  EXPECT_THAT(SafetensorsReader::Open(tiny),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("too short")));

  const std::string zero = TmpPath("zero");
  SHARDD_ASSERT_OK(WriteStringToFile(zero, std::string(16, '\0')));
  EXPECT_THAT(
      SafetensorsReader::Open(zero),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("must be in [1,")));

  const std::string past = TmpPath("past");
  std::string contents(8, '\0');
  contents[0] = 100;  // 100-byte header, 4 bytes present.
  contents += "{}  ";
  SHARDD_ASSERT_OK(WriteStringToFile(past, contents));
  EXPECT_THAT(
      SafetensorsReader::Open(past),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("runs past the end")));
}

TEST(SafetensorsTest, TruncatedFileIsDataLoss) {
  const std::vector<float> values = Iota<float>(64, 1.0f);
  const std::string path = TmpPath("t.safetensors");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      FileDigest digest,
      WriteSafetensors(path, {{"x", "F32", {64}, Bytes(values)}}));
  // Truncated before opening: the header no longer fits the data.
  ASSERT_EQ(::truncate(path.c_str(), digest.size_bytes - 1), 0);
  EXPECT_THAT(SafetensorsReader::Open(path),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("past the end of the data section")));
  // Truncated after opening: the read comes up short.
  ASSERT_EQ(::truncate(path.c_str(), digest.size_bytes), 0);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, SafetensorsReader::Open(path));
  ASSERT_EQ(::truncate(path.c_str(), digest.size_bytes - 16), 0);
  std::vector<float> out(64);
  EXPECT_THAT(reader->ReadBytes(*reader->Find("x"), 0, 256, out.data()),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
}

TEST(SafetensorsTest, WriterRejectsBadTensorsNamingThem) {
  const std::vector<float> four(4);
  const std::string path = TmpPath("bad.safetensors");
  EXPECT_THAT(WriteSafetensors(path, {{"w", "F32", {5}, Bytes(four)}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor \"w\""), HasSubstr("16 given"),
                             HasSubstr("needs 20"))));
  EXPECT_THAT(WriteSafetensors(path, {{"w", "F33", {4}, Bytes(four)}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"F33\""), HasSubstr("BF16"))));
  EXPECT_THAT(
      WriteSafetensors(path, {{"w", "F32", {4}, Bytes(four)},
                              {"w", "F32", {4}, Bytes(four)}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("given twice")));
  EXPECT_THAT(
      WriteSafetensors(path, {{"__metadata__", "F32", {4}, Bytes(four)}}),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(
      WriteSafetensors(path, {{"w", "F32", {-4}, Bytes(four)}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative")));
  EXPECT_THAT(WriteSafetensors(path, {{"\xff", "F32", {4}, Bytes(four)}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("UTF-8")));
}

TEST(SafetensorsTest, DTypeTables) {
  EXPECT_EQ(SafetensorsDTypeBytes("F32"), 4);
  EXPECT_EQ(SafetensorsDTypeBytes("BF16"), 2);
  EXPECT_EQ(SafetensorsDTypeBytes("U16"), 2);
  EXPECT_EQ(SafetensorsDTypeBytes("I64"), 8);
  EXPECT_EQ(SafetensorsDTypeBytes("F8_E4M3"), 1);
  EXPECT_EQ(SafetensorsDTypeBytes("f32"), 0);
  for (v1::DType d : {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16, v1::FLOAT8_E4M3,
                      v1::INT32, v1::INT64}) {
    SHARDD_ASSERT_OK_AND_ASSIGN(std::string tag, SafetensorsDTypeOf(d));
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::DType back, DTypeFromSafetensors(tag));
    EXPECT_EQ(back, d) << tag;
  }
  EXPECT_THAT(SafetensorsDTypeOf(v1::DTYPE_UNSPECIFIED),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DTypeFromSafetensors("U16"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("U16")));
}

TEST(SafetensorsTest, ShapeNumel) {
  EXPECT_EQ(*ShapeNumel({}), 1);
  EXPECT_EQ(*ShapeNumel({2, 3, 4}), 24);
  EXPECT_EQ(*ShapeNumel({2, 0, 4}), 0);
  EXPECT_EQ(*ShapeNumel({2, 3}, 4), 6);
  EXPECT_THAT(
      ShapeNumel({int64_t{1} << 62}, 4),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
