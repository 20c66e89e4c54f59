#include "checkpoint/file_util.h"

#include <stdlib.h>

#include <string>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;

std::string TmpPath(const std::string& name) {
  return std::string(getenv("TEST_TMPDIR")) + "/" + name;
}

TEST(FileUtilTest, WriteThenReadBack) {
  const std::string path = TmpPath("hello.txt");
  SHARDD_ASSERT_OK(WriteStringToFile(path, "hello, world"));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string text, ReadFileToString(path, 100));
  EXPECT_EQ(text, "hello, world");
  EXPECT_THAT(
      ReadFileToString(path, 5),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("12 bytes")));
}

TEST(FileUtilTest, MissingFileIsNotFoundAndNamesThePath) {
  EXPECT_THAT(ReadFileToString(TmpPath("nope"), 100),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
}

TEST(FileUtilTest, PreadPastTheEndIsDataLoss) {
  const std::string path = TmpPath("short.bin");
  SHARDD_ASSERT_OK(WriteStringToFile(path, "0123456789"));
  SHARDD_ASSERT_OK_AND_ASSIGN(ScopedFd fd, OpenForRead(path));
  char buf[8];
  SHARDD_ASSERT_OK(PreadFully(fd.get(), 2, 8, buf, path));
  EXPECT_EQ(std::string(buf, 8), "23456789");
  EXPECT_THAT(PreadFully(fd.get(), 4, 8, buf, path),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
  SHARDD_ASSERT_OK_AND_ASSIGN(int64_t size, FileSize(fd.get(), path));
  EXPECT_EQ(size, 10);
}

TEST(FileUtilTest, Xxh64MatchesReferenceValuesAndStreams) {
  // Published XXH64 values, seed 0.
  Xxh64Hasher empty;
  EXPECT_EQ(empty.Digest(), 0xef46db3751d8e999ULL);
  Xxh64Hasher abc;
  abc.Update("a", 1);
  abc.Update("bc", 2);
  EXPECT_EQ(abc.Digest(), 0x44bc2cf5ad770999ULL);
}

TEST(FileUtilTest, Xxh64HexRoundTrip) {
  EXPECT_EQ(Xxh64Hex(0xef46db3751d8e999ULL), "ef46db3751d8e999");
  EXPECT_EQ(Xxh64Hex(1), "0000000000000001");
  uint64_t v = 0;
  EXPECT_TRUE(ParseXxh64Hex("EF46db3751d8e999", &v));
  EXPECT_EQ(v, 0xef46db3751d8e999ULL);
  EXPECT_FALSE(ParseXxh64Hex("ef46db3751d8e99", &v));   // 15 digits.
  EXPECT_FALSE(ParseXxh64Hex("ef46db3751d8e99g", &v));  // Not hex.
  EXPECT_FALSE(ParseXxh64Hex("", &v));
}

TEST(FileUtilTest, PlainNames) {
  EXPECT_TRUE(IsPlainName("rank-00000.safetensors"));
  EXPECT_TRUE(IsPlainName("step-00000012"));
  EXPECT_TRUE(IsPlainName(".tmp-step-3-abc"));
  EXPECT_FALSE(IsPlainName(""));
  EXPECT_FALSE(IsPlainName("."));
  EXPECT_FALSE(IsPlainName(".."));
  EXPECT_FALSE(IsPlainName("a/b"));
  EXPECT_FALSE(IsPlainName("/etc"));
  EXPECT_FALSE(IsPlainName("x..y"));
  EXPECT_FALSE(IsPlainName(std::string("a\0b", 3)));
}

TEST(FileUtilTest, SyncDirNeedsADirectory) {
  SHARDD_EXPECT_OK(SyncDir(getenv("TEST_TMPDIR")));
  EXPECT_THAT(SyncDir(TmpPath("missing-dir")),
              StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
