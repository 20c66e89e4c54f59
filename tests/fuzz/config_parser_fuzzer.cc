// libFuzzer target for the model-description parsers: any byte string must
// give either a valid spec or INVALID_ARGUMENT, never a crash, and every
// accepted spec must survive a native-format round trip unchanged.
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
#include "google/protobuf/util/message_differencer.h"
#include "proto/model.pb.h"
#include "model/hf_config.h"
#include "model/model_util.h"
#include "model/native_spec.h"

namespace {

[[noreturn]] void Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "config_parser_fuzzer: %s: %s\n", what,
               status.ToString().c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<shardd::v1::ModelSpec> spec = shardd::ModelSpecFromJson(text);
  if (!spec.ok()) {
    if (spec.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail("error other than INVALID_ARGUMENT", spec.status());
    }
    return 0;
  }
  // Accepted specs are valid, summarize without overflow and round-trip.
  const absl::Status valid = shardd::ValidateModelSpec(*spec);
  if (!valid.ok()) Fail("accepted spec fails validation", valid);
  const shardd::v1::ModelSummary summary = shardd::Summarize(*spec);
  if (summary.total_params() < 0 || summary.active_params() < 0 ||
      summary.expert_params() > summary.total_params() ||
      summary.trainable_params() > summary.total_params()) {
    Fail("inconsistent summary",
         absl::InternalError(summary.ShortDebugString()));
  }
  const std::string native = shardd::ModelSpecToNativeJson(*spec);
  absl::StatusOr<shardd::v1::ModelSpec> back =
      shardd::ModelSpecFromNativeJson(native);
  if (!back.ok()) Fail("native round trip rejected", back.status());
  // The native format describes the model, not where it came from.
  shardd::v1::ModelSpec expected = *spec;
  expected.clear_hf_config_json();
  if (!google::protobuf::util::MessageDifferencer::Equals(expected, *back)) {
    Fail("native round trip changed the spec", absl::InternalError(native));
  }
  return 0;
}
