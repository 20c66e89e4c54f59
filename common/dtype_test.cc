#include "common/dtype.h"

#include <utility>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

TEST(DTypeTest, BytesAndNames) {
  EXPECT_EQ(DTypeBytes(v1::FLOAT32), 4);
  EXPECT_EQ(DTypeBytes(v1::BFLOAT16), 2);
  EXPECT_EQ(DTypeBytes(v1::FLOAT16), 2);
  EXPECT_EQ(DTypeBytes(v1::FLOAT8_E4M3), 1);
  EXPECT_EQ(DTypeBytes(v1::INT32), 4);
  EXPECT_EQ(DTypeBytes(v1::INT64), 8);
  EXPECT_EQ(DTypeBytes(v1::DTYPE_UNSPECIFIED), 0);
  for (v1::DType d : {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16, v1::FLOAT8_E4M3,
                      v1::INT32, v1::INT64}) {
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::DType back, ParseDType(DTypeName(d)));
    EXPECT_EQ(back, d) << DTypeName(d);
  }
}

TEST(DTypeTest, Aliases) {
  const std::pair<const char*, v1::DType> cases[] = {
      {"fp32", v1::FLOAT32},
      {"F32", v1::FLOAT32},
      {"float", v1::FLOAT32},
      {"torch.float32", v1::FLOAT32},
      {"BF16", v1::BFLOAT16},
      {"torch.bfloat16", v1::BFLOAT16},
      {"half", v1::FLOAT16},
      {"fp16", v1::FLOAT16},
      {"float8_e4m3fn", v1::FLOAT8_E4M3},
      {"int64", v1::INT64},
  };
  for (const auto& [name, want] : cases) {
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::DType got, ParseDType(name));
    EXPECT_EQ(got, want) << name;
  }
}

TEST(DTypeTest, UnknownNamesAllowedValues) {
  EXPECT_THAT(ParseDType("float128"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("allowed: float32, bfloat16")));
  EXPECT_THAT(ParseDType(""), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("unknown dtype")));
}

}  // namespace
}  // namespace shardd
