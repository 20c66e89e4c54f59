// The device LoRA merge and gradient split against the host's
// (lora_merge.h): the same GEMM calls, so results differ only in the order
// of each dot product's additions, within (k + 1) 2^-24 of the sum of the
// terms' magnitudes on each side. Skips without a GPU.

#include "worker/shards/device_lora_merge.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cuda/ops_test_util.h"
#include "worker/shards/lora_merge.h"

namespace shardd {
namespace {

namespace ot = kernels::cuda::ops_testing;

// |x| summed over the k terms of each output, for the bound.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const std::vector<float>& magnitude, int64_t k,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - want[i]),
              2.0 * (k + 1) * std::ldexp(magnitude[i], -24) + 1e-30)
        << what << " " << i;
  }
}

void Check(const LoraTarget& t, int64_t experts) {
  ot::GpuContext gpu;
  const int64_t e_n = t.experts == 0 ? 1 : experts;
  const int64_t r = t.rank, in = t.in, out = t.out;
  const auto a = ot::RandomVector(e_n * r * in, -1.0f, 1.0f, 1);
  const auto b = ot::RandomVector(e_n * out * r, -1.0f, 1.0f, 2);
  const auto w0 = ot::RandomVector(e_n * in * out, -1.0f, 1.0f, 3);
  const auto g = ot::RandomVector(e_n * in * out, -1.0f, 1.0f, 4);
  std::vector<float> w = w0, da(a.size()), db(b.size());
  LoraMergeInto(t, experts, a.data(), b.data(), w.data());
  LoraSplitGrad(t, experts, a.data(), b.data(), g.data(), da.data(), db.data());
  // Magnitudes: the same GEMMs on |inputs| (plus |w0| for the merge).
  std::vector<float> abs_a(a), abs_b(b), abs_g(g), mag_w(w0);
  for (float& v : abs_a) v = std::fabs(v);
  for (float& v : abs_b) v = std::fabs(v);
  for (float& v : abs_g) v = std::fabs(v);
  for (float& v : mag_w) v = std::fabs(v);
  std::vector<float> mag_da(a.size()), mag_db(b.size());
  LoraMergeInto(t, experts, abs_a.data(), abs_b.data(), mag_w.data());
  LoraSplitGrad(t, experts, abs_a.data(), abs_b.data(), abs_g.data(),
                mag_da.data(), mag_db.data());

  ot::DeviceBuffer<float> d_a(a), d_b(b), d_w(w0), d_g(g), d_da(a.size()),
      d_db(b.size());
  SHARDD_ASSERT_OK(DeviceLoraMergeInto(gpu.handle(), gpu.stream(), t, experts,
                                       d_a.get(), d_b.get(), d_w.get()));
  SHARDD_ASSERT_OK(DeviceLoraSplitGrad(gpu.handle(), gpu.stream(), t, experts,
                                       d_a.get(), d_b.get(), d_g.get(),
                                       d_da.get(), d_db.get()));
  gpu.Sync();
  ExpectClose(d_w.Download(), w, mag_w, r, "w");
  ExpectClose(d_da.Download(), da, mag_da, out, "da");
  ExpectClose(d_db.Download(), db, mag_db, in, "db");
}

TEST(DeviceLoraMergeTest, LinearMatchesTheHost) {
  SHARDD_SKIP_WITHOUT_GPU();
  LoraTarget t;
  t.base = "q_proj.weight";
  t.in = 96;
  t.out = 160;
  t.rank = 8;
  t.scale = 2.0;
  Check(t, 0);
}

TEST(DeviceLoraMergeTest, StackedExpertsMatchTheHost) {
  SHARDD_SKIP_WITHOUT_GPU();
  LoraTarget t;
  t.base = "experts.gate_up_proj";
  t.experts = 6;
  t.in = 64;
  t.out = 96;
  t.rank = 4;
  t.scale = 0.5;
  Check(t, 6);
  Check(t, 3);  // the experts one EP rank holds
}

}  // namespace
}  // namespace shardd
