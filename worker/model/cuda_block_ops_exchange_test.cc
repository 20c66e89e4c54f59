// Expert parallelism's row exchanges on the GPU (cuda_block_ops_exchange.cc)
// against the host exchange (expert_exchange.cc), bit for bit, in one rank
// (a group of one: the all-to-alls move every row to this rank and back,
// so packing, unpacking and the slot-order sums all run; a test across
// GPUs needs a machine with two). fp32 and bf16 storage.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "testing/gpu.h"
#include "testing/model_builder.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/memory/cuda_memory_backend.h"
#include "worker/memory/device_allocator.h"
#include "worker/memory/memory_tracker.h"
#include "worker/model/cuda_block_ops.h"
#include "worker/model/expert_exchange.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace step {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(30);

// Host values into an Act of the storage type (bf16: rounded) or fp32.
void Put(const std::vector<float>& v, bool bf16, Act* a) {
  if (bf16) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = kernels::Fp32ToBf16(v[i]);
    ASSERT_EQ(cudaMemcpy(a->data(), b.data(), b.size() * 2,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  } else {
    ASSERT_EQ(cudaMemcpy(a->data(), v.data(), v.size() * 4,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
}

std::vector<float> Get(const Act& a, bool bf16, int64_t n) {
  std::vector<float> out(n);
  if (bf16) {
    std::vector<uint16_t> b(n);
    EXPECT_EQ(cudaMemcpy(b.data(), a.data(), n * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int64_t i = 0; i < n; ++i) out[i] = kernels::Bf16ToFp32(b[i]);
  } else {
    EXPECT_EQ(cudaMemcpy(out.data(), a.data(), n * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return out;
}

// bf16 storage: values as the device holds them.
std::vector<float> Stored(std::vector<float> v, bool bf16) {
  if (bf16) {
    for (float& x : v) x = kernels::RoundToBf16(x);
  }
  return v;
}

TEST(CudaBlockOpsExchangeTest, RowsMatchTheHostExchange) {
  SHARDD_SKIP_WITHOUT_GPU();
  testing_util::TinyMoeShape shape;
  shape.dim = 12;
  shape.experts = 4;
  shape.top_k = 2;
  shape.layers = 1;
  const v1::ModelSpec model = testing_util::TinyMoeSpec(shape);
  SHARDD_ASSERT_OK_AND_ASSIGN(MoeArchitecture arch, ReadMoeArchitecture(model));
  const int64_t d = arch.dim, t = 9, experts = shape.experts;
  const int k = arch.top_k;

  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2, 2);
  std::vector<int32_t> idx(t * k);
  for (int64_t i = 0; i < t; ++i) {
    const int32_t first = static_cast<int32_t>(rng() % experts);
    idx[i * k] = first;
    idx[i * k + 1] = static_cast<int32_t>((first + 1 + rng() % (experts - 1)) %
                                          experts);
  }
  std::vector<float> x(t * d), w(t * k), dy(t * d);
  for (float& v : x) v = u(rng);
  for (float& v : w) v = u(rng);
  for (float& v : dy) v = u(rng);

  InMemoryKeyValueClient kv;
  KvGlooStore store(&kv, kTimeout);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<GlooCommunicator> gloo,
      GlooCommunicator::Create(&store, "exchange-host", 0, 1, "127.0.0.1",
                               kTimeout));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(&kv, "exchange-device", 0, 1,
                               NcclCommunicatorOptions()));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ExpertExchange host, ExpertExchange::Create(gloo.get(), experts, kTimeout));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      ExpertExchange device,
      ExpertExchange::Create(nccl.get(), experts, kTimeout));
  ExpertRoute route, device_route;
  SHARDD_ASSERT_OK(host.Route(idx.data(), t, k, 0, &route));
  // The device's route: its counts all-gathered from host memory over NCCL.
  SHARDD_ASSERT_OK(device.Route(idx.data(), t, k, 0, &device_route));
  EXPECT_EQ(device_route.order, route.order);
  EXPECT_EQ(device_route.recv_counts, route.recv_counts);
  const int64_t r = route.received;
  ASSERT_EQ(r, t * k);

  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 storage" : "fp32 storage");
    // The host exchange on the values as the device stores them.
    const std::vector<float> xs = Stored(x, bf16), dys = Stored(dy, bf16);
    std::vector<float> x_r(r * d), w_r(r);
    std::vector<int32_t> ids_r(r);
    SHARDD_ASSERT_OK(host.Dispatch(route, xs.data(), w.data(), idx.data(), d,
                                   x_r.data(), ids_r.data(), w_r.data()));
    // The experts' outputs and input gradients: any stored values.
    std::vector<float> y_r(r * d), dx_r(r * d), dw_r(r);
    for (float& v : y_r) v = u(rng);
    for (float& v : dx_r) v = u(rng);
    for (float& v : dw_r) v = u(rng);
    y_r = Stored(y_r, bf16);
    dx_r = Stored(dx_r, bf16);
    std::vector<float> y(t * d), dy_r(r * d), dx(t * d), d_weights(t * k);
    SHARDD_ASSERT_OK(host.Combine(route, y_r.data(), d, y.data()));
    SHARDD_ASSERT_OK(host.DispatchGrad(route, dys.data(), d, dy_r.data()));
    SHARDD_ASSERT_OK(host.CombineGrad(route, dx_r.data(), dw_r.data(), d,
                                      dx.data(), d_weights.data()));

    MemoryTracker tracker;
    CudaMemoryBackend backend(0);
    DeviceAllocator allocator(&backend, &tracker);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
              cudaSuccess);
    {
      SHARDD_ASSERT_OK_AND_ASSIGN(
          std::unique_ptr<CudaBlockOps> ops,
          CudaBlockOps::Create(
              &arch, bf16 ? DeviceDType::kBFloat16 : DeviceDType::kFloat32,
              stream, &allocator));
      ops->SetExpertGroup(nccl.get(), kTimeout);
      auto act = [&](Elem e, int64_t n) {
        absl::StatusOr<Act> a = ops->Allocate(e, n, /*zero=*/true);
        EXPECT_TRUE(a.ok()) << a.status();
        return a.ok() ? std::move(*a) : Act();
      };
      Act xa = act(Elem::kStorage, t * d), wa = act(Elem::kF32, t * k);
      Put(x, bf16, &xa);
      Put(w, false, &wa);
      SHARDD_ASSERT_OK_AND_ASSIGN(Act ia, ops->Upload(idx.data(), t * k));
      std::vector<int32_t> choices;
      SHARDD_ASSERT_OK(ops->ReadChoices(ia, t * k, &choices));
      EXPECT_EQ(choices, idx);

      Act xr = act(Elem::kStorage, r * d), idr = act(Elem::kI32, r),
          wr = act(Elem::kF32, r);
      SHARDD_ASSERT_OK(
          ops->ExchangeDispatch(device, route, xa, wa, ia, &xr, &idr, &wr));
      Act yra = act(Elem::kStorage, r * d), ya = act(Elem::kStorage, t * d);
      Put(y_r, bf16, &yra);
      SHARDD_ASSERT_OK(ops->ExchangeCombine(device, route, yra, &ya));
      Act dya = act(Elem::kStorage, t * d), dyr = act(Elem::kStorage, r * d);
      Put(dy, bf16, &dya);
      SHARDD_ASSERT_OK(ops->ExchangeDispatchGrad(device, route, dya, &dyr));
      Act dxra = act(Elem::kStorage, r * d), dwra = act(Elem::kF32, r),
          dxa = act(Elem::kStorage, t * d), dwa = act(Elem::kF32, t * k);
      Put(dx_r, bf16, &dxra);
      Put(dw_r, false, &dwra);
      SHARDD_ASSERT_OK(
          ops->ExchangeCombineGrad(device, route, dxra, dwra, &dxa, &dwa));
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

      EXPECT_EQ(Get(xr, bf16, r * d), x_r);
      std::vector<int32_t> got_ids(r);
      ASSERT_EQ(cudaMemcpy(got_ids.data(), idr.data(), r * 4,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(got_ids, ids_r);
      EXPECT_EQ(Get(wr, false, r), w_r);
      // Sums in fp32, rounded once to the storage type.
      EXPECT_EQ(Get(ya, bf16, t * d), Stored(y, bf16));
      EXPECT_EQ(Get(dyr, bf16, r * d), dy_r);
      EXPECT_EQ(Get(dxa, bf16, t * d), Stored(dx, bf16));
      EXPECT_EQ(Get(dwa, false, t * k), d_weights);
    }
    cudaStreamDestroy(stream);
  }
  // Every row went through the expert group's all-to-alls.
  EXPECT_EQ(nccl->stats().all_to_all.calls, 8);
}

}  // namespace
}  // namespace step
}  // namespace shardd
