#include "worker/data/token_file.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace data {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/", name);
}

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = TempPath(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  return path;
}

// Little-endian encodings spelled out byte by byte, independent of the host.
std::string U16(std::initializer_list<uint32_t> ids) {
  std::string bytes;
  for (uint32_t id : ids) {
    bytes.push_back(static_cast<char>(id & 0xff));
    bytes.push_back(static_cast<char>((id >> 8) & 0xff));
  }
  return bytes;
}

std::string U32(std::initializer_list<uint32_t> ids) {
  std::string bytes;
  for (uint32_t id : ids) {
    for (int shift = 0; shift < 32; shift += 8) {
      bytes.push_back(static_cast<char>((id >> shift) & 0xff));
    }
  }
  return bytes;
}

std::vector<int32_t> ReadAll(const TokenFile& file) {
  std::vector<int32_t> out(file.num_tokens());
  EXPECT_THAT(file.Read(0, absl::MakeSpan(out)), IsOk());
  return out;
}

TEST(TokenFormatTest, ParsesAndInfers) {
  EXPECT_EQ(*ParseTokenFormat("u16"), TokenFormat::kUint16);
  EXPECT_EQ(*ParseTokenFormat("UINT32"), TokenFormat::kUint32);
  EXPECT_EQ(*ParseTokenFormat("text"), TokenFormat::kBytes);
  EXPECT_EQ(*ParseTokenFormat("auto"), TokenFormat::kAuto);
  EXPECT_THAT(ParseTokenFormat("int8"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("token format must be one of")));
  EXPECT_EQ(*InferTokenFormat("/d/train.bin"), TokenFormat::kUint16);
  EXPECT_EQ(*InferTokenFormat("/d/train.u16"), TokenFormat::kUint16);
  EXPECT_EQ(*InferTokenFormat("/d/train.U32"), TokenFormat::kUint32);
  EXPECT_EQ(*InferTokenFormat("/d/shakespeare.txt"), TokenFormat::kBytes);
  EXPECT_THAT(
      InferTokenFormat("/d/train.dat"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("/d/train.dat")));
  EXPECT_EQ(TokenWidth(TokenFormat::kUint16), 2);
  EXPECT_EQ(TokenWidth(TokenFormat::kUint32), 4);
  EXPECT_EQ(TokenWidth(TokenFormat::kBytes), 1);
}

TEST(TokenFileTest, ReadsUint16LittleEndian) {
  const std::string path = WriteFile("a.u16", U16({1, 258, 65535, 0, 300}));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto file, TokenFile::Open(path, {}));
  EXPECT_EQ(file->format(), TokenFormat::kUint16);
  EXPECT_EQ(file->num_tokens(), 5);
  EXPECT_EQ(file->vocab_size(), 65536);
  EXPECT_THAT(ReadAll(*file), ::testing::ElementsAre(1, 258, 65535, 0, 300));
  EXPECT_EQ(file->Token(1), 258u);
  std::vector<int32_t> window(2);
  SHARDD_ASSERT_OK(file->Read(3, absl::MakeSpan(window)));
  EXPECT_THAT(window, ::testing::ElementsAre(0, 300));
}

TEST(TokenFileTest, BinIsUint16) {
  const std::string path = WriteFile("train.bin", U16({7, 8, 9}));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto file, TokenFile::Open(path, {}));
  EXPECT_THAT(ReadAll(*file), ::testing::ElementsAre(7, 8, 9));
}

TEST(TokenFileTest, ReadsUint32) {
  const std::string path =
      WriteFile("b.u32", U32({70000, 1, 99999, 65536, 16777217}));
  TokenFileOptions options;
  options.vocab_size = 20000000;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto file, TokenFile::Open(path, options));
  EXPECT_EQ(file->format(), TokenFormat::kUint32);
  EXPECT_THAT(ReadAll(*file),
              ::testing::ElementsAre(70000, 1, 99999, 65536, 16777217));
}

TEST(TokenFileTest, ExplicitFormatOverridesName) {
  const std::string path = WriteFile("c.data", U32({5, 6}));
  TokenFileOptions options;
  options.format = TokenFormat::kUint32;
  options.vocab_size = 10;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto file, TokenFile::Open(path, options));
  EXPECT_THAT(ReadAll(*file), ::testing::ElementsAre(5, 6));
  // The same 8 bytes as uint16 are four tokens.
  options.format = TokenFormat::kUint16;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto as16, TokenFile::Open(path, options));
  EXPECT_THAT(ReadAll(*as16), ::testing::ElementsAre(5, 0, 6, 0));
}

TEST(TokenFileTest, ReadsTextAsBytes) {
  const std::string path = WriteFile("d.txt", "hi\n\xff");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto file, TokenFile::Open(path, {}));
  EXPECT_EQ(file->vocab_size(), 256);
  EXPECT_THAT(ReadAll(*file), ::testing::ElementsAre('h', 'i', '\n', 255));
}

TEST(TokenFileTest, RejectsSizeNotMultipleOfWidth) {
  const std::string path16 = WriteFile("odd.u16", "abc");
  EXPECT_THAT(TokenFile::Open(path16, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr(path16),
                                        HasSubstr("not a multiple"))));
  const std::string path32 = WriteFile("odd.u32", "abcdef");
  TokenFileOptions options;
  options.vocab_size = 100;
  EXPECT_THAT(
      TokenFile::Open(path32, options),
      StatusIs(absl::StatusCode::kInvalidArgument,
               ::testing::AllOf(HasSubstr(path32), HasSubstr("width 4"))));
}

TEST(TokenFileTest, RejectsEmptyMissingAndUnnamedFiles) {
  const std::string empty = WriteFile("empty.u16", "");
  EXPECT_THAT(
      TokenFile::Open(empty, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is empty")));
  EXPECT_THAT(TokenFile::Open(TempPath("missing.u16"), {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.u16")));
  EXPECT_THAT(
      TokenFile::Open(::testing::TempDir() + "/x.txt/..", {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot infer")));
  TokenFileOptions options;
  options.format = TokenFormat::kBytes;
  EXPECT_THAT(TokenFile::Open(::testing::TempDir(), options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a regular file")));
}

TEST(TokenFileTest, ValidatesVocabSizeOption) {
  const std::string path = WriteFile("v.u32", U32({1}));
  EXPECT_THAT(TokenFile::Open(path, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("vocab_size is required")));
  TokenFileOptions options;
  options.vocab_size = -1;
  EXPECT_THAT(TokenFile::Open(path, options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("vocab_size must be in")));
}

TEST(TokenFileTest, UpfrontCheckNamesOffsetAndValue) {
  // Token 3 (byte offset 6) is 500, above the model's 256.
  const std::string path = WriteFile("oov.u16", U16({1, 2, 3, 500, 4}));
  TokenFileOptions options;
  options.vocab_size = 256;
  EXPECT_THAT(
      TokenFile::Open(path, options),
      StatusIs(absl::StatusCode::kInvalidArgument,
               ::testing::AllOf(HasSubstr("token id 500"),
                                HasSubstr("token offset 3"),
                                HasSubstr("byte offset 6"),
                                HasSubstr("vocab_size 256"), HasSubstr(path))));
  options.vocab_check = VocabCheck::kUpfront;
  EXPECT_FALSE(TokenFile::Open(path, options).ok());
}

TEST(TokenFileTest, LazyCheckFailsOnlyOnWindowsWithBadIds) {
  const std::string path = WriteFile("lazy.u16", U16({1, 2, 3, 500, 4}));
  TokenFileOptions options;
  options.vocab_size = 256;
  options.vocab_check = VocabCheck::kLazy;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto file, TokenFile::Open(path, options));
  EXPECT_FALSE(file->checked_upfront());
  std::vector<int32_t> window(3);
  SHARDD_EXPECT_OK(file->Read(0, absl::MakeSpan(window)));
  EXPECT_THAT(window, ::testing::ElementsAre(1, 2, 3));
  EXPECT_THAT(file->Read(1, absl::MakeSpan(window)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("token id 500"),
                                        HasSubstr("token offset 3"))));
}

TEST(TokenFileTest, TextAboveSmallVocabIsRejected) {
  const std::string path = WriteFile("small.txt", "abc");
  TokenFileOptions options;
  options.vocab_size = 98;  // 'a' = 97 fits, 'b' = 98 does not.
  EXPECT_THAT(TokenFile::Open(path, options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("token id 98 at token offset 1")));
}

TEST(TokenFileTest, ReadOutsideFileIsOutOfRange) {
  const std::string path = WriteFile("short.u16", U16({1, 2, 3}));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto file, TokenFile::Open(path, {}));
  std::vector<int32_t> window(2);
  EXPECT_THAT(file->Read(2, absl::MakeSpan(window)),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("window")));
  EXPECT_THAT(file->Read(-1, absl::MakeSpan(window)),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("[-1, 1)")));
}

// Whether /proc/self/maps lists a mapping of a file called `name` (the
// kernel prints the canonical path, so match the last component).
bool IsMapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::stringstream contents;
  contents << maps.rdbuf();
  return contents.str().find("/" + name + "\n") != std::string::npos;
}

TEST(TokenFileTest, UnmapsOnDestruction) {
  const std::string path = WriteFile("mapped.u16", U16({1, 2, 3, 4}));
  {
    SHARDD_ASSERT_OK_AND_ASSIGN(auto file, TokenFile::Open(path, {}));
    EXPECT_TRUE(IsMapped("mapped.u16"));
  }
  EXPECT_FALSE(IsMapped("mapped.u16"));
}

std::string Sequential(int n) {
  std::string bytes;
  for (int i = 0; i < n; ++i) {
    bytes.push_back(static_cast<char>(i & 0xff));
    bytes.push_back(static_cast<char>((i >> 8) & 0xff));
  }
  return bytes;
}

TEST(TokenFileSourceTest, RandomOffsetsAreDeterministicAndRandomAccess) {
  // Token i is i, so a window's first token is its offset.
  const int n = 1000;
  const std::string path = WriteFile("seq.u16", Sequential(n));
  TokenSourceOptions source_options;
  source_options.seed = 17;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source,
                              TokenFileSource::Open(path, {}, source_options));
  const int length = 33;
  std::vector<std::vector<int32_t>> run(500, std::vector<int32_t>(length));
  std::set<int32_t> starts;
  for (int k = 0; k < 500; ++k) {
    SHARDD_ASSERT_OK(source->Fill(k, absl::MakeSpan(run[k])));
    SHARDD_ASSERT_OK_AND_ASSIGN(int64_t offset, source->Offset(k, length));
    ASSERT_GE(offset, 0);
    ASSERT_LE(offset, n - length);
    for (int t = 0; t < length; ++t) ASSERT_EQ(run[k][t], offset + t);
    starts.insert(run[k][0]);
  }
  // 500 draws over 968 offsets: ~370 distinct expected; a constant or
  // strided offset would give far fewer or a regular pattern.
  EXPECT_GT(starts.size(), 300u);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto again,
                              TokenFileSource::Open(path, {}, source_options));
  EXPECT_EQ(again->Fingerprint(), source->Fingerprint());
  std::vector<int32_t> alone(length);
  for (int k : {499, 3, 250}) {
    SHARDD_ASSERT_OK(again->Fill(k, absl::MakeSpan(alone)));
    EXPECT_EQ(alone, run[k]);
  }
  source_options.seed = 18;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto other,
                              TokenFileSource::Open(path, {}, source_options));
  EXPECT_NE(other->Fingerprint(), source->Fingerprint());
  int same = 0;
  for (int k = 0; k < 50; ++k) {
    same += *other->Offset(k, length) == *source->Offset(k, length);
  }
  EXPECT_LT(same, 5);
}

TEST(TokenFileSourceTest, StridedOffsetsWalkTheFile) {
  // N = 10, L = 4: stride 3, windows (10 - 4) / 3 + 1 = 3 at 0, 3, 6; the
  // last target of one window is the first input of the next.
  const std::string path = WriteFile("strided.u16", Sequential(10));
  TokenSourceOptions options;
  options.offsets = OffsetMode::kStrided;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source,
                              TokenFileSource::Open(path, {}, options));
  std::vector<int64_t> offsets;
  for (int k = 0; k < 7; ++k) offsets.push_back(*source->Offset(k, 4));
  EXPECT_THAT(offsets, ::testing::ElementsAre(0, 3, 6, 0, 3, 6, 0));
  std::vector<int32_t> window(4);
  SHARDD_ASSERT_OK(source->Fill(2, absl::MakeSpan(window)));
  EXPECT_THAT(window, ::testing::ElementsAre(6, 7, 8, 9));
  EXPECT_THAT(source->Describe(), HasSubstr("offsets=strided"));
}

TEST(TokenFileSourceTest, RejectsSequencesLongerThanTheFile) {
  const std::string path = WriteFile("tiny.u16", Sequential(5));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source, TokenFileSource::Open(path, {}, {}));
  std::vector<int32_t> six(6);
  EXPECT_THAT(
      source->Fill(0, absl::MakeSpan(six)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               ::testing::AllOf(HasSubstr(path), HasSubstr("5 tokens"))));
  std::vector<int32_t> five(5);
  SHARDD_ASSERT_OK(source->Fill(9, absl::MakeSpan(five)));
  EXPECT_THAT(five, ::testing::ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(source->Fill(-1, absl::MakeSpan(five)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sequence index")));
}

TEST(TokenFileSourceTest, LazyVocabErrorSurfacesFromFill) {
  const std::string path = WriteFile("bad_at_end.u16", U16({1, 2, 3, 4, 900}));
  TokenFileOptions file_options;
  file_options.vocab_size = 256;
  file_options.vocab_check = VocabCheck::kLazy;
  TokenSourceOptions options;
  options.offsets = OffsetMode::kStrided;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto source, TokenFileSource::Open(path, file_options, options));
  EXPECT_EQ(source->vocab_size(), 256);
  std::vector<int32_t> window(3);  // Windows at 0 and 2.
  SHARDD_EXPECT_OK(source->Fill(0, absl::MakeSpan(window)));
  EXPECT_THAT(source->Fill(1, absl::MakeSpan(window)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("token id 900"),
                                        HasSubstr("token offset 4"))));
}

TEST(TokenFileSourceTest, FingerprintFollowsContent) {
  const std::string a = WriteFile("fa.u16", U16({1, 2, 3}));
  const std::string b = WriteFile("fb.u16", U16({1, 2, 4}));
  const std::string c = WriteFile("fc.u16", U16({1, 2, 3}));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto fa, TokenFile::Open(a, {}));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto fb, TokenFile::Open(b, {}));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto fc, TokenFile::Open(c, {}));
  EXPECT_NE(fa->fingerprint(), fb->fingerprint());
  EXPECT_EQ(fa->fingerprint(), fc->fingerprint());
}

}  // namespace
}  // namespace data
}  // namespace shardd
