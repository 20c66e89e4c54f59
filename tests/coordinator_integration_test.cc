// End-to-end tests of the coordinator: (a) a server in this process called
// through the generated stubs and CoordinatorClient; (b) the real
// shardd-coordinator and shardctl binaries as subprocesses. Loopback only;
// every wait is bounded.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "client/plan_printer.h"
#include "common/grpc_status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpc/grpc.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/coordinator.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "server/coordinator_server.h"
#include "server/coordinator_service.h"
#include "planner/strategy_registry.h"
#include "tests/subprocess.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::SizeIs;
using ::testing::StartsWith;
using testing_util::Spawn;
using testing_util::TempDir;
using testing_util::WaitFor;
using testing_util::WaitForPortFile;
using HealthResponse = ::grpc::health::v1::HealthCheckResponse;

constexpr char kMixtral[] = "tests/data/mixtral_8x7b.json";
constexpr char kDiffusionGemma[] = "tests/data/diffusion_gemma_26b.json";
constexpr char kTinyMoe[] = "tests/data/tiny_moe.json";
constexpr char kCoordinatorBinary[] = "server/shardd-coordinator";
constexpr char kShardctlBinary[] = "client/shardctl";

std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

// ---------------------------------------------------------------------------
// (a) In-process server.

class InProcessCoordinatorTest : public ::testing::Test {
 protected:
  // Holds one gRPC library reference for the rest of the process. Without
  // it, every teardown drops the last channel/server and runs gRPC's library
  // shutdown, which in gRPC 1.51 sometimes stalls ~10 s after the 16 MiB
  // request below (compare grpc/grpc#41050).
  static void SetUpTestSuite() { grpc_init(); }

  void SetUp() override {
    registry_ = StrategyRegistry::CreateWithBuiltins();
    service_ = std::make_unique<CoordinatorService>(registry_.get());
    CoordinatorServerOptions options;
    options.listen_address = "127.0.0.1:0";
    SHARDD_ASSERT_OK_AND_ASSIGN(
        server_, CoordinatorServer::Start(options, service_.get()));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        client_,
        CoordinatorClient::Connect(server_->address(), absl::Seconds(10)));
    client_->set_call_timeout(absl::Seconds(30));
    stub_ = v1::Coordinator::NewStub(client_->channel());
  }

  void TearDown() override {
    // Clients first, then the server (it drains calls into the service),
    // then the service.
    stub_.reset();
    client_.reset();
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
    server_.reset();
    service_.reset();
  }

  std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(In(absl::Seconds(10)));
    return context;
  }

  v1::SubmitModelRequest HfRequest(const std::string& path, int dp) {
    v1::SubmitModelRequest request;
    request.set_hf_config_json(ReadFileOrDie(path));
    request.mutable_options()->mutable_mesh()->set_dp_shard(dp);
    request.mutable_options()->mutable_mesh()->set_dp_replicate(1);
    return request;
  }

  std::unique_ptr<StrategyRegistry> registry_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<CoordinatorClient> client_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(InProcessCoordinatorTest, HealthServiceAnswersServing) {
  SHARDD_ASSERT_OK_AND_ASSIGN(HealthResponse::ServingStatus serving,
                              client_->CheckHealth(""));
  EXPECT_EQ(serving, HealthResponse::SERVING);
  EXPECT_THAT(client_->CheckHealth("no.such.Service"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

// Lists services through the reflection protocol, speaking its wire format
// by hand (Debian ships no reflection .proto): request field 7
// (list_services), response field 6 (list_services_response) holding
// repeated field 1 (service) messages whose field 1 is the name.
std::vector<std::string> ReflectedServices(
    const std::shared_ptr<grpc::Channel>& channel) {
  std::vector<std::string> names;
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(10)));
  auto call = stub.PrepareCall(
      &context,
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto step = [&cq](intptr_t expected) {
    void* tag = nullptr;
    bool ok = false;
    const auto result = cq.AsyncNext(&tag, &ok, In(absl::Seconds(10)));
    return result == grpc::CompletionQueue::GOT_EVENT &&
           reinterpret_cast<intptr_t>(tag) == expected && ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  EXPECT_TRUE(step(1));
  const std::string request("\x3a\x01*", 3);
  grpc::Slice slice(request);
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  EXPECT_TRUE(step(2));
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(3));
  const bool read_ok = step(3);
  EXPECT_TRUE(read_ok);
  call->WritesDone(reinterpret_cast<void*>(4));
  step(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  EXPECT_TRUE(status.ok()) << status.error_message();
  if (!read_ok) return names;

  std::vector<grpc::Slice> slices;
  in.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  google::protobuf::UnknownFieldSet response;
  EXPECT_TRUE(response.ParseFromString(bytes));
  for (int i = 0; i < response.field_count(); ++i) {
    const auto& field = response.field(i);
    if (field.number() != 6 ||
        field.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) {
      continue;
    }
    google::protobuf::UnknownFieldSet list;
    EXPECT_TRUE(list.ParseFromString(field.length_delimited()));
    for (int j = 0; j < list.field_count(); ++j) {
      if (list.field(j).number() != 1) continue;
      google::protobuf::UnknownFieldSet service;
      EXPECT_TRUE(service.ParseFromString(list.field(j).length_delimited()));
      for (int k = 0; k < service.field_count(); ++k) {
        if (service.field(k).number() == 1) {
          names.push_back(service.field(k).length_delimited());
        }
      }
    }
  }
  return names;
}

TEST_F(InProcessCoordinatorTest, ReflectionListsTheServices) {
  const std::vector<std::string> names = ReflectedServices(client_->channel());
  EXPECT_THAT(names, Contains("shardd.v1.Coordinator"));
  EXPECT_THAT(names, Contains("grpc.health.v1.Health"));
}

TEST_F(InProcessCoordinatorTest, ImplementedRpcsWork) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ListStrategiesResponse strategies,
                              client_->ListStrategies());
  std::vector<std::string> names;
  for (const auto& s : strategies.strategies()) names.push_back(s.name());
  EXPECT_THAT(names, Contains("default"));
  EXPECT_THAT(names, Contains("diffusion_gemma"));
  EXPECT_THAT(strategies.supported_architectures(),
              Contains("MixtralForCausalLM"));

  v1::SubmitModelRequest request = HfRequest(kMixtral, 8);
  request.set_name("mixtral");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::SubmitModelResponse submitted,
                              client_->SubmitModel(request));
  EXPECT_THAT(submitted.model_id(), StartsWith("m-"));
  // Mixtral-8x7B is published as 46.7B parameters.
  EXPECT_GT(submitted.summary().total_params(), 46'650'000'000);
  EXPECT_LT(submitted.summary().total_params(), 46'750'000'000);
  EXPECT_EQ(submitted.plan().world_size(), 8);
  EXPECT_EQ(submitted.plan().units_size(), 32 + 1);

  // The same model again: the same id.
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::SubmitModelResponse again,
                              client_->SubmitModel(request));
  EXPECT_EQ(again.model_id(), submitted.model_id());

  v1::GetPlanRequest get;
  get.set_model_id(submitted.model_id());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::GetPlanResponse stored,
                              client_->GetPlan(get));
  EXPECT_EQ(stored.plan().SerializeAsString(),
            submitted.plan().SerializeAsString());

  get.set_replan(true);
  get.mutable_options()->mutable_mesh()->set_dp_shard(16);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::GetPlanResponse replanned,
                              client_->GetPlan(get));
  EXPECT_EQ(replanned.plan().world_size(), 16);

  SHARDD_ASSERT_OK_AND_ASSIGN(v1::GetStatusResponse status,
                              client_->GetStatus());
  EXPECT_EQ(status.coordinator_incarnation(), service_->incarnation());
  EXPECT_GE(status.uptime_ms(), 0);
  ASSERT_THAT(status.models(), SizeIs(1));
  EXPECT_EQ(status.models(0).model_id(), submitted.model_id());
  EXPECT_EQ(status.models(0).name(), "mixtral");
  EXPECT_EQ(status.models(0).world_size(), 8);
  EXPECT_THAT(status.workers(), SizeIs(0));
}

TEST_F(InProcessCoordinatorTest, BadInputIsInvalidArgumentNamingTheField) {
  v1::SubmitModelRequest malformed;
  malformed.set_hf_config_json("{\"architectures\": [");
  EXPECT_THAT(client_->SubmitModel(malformed),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("malformed JSON")));

  v1::SubmitModelRequest unknown_arch;
  unknown_arch.set_hf_config_json(
      R"({"architectures": ["NoSuchForCausalLM"]})");
  EXPECT_THAT(client_->SubmitModel(unknown_arch),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("architectures"),
                             HasSubstr("MixtralForCausalLM"))));

  EXPECT_THAT(
      client_->SubmitModel(HfRequest(kMixtral, 0)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dp_shard")));

  v1::SubmitModelRequest bad_strategy = HfRequest(kMixtral, 8);
  bad_strategy.mutable_options()->set_strategy("no_such_strategy");
  EXPECT_THAT(
      client_->SubmitModel(bad_strategy),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("strategy"), HasSubstr("no_such_strategy"))));

  EXPECT_THAT(
      client_->SubmitModel(v1::SubmitModelRequest()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("source")));

  v1::GetPlanRequest unknown;
  unknown.set_model_id("m-ffffffffffffffff");
  EXPECT_THAT(
      client_->GetPlan(unknown),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("m-ffffffffffffffff")));

  // Past the 16 MiB model limit but under the 32 MiB message limit: the
  // service refuses it by size before parsing.
  v1::SubmitModelRequest huge;
  huge.set_hf_config_json(std::string((size_t{16} << 20) + 1, ' '));
  EXPECT_THAT(client_->SubmitModel(huge),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("hf_config_json")));
}

TEST_F(InProcessCoordinatorTest, MembershipAndRendezvousRpcsAnswer) {
  v1::RegisterWorkerRequest join;
  join.set_address("127.0.0.1:1");
  join.set_incarnation(5);
  join.set_requested_rank(-1);
  v1::RegisterWorkerResponse joined;
  grpc::Status status = stub_->RegisterWorker(Context().get(), join, &joined);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(joined.rank(), 0);
  EXPECT_EQ(joined.coordinator_incarnation(), service_->incarnation());
  EXPECT_EQ(joined.heartbeat_interval_ms(), 10000 / 3);  // Default 10 s.

  v1::HeartbeatRequest beat;
  beat.set_rank(0);
  beat.set_incarnation(6);
  v1::HeartbeatResponse beat_response;
  status = stub_->Heartbeat(Context().get(), beat, &beat_response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);

  // A Get that waits is answered by a Put on another call.
  v1::GetRequest get;
  get.set_key("rdv");
  get.set_wait_ms(10000);
  v1::GetResponse got;
  grpc::Status get_status;
  std::thread getter(
      [&] { get_status = stub_->Get(Context().get(), get, &got); });
  absl::SleepFor(absl::Milliseconds(50));
  v1::PutRequest put;
  put.set_key("rdv");
  put.set_value("hello");
  v1::PutResponse put_response;
  status = stub_->Put(Context().get(), put, &put_response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  getter.join();
  ASSERT_TRUE(get_status.ok()) << get_status.error_message();
  EXPECT_EQ(got.value(), "hello");

  // A client deadline shorter than the wait cancels the call, and the
  // server withdraws the wait.
  get.set_key("never");
  grpc::ClientContext short_context;
  short_context.set_deadline(In(absl::Milliseconds(100)));
  status = stub_->Get(&short_context, get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  const absl::Time limit = absl::Now() + absl::Seconds(5);
  while (server_->waiting_calls() > 0 && absl::Now() < limit) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(server_->waiting_calls(), 0u);

  v1::BarrierRequest barrier;
  barrier.set_barrier_id("b");
  barrier.set_participants(1);
  v1::BarrierResponse barrier_response;
  status = stub_->Barrier(Context().get(), barrier, &barrier_response);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(InProcessCoordinatorTest, ShutdownEndsWaitingCallsAtOnce) {
  v1::GetRequest get;
  get.set_key("never");
  get.set_wait_ms(60000);
  v1::GetResponse got;
  grpc::Status get_status;
  std::thread getter(
      [&] { get_status = stub_->Get(Context().get(), get, &got); });
  const absl::Time limit = absl::Now() + absl::Seconds(5);
  while (server_->waiting_calls() == 0 && absl::Now() < limit) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(server_->waiting_calls(), 1u);
  const absl::Time start = absl::Now();
  server_->Shutdown(absl::Seconds(30));
  getter.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(get_status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(InProcessCoordinatorTest, CheckpointRpcsNameWhatIsMissing) {
  {
    v1::SaveCheckpointResponse r;
    const grpc::Status status = stub_->SaveCheckpoint(Context().get(), {}, &r);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("job_id"));
  }
  {
    v1::LoadCheckpointRequest request;
    request.set_job_id("j-1");
    request.set_checkpoint("j-1/step-00000001");
    v1::LoadCheckpointResponse r;
    const grpc::Status status =
        stub_->LoadCheckpoint(Context().get(), request, &r);
    // This coordinator has no checkpoint directory.
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(), HasSubstr("checkpoint"));
  }
  {
    v1::ListCheckpointsResponse r;
    EXPECT_EQ(stub_->ListCheckpoints(Context().get(), {}, &r).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
}

// ---------------------------------------------------------------------------
// (b) Subprocesses.

struct ProcessResult {
  int exit_code = -1;  // -1: did not exit normally (signal or timeout).
  std::string out;
  std::string err;
};

int g_run_counter = 0;

ProcessResult RunProcess(const std::vector<std::string>& argv,
                         absl::Duration timeout = absl::Seconds(60)) {
  const std::string base =
      absl::StrCat(TempDir(), "/run", getpid(), "_", g_run_counter++);
  ProcessResult result;
  const pid_t pid = Spawn(argv, base + ".out", base + ".err");
  EXPECT_GT(pid, 0) << "cannot start " << argv[0];
  if (pid <= 0) return result;
  result.exit_code = WaitFor(pid, timeout);
  if (result.exit_code == -2) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    ADD_FAILURE() << argv[0] << " " << (argv.size() > 1 ? argv[1] : "")
                  << " did not finish within " << timeout;
  }
  result.out = ReadFileOrDie(base + ".out");
  result.err = ReadFileOrDie(base + ".err");
  return result;
}

class SubprocessCoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static int counter = 0;
    data_dir_ = absl::StrCat(TempDir(), "/coordinator_data_", getpid(), "_",
                             ++counter, "/not/yet/created");
    err_path_ = absl::StrCat(TempDir(), "/coordinator_", getpid(), ".err");
    Start();
  }

  // Starts the coordinator on data_dir_ and waits for its port file.
  void Start() {
    reaped_ = false;
    pid_ = Spawn({kCoordinatorBinary, "--listen=127.0.0.1:0",
                  absl::StrCat("--data-dir=", data_dir_)},
                 absl::StrCat(TempDir(), "/coordinator_", getpid(), ".out"),
                 err_path_);
    ASSERT_GT(pid_, 0) << "cannot start " << kCoordinatorBinary;

    // The port file appears once the server listens (written atomically).
    const int port = WaitForPortFile(data_dir_, pid_, absl::Seconds(30));
    ASSERT_GT(port, 0) << "no port file within 30 s (or the coordinator "
                          "exited): "
                       << ReadFileOrDie(err_path_);
    address_ = absl::StrCat("127.0.0.1:", port);
  }

  void TearDown() override {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  ProcessResult Shardctl(std::vector<std::string> args) {
    args.insert(args.begin(), kShardctlBinary);
    return RunProcess(args);
  }

  std::string data_dir_;
  std::string err_path_;
  std::string address_;
  pid_t pid_ = -1;
  bool reaped_ = false;
};

TEST_F(SubprocessCoordinatorTest, ShardctlMatchesInProcessAndStopsOnSigterm) {
  // The banner scripts wait for.
  EXPECT_THAT(ReadFileOrDie(err_path_),
              HasSubstr("shardd-coordinator listening on " + address_));

  // strategies: remote and local print the same.
  ProcessResult remote_strategies =
      Shardctl({"strategies", "--coordinator", address_});
  ASSERT_EQ(remote_strategies.exit_code, 0) << remote_strategies.err;
  ProcessResult local_strategies = Shardctl({"strategies"});
  ASSERT_EQ(local_strategies.exit_code, 0) << local_strategies.err;
  EXPECT_EQ(remote_strategies.out, local_strategies.out);
  EXPECT_THAT(remote_strategies.out, HasSubstr("diffusion_gemma"));

  // plan --json: remote, local and this process agree byte for byte.
  auto registry = StrategyRegistry::CreateWithBuiltins();
  CoordinatorService in_test(registry.get());
  for (const char* config : {kMixtral, kDiffusionGemma}) {
    SCOPED_TRACE(config);
    ProcessResult remote = Shardctl({"plan", "--hf-config", config, "--dp", "8",
                                     "--json", "--coordinator", address_});
    ASSERT_EQ(remote.exit_code, 0) << remote.err;
    ProcessResult local =
        Shardctl({"plan", "--hf-config", config, "--dp", "8", "--json"});
    ASSERT_EQ(local.exit_code, 0) << local.err;
    EXPECT_EQ(remote.out, local.out);

    v1::SubmitModelRequest request;
    request.set_hf_config_json(ReadFileOrDie(config));
    request.mutable_options()->mutable_mesh()->set_dp_shard(8);
    request.mutable_options()->mutable_mesh()->set_dp_replicate(1);
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::SubmitModelResponse direct,
                                in_test.SubmitModel(request));
    // --device-memory is applied by the client: the default here too.
    EXPECT_EQ(remote.out, FormatPlanJson(direct.plan(), &direct.summary(),
                                         kDefaultDeviceMemoryBytes));

    auto json = nlohmann::json::parse(remote.out, nullptr, false);
    ASSERT_FALSE(json.is_discarded());
    EXPECT_EQ(json["world_size"], 8);
    EXPECT_EQ(json["model_id"], direct.model_id());
  }

  // The table form agrees too, and a native spec goes through --model.
  ProcessResult remote_table = Shardctl(
      {"plan", "--model", kTinyMoe, "--dp", "4", "--coordinator", address_});
  ASSERT_EQ(remote_table.exit_code, 0) << remote_table.err;
  ProcessResult local_table =
      Shardctl({"plan", "--model", kTinyMoe, "--dp", "4"});
  ASSERT_EQ(local_table.exit_code, 0) << local_table.err;
  EXPECT_EQ(remote_table.out, local_table.out);
  EXPECT_THAT(remote_table.out, HasSubstr("  fits 80 GiB "));
  // A non-default device size goes through both paths the same way.
  ProcessResult remote_small =
      Shardctl({"plan", "--model", kTinyMoe, "--dp", "4", "--device-memory",
                "1KiB", "--coordinator", address_});
  ASSERT_EQ(remote_small.exit_code, 0) << remote_small.err;
  ProcessResult local_small = Shardctl(
      {"plan", "--model", kTinyMoe, "--dp", "4", "--device-memory", "1KiB"});
  ASSERT_EQ(local_small.exit_code, 0) << local_small.err;
  EXPECT_EQ(remote_small.out, local_small.out);
  EXPECT_THAT(remote_small.out, HasSubstr("  fits 1 KiB "));

  // Errors from the coordinator: exit 1 with the code.
  ProcessResult bad =
      Shardctl({"plan", "--hf-config", kMixtral, "--dp", "8", "--strategy",
                "nope", "--coordinator", address_});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.err, StartsWith("shardctl: INVALID_ARGUMENT: "));
  EXPECT_TRUE(bad.out.empty());

  // status lists the three stored models.
  ProcessResult status =
      Shardctl({"status", "--coordinator", address_, "--json"});
  ASSERT_EQ(status.exit_code, 0) << status.err;
  auto status_json = nlohmann::json::parse(status.out, nullptr, false);
  ASSERT_FALSE(status_json.is_discarded());
  ASSERT_TRUE(status_json["models"].is_array());
  EXPECT_EQ(status_json["models"].size(), 3u);
  ProcessResult status_table = Shardctl({"status", "--coordinator", address_});
  ASSERT_EQ(status_table.exit_code, 0) << status_table.err;
  EXPECT_THAT(status_table.out, HasSubstr("MixtralForCausalLM"));
  EXPECT_THAT(status_table.out, HasSubstr("Models (3)"));

  // SIGTERM: graceful exit 0 within the deadline, port file removed.
  ASSERT_EQ(kill(pid_, SIGTERM), 0);
  const int code = WaitFor(pid_, absl::Seconds(15));
  if (code != -2) reaped_ = true;
  EXPECT_EQ(code, 0) << ReadFileOrDie(err_path_);
  EXPECT_FALSE(std::ifstream(data_dir_ + "/coordinator.port").good());
}

// kill -9 and a restart on the same --data-dir: the stored model and its
// plan are still there (SQLite state store), and a second coordinator on a
// directory in use is refused instead of sharing it.
TEST_F(SubprocessCoordinatorTest, StoredModelsSurviveKillNine) {
  ProcessResult plan = Shardctl({"plan", "--model", kTinyMoe, "--dp", "4",
                                 "--json", "--coordinator", address_});
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  auto plan_json = nlohmann::json::parse(plan.out, nullptr, false);
  ASSERT_FALSE(plan_json.is_discarded());
  const std::string model_id = plan_json["model_id"];

  ProcessResult second = RunProcess({kCoordinatorBinary, "--listen=127.0.0.1:0",
                                     absl::StrCat("--data-dir=", data_dir_)},
                                    absl::Seconds(30));
  EXPECT_EQ(second.exit_code, 1);
  EXPECT_THAT(second.err, HasSubstr("state.db"));

  ASSERT_EQ(kill(pid_, SIGKILL), 0);
  ASSERT_EQ(waitpid(pid_, nullptr, 0), pid_);
  reaped_ = true;
  // The killed process left its port file behind; the restart rewrites it.
  std::remove((data_dir_ + "/coordinator.port").c_str());
  Start();
  if (HasFatalFailure()) return;

  ProcessResult status =
      Shardctl({"status", "--coordinator", address_, "--json"});
  ASSERT_EQ(status.exit_code, 0) << status.err;
  auto status_json = nlohmann::json::parse(status.out, nullptr, false);
  ASSERT_FALSE(status_json.is_discarded());
  ASSERT_EQ(status_json["models"].size(), 1u) << status.out;
  EXPECT_EQ(status_json["models"][0]["model_id"], model_id);
  // The plan is served from the store, identical to the first answer.
  ProcessResult again = Shardctl({"plan", "--model", kTinyMoe, "--dp", "4",
                                  "--json", "--coordinator", address_});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(again.out, plan.out);
}

TEST(CoordinatorBinaryTest, BadFlagsExitWithAMessage) {
  ProcessResult r = RunProcess({kCoordinatorBinary, "--listen=not-an-address"},
                               absl::Seconds(30));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("listen"));
}

}  // namespace
}  // namespace shardd
