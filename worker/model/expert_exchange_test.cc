#include "worker/model/expert_exchange.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(20);

// ep Gloo ranks on threads, each running fn(rank, comm).
void OnRanks(int ep, const std::string& prefix,
             const std::function<absl::Status(int, Communicator*)>& fn) {
  InMemoryKeyValueClient kv;
  std::vector<absl::Status> statuses(ep);
  std::vector<std::thread> threads;
  for (int r = 0; r < ep; ++r) {
    threads.emplace_back([&, r] {
      KvGlooStore store(&kv, kTimeout);
      absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
          GlooCommunicator::Create(&store, prefix, r, ep,
                                   GlooCommunicator::kDefaultBindAddress,
                                   kTimeout);
      statuses[r] = comm.ok() ? fn(r, comm->get()) : comm.status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ep; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

// Each rank's t tokens choose k distinct experts; an "expert" e multiplies
// its row by (e + 1) and adds its weight: the exchange must bring every row
// to its expert's rank and every output back to its token, so that
// y[i] = sum_s (idx + 1) * w * x[i] exactly as computed locally, and the
// gradient path returns dx[i] = sum_s (idx + 1) * dy[i] and per-slot
// weight gradients.
TEST(ExpertExchangeTest, RowsReachTheirExpertsAndComeBack) {
  constexpr int64_t kExperts = 8, kT = 13, kD = 5;
  constexpr int kK = 3;
  for (int ep : {1, 2, 4}) {
    SCOPED_TRACE(absl::StrCat("ep ", ep));
    OnRanks(ep, absl::StrCat("exchange/", ep), [&](int r, Communicator* comm)
                                                   -> absl::Status {
      SHARDD_ASSIGN_OR_RETURN(ExpertExchange ex,
                              ExpertExchange::Create(comm, kExperts, kTimeout));
      std::mt19937 rng(100 + r);
      std::vector<int32_t> idx(kT * kK);
      std::vector<float> x(kT * kD), w(kT * kK), dy(kT * kD);
      for (int64_t i = 0; i < kT; ++i) {
        // k distinct experts per token.
        std::vector<int32_t> all(kExperts);
        for (int e = 0; e < kExperts; ++e) all[e] = e;
        std::shuffle(all.begin(), all.end(), rng);
        for (int s = 0; s < kK; ++s) idx[i * kK + s] = all[s];
      }
      std::uniform_real_distribution<float> u(-1, 1);
      for (float& v : x) v = u(rng);
      for (float& v : w) v = u(rng);
      for (float& v : dy) v = u(rng);

      ExpertRoute route;
      SHARDD_RETURN_IF_ERROR(ex.Route(idx.data(), kT, kK, 0, &route));
      std::vector<float> x_r(route.received * kD), w_r(route.received);
      std::vector<int32_t> ids_r(route.received);
      SHARDD_RETURN_IF_ERROR(ex.Dispatch(route, x.data(), w.data(),
                                         idx.data(), kD, x_r.data(),
                                         ids_r.data(), w_r.data()));
      // The local "experts".
      std::vector<float> y_r(route.received * kD);
      for (int64_t i = 0; i < route.received; ++i) {
        if (ids_r[i] < 0 || ids_r[i] >= ex.local_experts()) {
          return absl::InternalError("local expert id out of range");
        }
        const float scale = ex.first_expert() + ids_r[i] + 1;
        for (int64_t c = 0; c < kD; ++c) {
          y_r[i * kD + c] = scale * w_r[i] * x_r[i * kD + c];
        }
      }
      std::vector<float> y(kT * kD, -7);
      SHARDD_RETURN_IF_ERROR(ex.Combine(route, y_r.data(), kD, y.data()));
      // Backward: dy to the experts, their dx = scale * w * dy, and dw =
      // scale * <x, dy>.
      std::vector<float> dy_r(route.received * kD);
      SHARDD_RETURN_IF_ERROR(ex.DispatchGrad(route, dy.data(), kD,
                                             dy_r.data()));
      std::vector<float> dx_r(route.received * kD), dw_r(route.received);
      for (int64_t i = 0; i < route.received; ++i) {
        const float scale = ex.first_expert() + ids_r[i] + 1;
        float dot = 0;
        for (int64_t c = 0; c < kD; ++c) {
          dx_r[i * kD + c] = scale * w_r[i] * dy_r[i * kD + c];
          dot += x_r[i * kD + c] * dy_r[i * kD + c];
        }
        dw_r[i] = scale * dot;
      }
      std::vector<float> dx(kT * kD, -7), dw(kT * kK, -7);
      SHARDD_RETURN_IF_ERROR(ex.CombineGrad(route, dx_r.data(), dw_r.data(),
                                            kD, dx.data(), dw.data()));
      // The same, locally, summing slots in slot order.
      for (int64_t i = 0; i < kT; ++i) {
        for (int64_t c = 0; c < kD; ++c) {
          float want_y = 0, want_dx = 0;
          for (int s = 0; s < kK; ++s) {
            const float scale = idx[i * kK + s] + 1;
            want_y += scale * w[i * kK + s] * x[i * kD + c];
            want_dx += scale * w[i * kK + s] * dy[i * kD + c];
          }
          if (y[i * kD + c] != want_y || dx[i * kD + c] != want_dx) {
            return absl::InternalError(absl::StrCat(
                "rank ", r, " token ", i, " column ", c, ": y ", y[i * kD + c],
                " want ", want_y, ", dx ", dx[i * kD + c], " want ", want_dx));
          }
        }
        for (int s = 0; s < kK; ++s) {
          float dot = 0;
          for (int64_t c = 0; c < kD; ++c) {
            dot += x[i * kD + c] * dy[i * kD + c];
          }
          const float want = (idx[i * kK + s] + 1) * dot;
          if (dw[i * kK + s] != want) {
            return absl::InternalError(absl::StrCat(
                "rank ", r, " token ", i, " slot ", s, ": dw ",
                dw[i * kK + s], " want ", want));
          }
        }
      }
      return absl::OkStatus();
    });
  }
}

TEST(ExpertExchangeTest, RefusesBadGroupsIdsAndSkewBeyondTheBound) {
  OnRanks(2, "exchange/errors", [&](int r, Communicator* comm) -> absl::Status {
    EXPECT_THAT(ExpertExchange::Create(comm, 3, kTimeout),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("2 expert-parallel ranks must divide the 3")));
    EXPECT_THAT(ExpertExchange::Create(nullptr, 4, kTimeout),
                StatusIs(absl::StatusCode::kInvalidArgument));
    SHARDD_ASSIGN_OR_RETURN(ExpertExchange ex,
                            ExpertExchange::Create(comm, 4, kTimeout));
    ExpertRoute route;
    const std::vector<int32_t> bad = {0, 4};
    EXPECT_THAT(ex.Route(bad.data(), 1, 2, 0, &route),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("routes to expert 4, outside [0, 4)")));
    // Every row to experts 0 and 1 (rank 0): rank 0 receives 8 rows, over
    // a bound of 3; both ranks exchanged their counts first.
    const std::vector<int32_t> skewed = {0, 1, 1, 0};
    const absl::Status status = ex.Route(skewed.data(), 2, 2, 3, &route);
    if (r == 0) {
      EXPECT_THAT(status, StatusIs(absl::StatusCode::kResourceExhausted,
                                   HasSubstr("received 8 rows, more than the "
                                             "3")));
    } else {
      EXPECT_THAT(status, IsOk());
    }
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace shardd
