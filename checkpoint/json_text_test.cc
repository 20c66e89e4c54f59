#include "checkpoint/json_text.h"

#include <string>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::nlohmann::json;
using ::testing::HasSubstr;

TEST(JsonTextTest, ParsesValidJson) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      json v, ParseJsonStrict(R"( {"a": [1, 2], "b": {"c": "d"}}  )", "x",
                              absl::StatusCode::kDataLoss));
  EXPECT_EQ(v["a"][1], 2);
  EXPECT_EQ(v["b"]["c"], "d");
}

TEST(JsonTextTest, SyntaxErrorNamesWhatAndPosition) {
  EXPECT_THAT(ParseJsonStrict(R"({"a": 1,})", "index.json",
                              absl::StatusCode::kDataLoss),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("index.json: malformed JSON at byte")));
  EXPECT_THAT(ParseJsonStrict("{} {}", "h", absl::StatusCode::kInvalidArgument),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseJsonStrict("", "h", absl::StatusCode::kDataLoss),
              StatusIs(absl::StatusCode::kDataLoss));
}

TEST(JsonTextTest, RepeatedKeyIsAnError) {
  EXPECT_THAT(ParseJsonStrict(R"({"a": {"x": 1, "x": 2}})", "h",
                              absl::StatusCode::kDataLoss),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("key \"x\" appears twice")));
  // The same key in sibling objects is fine.
  SHARDD_EXPECT_OK(ParseJsonStrict(R"({"a": {"x": 1}, "b": {"x": 2}})", "h",
                                   absl::StatusCode::kDataLoss));
}

TEST(JsonTextTest, DumpRejectsInvalidUtf8) {
  json v = {{"ok", "fine"}, {"bad", std::string("\xff\xfe")}};
  EXPECT_THAT(DumpJson(v),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("/bad")));
  json w = {{"name", "ünïcödé"}};
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string text, DumpJson(w));
  EXPECT_EQ(text, R"({"name":"ünïcödé"})");
}

TEST(JsonTextTest, Utf8Validation) {
  EXPECT_TRUE(IsValidUtf8("plain ascii"));
  EXPECT_TRUE(IsValidUtf8("\xc3\xa9"));           // é
  EXPECT_TRUE(IsValidUtf8("\xf0\x9f\x98\x80"));   // U+1F600
  EXPECT_FALSE(IsValidUtf8("\xc3"));              // Cut short.
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // Overlong '/'.
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // Surrogate.
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // Above U+10FFFF.
}

TEST(JsonTextTest, NonNegativeInts) {
  int64_t v = -1;
  EXPECT_TRUE(GetNonNegativeInt(json(7), &v));
  EXPECT_EQ(v, 7);
  EXPECT_TRUE(GetNonNegativeInt(json::parse("9223372036854775807"), &v));
  EXPECT_EQ(v, INT64_MAX);
  EXPECT_FALSE(GetNonNegativeInt(json::parse("9223372036854775808"), &v));
  EXPECT_FALSE(GetNonNegativeInt(json(-1), &v));
  EXPECT_FALSE(GetNonNegativeInt(json(1.0), &v));
  EXPECT_FALSE(GetNonNegativeInt(json(true), &v));
  EXPECT_FALSE(GetNonNegativeInt(json("3"), &v));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
