// NcclCommunicator on real GPUs: every test skips without one, and the
// multi-rank test needs at least two (NCCL does not run two ranks on one
// device). The parts that need no GPU are in nccl_communicator_cpu_test.cc.

#include "worker/comm/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "testing/gpu.h"
#include "worker/comm/in_memory_kv_client.h"

namespace shardd {
namespace {

using ::shardd::testing_util::GpuCount;

using ::testing::AllOf;
using ::testing::HasSubstr;

// A device array for tests (synchronous copies are fine here).
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&data_, n * sizeof(T)), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return static_cast<T*>(data_); }
  void Upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), n_);
    ASSERT_EQ(
        cudaMemcpy(data_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice),
        cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    EXPECT_EQ(
        cudaMemcpy(host.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost),
        cudaSuccess);
    return host;
  }

 private:
  size_t n_;
  void* data_ = nullptr;
};

// Blocks a stream in a host function until opened: a producer that never
// finishes, for timeout tests.
struct HostGate {
  std::atomic<bool> open{false};
};

void CUDART_CB WaitForGate(void* data) {
  auto* gate = static_cast<HostGate*>(data);
  while (!gate->open.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::unique_ptr<NcclCommunicator> MakeSingleRank(
    InMemoryKeyValueClient* kv, const std::string& prefix,
    NcclCommunicatorOptions options = {}) {
  options.init_timeout = absl::Seconds(60);
  auto comm = NcclCommunicator::Create(kv, prefix, 0, 1, options);
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? std::move(comm).value() : nullptr;
}

constexpr absl::Duration kTimeout = absl::Seconds(30);

// --- One rank on one GPU. ---------------------------------------------

TEST(NcclCommunicatorGpuTest, CreateOutOfRangeDevice) {
  SHARDD_SKIP_WITHOUT_GPU();
  std::string reason;
  InMemoryKeyValueClient kv;
  NcclCommunicatorOptions options;
  options.device = GpuCount(&reason);
  EXPECT_THAT(NcclCommunicator::Create(&kv, "p", 0, 1, options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("options.device")));
}

TEST(NcclCommunicatorGpuTest, SingleRankAllGatherCopies) {
  SHARDD_SKIP_WITHOUT_GPU();
  InMemoryKeyValueClient kv;
  auto comm = MakeSingleRank(&kv, "t/all_gather");
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_TRUE(
      kv.Get(NcclUniqueIdKey("t/all_gather"), absl::ZeroDuration()).ok());

  constexpr int kCount = 4099;
  std::vector<float> host(kCount);
  for (int i = 0; i < kCount; ++i) host[i] = 0.25f * i - 7.0f;
  DeviceArray<float> input(kCount), output(kCount);
  input.Upload(host);
  SHARDD_ASSERT_OK(comm->AllGather(input.get(), output.get(), kCount,
                                   v1::FLOAT32, kTimeout));
  EXPECT_EQ(output.Download(), host);

  // bf16 moves as bytes; in place (input is this rank's slot).
  std::vector<uint16_t> bf16(kCount);
  for (int i = 0; i < kCount; ++i) bf16[i] = kernels::Fp32ToBf16(host[i]);
  DeviceArray<uint16_t> in_place(kCount);
  in_place.Upload(bf16);
  SHARDD_ASSERT_OK(comm->AllGather(in_place.get(), in_place.get(), kCount,
                                   v1::BFLOAT16, kTimeout));
  EXPECT_EQ(in_place.Download(), bf16);

  const CommunicatorStats stats = comm->stats();
  EXPECT_EQ(stats.all_gather.calls, 2);
  EXPECT_EQ(stats.all_gather.failures, 0);
  EXPECT_EQ(stats.all_gather.bytes, kCount * 4 + kCount * 2);
  EXPECT_GT(stats.all_gather.time, absl::ZeroDuration());
  EXPECT_EQ(comm->host_synchronizations(), 2);
  SHARDD_EXPECT_OK(comm->health());
}

// One rank sends itself its whole piece through a grouped send/recv;
// mismatched self counts are refused before anything is enqueued.
TEST(NcclCommunicatorGpuTest, SingleRankAllToAllVCopiesItsOwnPiece) {
  SHARDD_SKIP_WITHOUT_GPU();
  InMemoryKeyValueClient kv;
  auto comm = MakeSingleRank(&kv, "t/all_to_all");
  ASSERT_NE(comm, nullptr);
  constexpr int kCount = 1031;
  std::vector<float> host(kCount);
  for (int i = 0; i < kCount; ++i) host[i] = 0.5f * i - 3.0f;
  DeviceArray<float> send(kCount), recv(kCount);
  send.Upload(host);
  SHARDD_ASSERT_OK(comm->AllToAllV(send.get(), {kCount}, recv.get(), {kCount},
                                   v1::FLOAT32, kTimeout));
  EXPECT_EQ(recv.Download(), host);
  EXPECT_THAT(comm->AllToAllV(send.get(), {kCount}, recv.get(), {kCount - 1},
                              v1::FLOAT32, kTimeout),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("recv_counts[0] must equal send_counts[0]")));
  const CommunicatorStats stats = comm->stats();
  EXPECT_EQ(stats.all_to_all.calls, 2);
  EXPECT_EQ(stats.all_to_all.failures, 1);
  EXPECT_EQ(stats.all_to_all.bytes, kCount * 4);
  SHARDD_EXPECT_OK(comm->health());
}

TEST(NcclCommunicatorGpuTest, SingleRankReduceScatterAvgEqualsInput) {
  SHARDD_SKIP_WITHOUT_GPU();
  InMemoryKeyValueClient kv;
  auto comm = MakeSingleRank(&kv, "t/reduce_scatter");
  ASSERT_NE(comm, nullptr);
  constexpr int kCount = 1000;
  std::vector<float> host(kCount);
  for (int i = 0; i < kCount; ++i) host[i] = 1.0f / (i + 1) - 0.3f * i;
  for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kSum}) {
    DeviceArray<float> input(kCount), output(kCount);
    input.Upload(host);
    SHARDD_ASSERT_OK(comm->ReduceScatter(input.get(), output.get(), kCount,
                                         v1::FLOAT32, op, kTimeout));
    EXPECT_EQ(output.Download(), host);  // Sum or mean over one rank.

    std::vector<uint16_t> bf16(kCount);
    for (int i = 0; i < kCount; ++i) bf16[i] = kernels::Fp32ToBf16(host[i]);
    DeviceArray<uint16_t> bf16_input(kCount), bf16_output(kCount);
    bf16_input.Upload(bf16);
    SHARDD_ASSERT_OK(comm->ReduceScatter(bf16_input.get(), bf16_output.get(),
                                         kCount, v1::BFLOAT16, op, kTimeout));
    EXPECT_EQ(bf16_output.Download(), bf16);
  }
  EXPECT_THAT(comm->ReduceScatter(nullptr, nullptr, 1, v1::INT32,
                                  ReduceOp::kAvg, kTimeout),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kAvg")));
  SHARDD_EXPECT_OK(comm->health());
}

TEST(NcclCommunicatorGpuTest, SingleRankAllReduceBroadcastBarrier) {
  SHARDD_SKIP_WITHOUT_GPU();
  InMemoryKeyValueClient kv;
  auto comm = MakeSingleRank(&kv, "t/all_reduce");
  ASSERT_NE(comm, nullptr);
  std::vector<int64_t> ints = {1, -2, 3, int64_t{1} << 40};
  DeviceArray<int64_t> device_ints(ints.size());
  device_ints.Upload(ints);
  SHARDD_ASSERT_OK(comm->AllReduce(device_ints.get(), ints.size(), v1::INT64,
                                   ReduceOp::kSum, kTimeout));
  EXPECT_EQ(device_ints.Download(), ints);
  SHARDD_ASSERT_OK(
      comm->Broadcast(device_ints.get(), ints.size(), v1::INT64, 0, kTimeout));
  EXPECT_EQ(device_ints.Download(), ints);
  EXPECT_THAT(
      comm->Broadcast(device_ints.get(), ints.size(), v1::INT64, 1, kTimeout),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("root")));
  SHARDD_ASSERT_OK(comm->Barrier(kTimeout));
  SHARDD_ASSERT_OK(
      comm->AllReduce(nullptr, 0, v1::FLOAT32, ReduceOp::kAvg, kTimeout));
  const CommunicatorStats stats = comm->stats();
  EXPECT_EQ(stats.all_reduce.calls, 2);
  EXPECT_EQ(stats.all_reduce.bytes, 32);
  EXPECT_EQ(stats.broadcast.calls, 2);
  EXPECT_EQ(stats.broadcast.failures, 1);
  EXPECT_EQ(stats.barrier.calls, 1);
  SHARDD_EXPECT_OK(comm->health());
}

TEST(NcclCommunicatorGpuTest, RejectsHostPointersWithoutPoisoning) {
  // A host input into device memory is refused; host memory on both sides
  // of an AllGather, and AllReduce's and Broadcast's, is staged.
  SHARDD_SKIP_WITHOUT_GPU();
  InMemoryKeyValueClient kv;
  auto comm = MakeSingleRank(&kv, "t/host_pointers");
  ASSERT_NE(comm, nullptr);
  std::vector<float> host(16, 1.0f);
  DeviceArray<float> device(16);
  EXPECT_THAT(
      comm->AllGather(host.data(), device.get(), 16, v1::FLOAT32, kTimeout),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("input"), HasSubstr("device memory"))));
  // AllReduce and Broadcast stage host memory (control messages).
  std::vector<int64_t> header = {7, -3, int64_t{1} << 41};
  SHARDD_EXPECT_OK(
      comm->Broadcast(header.data(), 3, v1::INT64, 0, kTimeout));
  SHARDD_EXPECT_OK(
      comm->AllReduce(header.data(), 3, v1::INT64, ReduceOp::kSum, kTimeout));
  EXPECT_EQ(header, (std::vector<int64_t>{7, -3, int64_t{1} << 41}));
  std::vector<int64_t> gathered(3, 0);
  SHARDD_EXPECT_OK(
      comm->AllGather(header.data(), gathered.data(), 3, v1::INT64, kTimeout));
  EXPECT_EQ(gathered, header);
  SHARDD_EXPECT_OK(
      comm->AllReduce(host.data(), 16, v1::FLOAT32, ReduceOp::kSum, kTimeout));
  EXPECT_EQ(host, std::vector<float>(16, 1.0f));
  EXPECT_THAT(
      comm->AllReduce(device.get(), 16, v1::FLOAT32, ReduceOp::kSum,
                      absl::ZeroDuration()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
  // Overlap other than the in-place slot.
  DeviceArray<float> wide(32);
  EXPECT_THAT(
      comm->ReduceScatter(wide.get(), wide.get() + 1, 16, v1::FLOAT32,
                          ReduceOp::kSum, kTimeout),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps")));
  SHARDD_EXPECT_OK(comm->health());
  SHARDD_EXPECT_OK(
      comm->AllReduce(device.get(), 16, v1::FLOAT32, ReduceOp::kSum, kTimeout));
}

// The step path: producer kernel on the compute stream, collective ordered
// after it by an event, consumer ordered after the collective, and no host
// synchronization by the communicator until Synchronize().
TEST(NcclCommunicatorGpuTest, AsyncCollectivesAreStreamOrdered) {
  SHARDD_SKIP_WITHOUT_GPU();
  InMemoryKeyValueClient kv;
  auto comm = MakeSingleRank(&kv, "t/async");
  ASSERT_NE(comm, nullptr);
  EXPECT_NE(comm->all_gather_stream(), comm->reduce_scatter_stream());
  cudaStream_t compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking),
            cudaSuccess);
  constexpr int kCount = 1 << 20;
  std::vector<float> host(kCount);
  for (int i = 0; i < kCount; ++i) host[i] = static_cast<float>(i % 977);
  std::vector<float> result(kCount);
  DeviceArray<float> staging(kCount), params(kCount), gathered(kCount),
      grads(kCount);
  staging.Upload(host);

  for (int step = 0; step < 3; ++step) {
    // "Compute" produces the shard, then the all-gather consumes it. (The
    // copy into pageable `result` below blocks the host: that is the test
    // checking, not the communicator.)
    ASSERT_EQ(cudaMemcpyAsync(params.get(), staging.get(), kCount * 4,
                              cudaMemcpyDeviceToDevice, compute),
              cudaSuccess);
    cudaEvent_t produced = nullptr;
    ASSERT_EQ(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming),
              cudaSuccess);
    ASSERT_EQ(cudaEventRecord(produced, compute), cudaSuccess);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        NcclWork gather,
        comm->AllGatherAsync(params.get(), gathered.get(), kCount, v1::FLOAT32,
                             NcclWaitFor::Event(produced), kTimeout));
    cudaEventDestroy(produced);  // Allowed once the call returned.
    SHARDD_ASSERT_OK(gather.StreamWait(compute));
    ASSERT_EQ(cudaMemcpyAsync(grads.get(), gathered.get(), kCount * 4,
                              cudaMemcpyDeviceToDevice, compute),
              cudaSuccess);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        NcclWork reduce,
        comm->ReduceScatterAsync(grads.get(), grads.get(), kCount, v1::FLOAT32,
                                 ReduceOp::kAvg, NcclWaitFor::Stream(compute),
                                 kTimeout));
    SHARDD_ASSERT_OK(reduce.StreamWait(compute));
    ASSERT_EQ(cudaMemcpyAsync(result.data(), grads.get(), kCount * 4,
                              cudaMemcpyDeviceToHost, compute),
              cudaSuccess);
    EXPECT_EQ(comm->host_synchronizations(), 0);
    ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
    EXPECT_EQ(result, host) << "step " << step;
  }
  // One host synchronization at the end of the "step".
  SHARDD_ASSERT_OK(comm->Synchronize(kTimeout));
  EXPECT_EQ(comm->host_synchronizations(), 1);
  cudaStreamDestroy(compute);
}

TEST(NcclCommunicatorGpuTest, BlockingCallTimesOutAndAbortsTheCommunicator) {
  SHARDD_SKIP_WITHOUT_GPU();
  cudaStream_t blocked = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&blocked, cudaStreamNonBlocking),
            cudaSuccess);
  InMemoryKeyValueClient kv;
  NcclCommunicatorOptions options;
  options.compute_stream = blocked;
  auto comm = MakeSingleRank(&kv, "t/timeout", options);
  ASSERT_NE(comm, nullptr);
  DeviceArray<float> buffer(1024);
  HostGate gate;
  ASSERT_EQ(cudaLaunchHostFunc(blocked, WaitForGate, &gate), cudaSuccess);
  // Opens the gate once the watchdog gave up (ncclCommAbort may wait for
  // the streams), or after a generous limit so the test cannot hang.
  std::thread opener([&] {
    const absl::Time limit = absl::Now() + absl::Seconds(20);
    while (comm->health().ok() && absl::Now() < limit) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    gate.open = true;
  });
  const absl::Time start = absl::Now();
  const absl::Status status = comm->AllReduce(
      buffer.get(), 1024, v1::FLOAT32, ReduceOp::kSum, absl::Milliseconds(200));
  const absl::Duration waited = absl::Now() - start;
  opener.join();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               AllOf(HasSubstr("AllReduce"),
                                     HasSubstr("did not complete within"))));
  EXPECT_GE(waited, absl::Milliseconds(190));
  EXPECT_LT(waited, absl::Seconds(15));
  EXPECT_THAT(comm->health(), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(comm->Barrier(kTimeout),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("communicator aborted")));
  EXPECT_THAT(
      comm->AllGatherAsync(buffer.get(), buffer.get(), 1024, v1::FLOAT32,
                           NcclWaitFor::Nothing(), kTimeout),
      StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_GE(comm->stats().all_reduce.failures, 1);
  EXPECT_EQ(cudaStreamSynchronize(blocked), cudaSuccess);
  comm.reset();  // No finalize on an aborted communicator; must not hang.
  cudaStreamDestroy(blocked);
}

TEST(NcclCommunicatorGpuTest, WatchdogAbortsUnwaitedAsyncCollective) {
  SHARDD_SKIP_WITHOUT_GPU();
  cudaStream_t blocked = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&blocked, cudaStreamNonBlocking),
            cudaSuccess);
  InMemoryKeyValueClient kv;
  auto comm = MakeSingleRank(&kv, "t/async_timeout");
  ASSERT_NE(comm, nullptr);
  DeviceArray<float> input(256), output(256);
  HostGate gate;
  ASSERT_EQ(cudaLaunchHostFunc(blocked, WaitForGate, &gate), cudaSuccess);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      NcclWork work,
      comm->AllGatherAsync(input.get(), output.get(), 256, v1::FLOAT32,
                           NcclWaitFor::Stream(blocked),
                           absl::Milliseconds(100)));
  // Nobody waits: the watchdog notices by itself.
  const absl::Time limit = absl::Now() + absl::Seconds(20);
  while (comm->health().ok() && absl::Now() < limit) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  gate.open = true;
  EXPECT_THAT(comm->health(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                       HasSubstr("AllGather")));
  EXPECT_THAT(work.Wait(), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(comm->Synchronize(kTimeout),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(cudaStreamSynchronize(blocked), cudaSuccess);
  comm.reset();
  cudaStreamDestroy(blocked);
}

// --- Several ranks, one GPU each (threads of this process). -----------

TEST(NcclCommunicatorMultiGpuTest, CollectivesMatchTheCpuReference) {
  std::string reason;
  const int gpus = GpuCount(&reason);
  if (gpus < 2) {
    GTEST_SKIP() << "no GPU: needs 2 GPUs, have " << gpus << " " << reason;
  }
  const int world = std::min(gpus, 4);
  constexpr int kCount = 3001;  // Per rank.
  InMemoryKeyValueClient kv;
  std::vector<absl::Status> failures(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      auto fail = [&](absl::Status status) { failures[rank] = status; };
      NcclCommunicatorOptions options;
      options.device = rank;
      options.init_timeout = absl::Seconds(60);
      ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
      auto comm =
          NcclCommunicator::Create(&kv, "t/multi", rank, world, options);
      if (!comm.ok()) return fail(comm.status());
      // All-gather: rank r contributes r * 10000 + i.
      std::vector<float> mine(kCount);
      for (int i = 0; i < kCount; ++i) mine[i] = rank * 10000.0f + i;
      DeviceArray<float> input(kCount), gathered(kCount * world);
      input.Upload(mine);
      absl::Status status = (*comm)->AllGather(input.get(), gathered.get(),
                                               kCount, v1::FLOAT32, kTimeout);
      if (!status.ok()) return fail(status);
      const std::vector<float> all = gathered.Download();
      for (int r = 0; r < world; ++r) {
        for (int i = 0; i < kCount; i += 97) {
          EXPECT_EQ(all[r * kCount + i], r * 10000.0f + i);
        }
      }
      // Reduce-scatter (avg) of small integers: exact in fp32 and bf16.
      std::vector<float> contribution(kCount * world);
      for (int j = 0; j < kCount * world; ++j) {
        contribution[j] = static_cast<float>((j % 13) * world + rank);
      }
      DeviceArray<float> rs_input(kCount * world), rs_output(kCount);
      rs_input.Upload(contribution);
      status = (*comm)->ReduceScatter(rs_input.get(), rs_output.get(), kCount,
                                      v1::FLOAT32, ReduceOp::kSum, kTimeout);
      if (!status.ok()) return fail(status);
      const std::vector<float> reduced = rs_output.Download();
      const float rank_sum = world * (world - 1) / 2.0f;
      for (int i = 0; i < kCount; ++i) {
        const int j = rank * kCount + i;
        ASSERT_EQ(reduced[i], (j % 13) * world * world + rank_sum) << i;
      }
      // All-reduce in bf16 (sums of small integers are exact).
      std::vector<uint16_t> bf16(kCount);
      for (int i = 0; i < kCount; ++i) {
        bf16[i] = kernels::Fp32ToBf16(static_cast<float>(i % 7 + rank));
      }
      DeviceArray<uint16_t> ar(kCount);
      ar.Upload(bf16);
      status = (*comm)->AllReduce(ar.get(), kCount, v1::BFLOAT16,
                                  ReduceOp::kSum, kTimeout);
      if (!status.ok()) return fail(status);
      const std::vector<uint16_t> summed = ar.Download();
      for (int i = 0; i < kCount; ++i) {
        ASSERT_EQ(kernels::Bf16ToFp32(summed[i]), (i % 7) * world + rank_sum)
            << i;
      }
      // Broadcast from the last rank.
      std::vector<int32_t> values(kCount, rank);
      DeviceArray<int32_t> bc(kCount);
      bc.Upload(values);
      status =
          (*comm)->Broadcast(bc.get(), kCount, v1::INT32, world - 1, kTimeout);
      if (!status.ok()) return fail(status);
      EXPECT_EQ(bc.Download(), std::vector<int32_t>(kCount, world - 1));
      status = (*comm)->Barrier(kTimeout);
      if (!status.ok()) return fail(status);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_THAT(failures[rank], IsOk()) << "rank " << rank;
  }
}

}  // namespace
}  // namespace shardd
