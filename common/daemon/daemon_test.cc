#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/daemon/command_line.h"
#include "common/daemon/port_file.h"
#include "common/daemon/stop_signals.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CommandLineTest, DashesInFlagNamesBecomeUnderscoresAndNothingElse) {
  std::vector<std::string> args = {
      "prog", "--data-dir=/a-b", "--log-json", "-x-y", "plain-arg",
      "--",   "--after-dashes"};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  EXPECT_THAT(NormalizeFlagDashes(static_cast<int>(argv.size()), argv.data()),
              ElementsAre("prog", "--data_dir=/a-b", "--log_json", "-x-y",
                          "plain-arg", "--", "--after-dashes"));
}

TEST(PortFileTest, WritesThePortAtomicallyAndNamesTheFlagOnFailure) {
  const std::string dir = ::testing::TempDir() + "/port_file_test";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/worker.port";
  SHARDD_ASSERT_OK(WritePortFile(path, 43211, "--port-file"));
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "43211");
  // Only the final file is left.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 1);

  EXPECT_THAT(WritePortFile(dir + "/missing/worker.port", 1, "--port-file"),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("--port-file: cannot write")));
}

TEST(StopSignalsTest, ARequestedStopEndsTheWait) {
  BlockStopSignals();
  std::thread requester([] { RequestStop(); });
  EXPECT_EQ(WaitForStopSignal(), SIGTERM);
  requester.join();
}

}  // namespace
}  // namespace shardd
