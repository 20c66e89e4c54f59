// libFuzzer target for checkpoint index.json parsing: a checkpoint on disk
// is untrusted input (a torn write, a bad copy, a hostile file). Any text
// must give a valid index or DATA_LOSS / UNIMPLEMENTED with a message, never
// a crash; an accepted index serializes and parses back to the same text.
//
// Built two ways: with clang -fsanitize=fuzzer by tools/run_fuzzers.sh, and
// with fuzz_driver_main.cc as the bazel smoke test that replays the corpus.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "checkpoint/checkpoint_index.h"

namespace {

[[noreturn]] void Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "checkpoint_index_fuzzer: %s: %s\n", what,
               status.ToString().c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace ckpt = shardd::checkpoint;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ckpt::CheckpointIndex> index = ckpt::ParseIndex(text);
  if (!index.ok()) {
    const absl::StatusCode code = index.status().code();
    if (code != absl::StatusCode::kDataLoss &&
        code != absl::StatusCode::kUnimplemented) {
      Fail("error other than DATA_LOSS / UNIMPLEMENTED", index.status());
    }
    if (index.status().message().empty()) {
      Fail("error without a message", index.status());
    }
    return 0;
  }
  absl::StatusOr<std::string> serialized = ckpt::SerializeIndex(*index);
  if (!serialized.ok())
    Fail("accepted index does not serialize", serialized.status());
  absl::StatusOr<ckpt::CheckpointIndex> back = ckpt::ParseIndex(*serialized);
  if (!back.ok()) Fail("serialized index does not parse", back.status());
  absl::StatusOr<std::string> again = ckpt::SerializeIndex(*back);
  if (!again.ok() || *again != *serialized) {
    Fail("index round trip changed it", absl::InternalError(*serialized));
  }
  return 0;
}
