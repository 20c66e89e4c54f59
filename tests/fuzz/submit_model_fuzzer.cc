// libFuzzer target for the coordinator's SubmitModel handler, the RPC that
// parses the most client input: a Hugging Face config.json, a native JSON
// spec or a ModelSpec proto, plus plan options. Any input must give either a
// stored model whose plan compiles into a valid step program, or
// INVALID_ARGUMENT / RESOURCE_EXHAUSTED; never a crash, a hang or another
// code.
//
// Input layout: byte 0 picks the source (0: hf_config_json, 1:
// native_spec_json, 2: a serialized ModelSpec), bytes 1-4 the options (dp
// shard, dp replicate, strategy, mixed precision / reshard group /
// microbatches / passes), the rest is the source.
//
// Built two ways: with clang -fsanitize=fuzzer by tools/run_fuzzers.sh, and
// with fuzz_driver_main.cc as the bazel smoke test that replays the corpus.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "proto/coordinator.pb.h"
#include "server/coordinator_service.h"
#include "program/step_program.h"
#include "planner/strategy_registry.h"

namespace {

[[noreturn]] void Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "submit_model_fuzzer: %s: %s\n", what,
               status.ToString().c_str());
  std::abort();
}

constexpr const char* kStrategies[] = {
    "", "default", "diffusion_gemma", "deepseek_v4", "megatron_fsdp", "nope"};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  static const shardd::StrategyRegistry* registry =
      shardd::StrategyRegistry::CreateWithBuiltins().release();
  shardd::CoordinatorServiceOptions options;
  // Small limits so oversized inputs exercise RESOURCE_EXHAUSTED quickly.
  options.max_model_bytes = 1 << 16;
  options.max_stored_bytes = size_t{64} << 20;
  shardd::CoordinatorService service(registry, options);

  shardd::v1::SubmitModelRequest request;
  const std::string source(reinterpret_cast<const char*>(data) + 5, size - 5);
  switch (data[0] % 3) {
    case 0:
      request.set_hf_config_json(source);
      break;
    case 1:
      request.set_native_spec_json(source);
      break;
    default:
      if (!request.mutable_spec()->ParseFromString(source)) return 0;
      break;
  }
  shardd::v1::PlanOptions* plan_options = request.mutable_options();
  // dp in [0, 64]: 0 is a bad value the handler must name.
  plan_options->mutable_mesh()->set_dp_shard(data[1] % 65);
  plan_options->mutable_mesh()->set_dp_replicate(1 + data[2] % 3);
  plan_options->set_strategy(kStrategies[data[3] % 6]);
  plan_options->set_mixed_precision((data[4] & 1) != 0);
  if ((data[4] & 2) != 0) {
    plan_options->mutable_reshard_after_forward()->set_group_size(
        1 + (data[4] >> 5));
  }
  plan_options->set_microbatches(1 + ((data[4] >> 2) & 1));
  plan_options->set_passes(1 + ((data[4] >> 3) & 1));
  plan_options->set_keep_compute_shard((data[4] & 16) != 0);

  absl::StatusOr<shardd::v1::SubmitModelResponse> response =
      service.SubmitModel(request);
  if (!response.ok()) {
    const absl::StatusCode code = response.status().code();
    if (code != absl::StatusCode::kInvalidArgument &&
        code != absl::StatusCode::kResourceExhausted) {
      Fail("error other than INVALID_ARGUMENT / RESOURCE_EXHAUSTED",
           response.status());
    }
    if (response.status().message().empty()) {
      Fail("error without a message", response.status());
    }
    return 0;
  }
  // An accepted model has a plan the workers can run.
  absl::StatusOr<shardd::v1::StepProgram> program =
      shardd::CompileStepProgram(response->plan());
  if (!program.ok()) {
    // A deep model times a big step shape may exceed kMaxProgramCommands;
    // that refusal is the compiler's documented INVALID_ARGUMENT.
    if (program.status().code() == absl::StatusCode::kInvalidArgument &&
        absl::StrContains(program.status().message(), "commands")) {
      return 0;
    }
    Fail("accepted plan does not compile", program.status());
  }
  const absl::Status valid =
      shardd::ValidateStepProgram(response->plan(), *program);
  if (!valid.ok()) Fail("compiled program is invalid", valid);
  // And GetPlan serves it back unchanged.
  shardd::v1::GetPlanRequest get;
  get.set_model_id(response->model_id());
  absl::StatusOr<shardd::v1::GetPlanResponse> stored = service.GetPlan(get);
  if (!stored.ok()) Fail("stored model not found", stored.status());
  if (stored->plan().SerializeAsString() !=
      response->plan().SerializeAsString()) {
    Fail("stored plan differs", absl::InternalError(response->model_id()));
  }
  return 0;
}
