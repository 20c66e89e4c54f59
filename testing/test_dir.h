#ifndef SHARDD_TESTING_TEST_DIR_H_
#define SHARDD_TESTING_TEST_DIR_H_

// A fresh, empty directory for the running test: $TEST_TMPDIR (or /tmp)
// / <test name, '/' of parameterized names as '_'> [/ sub], removed and
// created again on each call.

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"

namespace shardd {
namespace testing_util {

inline std::string FreshTestDir(absl::string_view sub = "") {
  std::string test =
      ::testing::UnitTest::GetInstance()->current_test_info()->name();
  for (char& c : test) {
    if (c == '/') c = '_';
  }
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", test);
  if (!sub.empty()) absl::StrAppend(&dir, "/", sub);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir, ec);
  EXPECT_FALSE(ec) << "cannot create " << dir << ": " << ec.message();
  return dir;
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_TEST_DIR_H_
