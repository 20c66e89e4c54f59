#include "worker/model/expert_exchange.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/expert_permute_element.h"

namespace shardd {

absl::StatusOr<ExpertExchange> ExpertExchange::Create(Communicator* comm,
                                                      int64_t experts,
                                                      absl::Duration timeout) {
  if (comm == nullptr) {
    return absl::InvalidArgumentError("expert exchange: comm is null");
  }
  if (experts < 1 || experts % comm->world_size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert exchange: ", comm->world_size(),
        " expert-parallel ranks must divide the ", experts, " experts"));
  }
  if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        "expert exchange: timeout must be positive and finite");
  }
  return ExpertExchange(comm, experts, timeout);
}

absl::Status ExpertExchange::Route(const int32_t* indices, int64_t t, int k,
                                   int64_t max_received_rows,
                                   ExpertRoute* route) {
  const int64_t local = local_experts();
  const int64_t n = t * k;
  route->t = t;
  route->k = k;
  route->send_counts.assign(ep_, 0);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t e = indices[j];
    if (e < 0 || e >= experts_) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert exchange: row ", j, " routes to expert ", e,
                       ", outside [0, ", experts_, ")"));
    }
    ++route->send_counts[e / local];
  }
  // Stable counting sort by destination: (destination, token, slot) order.
  std::vector<int64_t> next(ep_, 0);
  for (int r = 1; r < ep_; ++r) {
    next[r] = next[r - 1] + route->send_counts[r - 1];
  }
  route->order.assign(n, 0);
  route->position.assign(n, 0);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at = next[indices[j] / local]++;
    route->order[at] = j;
    route->position[j] = at;
  }
  // Every rank's counts (an all-gather, so that the all-to-alls are the
  // row exchanges alone); this rank's column is what it receives.
  std::vector<int64_t> all(static_cast<size_t>(ep_) * ep_);
  SHARDD_RETURN_IF_ERROR(comm_->AllGather(route->send_counts.data(),
                                          all.data(), ep_, v1::INT64,
                                          timeout_));
  route->recv_counts.assign(ep_, 0);
  for (int r = 0; r < ep_; ++r) route->recv_counts[r] = all[r * ep_ + rank_];
  route->received = 0;
  for (int64_t c : route->recv_counts) route->received += c;
  if (max_received_rows > 0 && route->received > max_received_rows) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "expert parallelism: rank ", rank_, "'s experts received ",
        route->received, " rows, more than the ", max_received_rows,
        " the plan's ep_capacity_factor allows (--ep-capacity-factor); "
        "routing is more skewed than planned"));
  }
  return absl::OkStatus();
}

absl::Status ExpertExchange::Exchange(const ExpertRoute& route, bool reverse,
                                      int64_t width,
                                      const std::vector<float>& send,
                                      std::vector<float>* recv) {
  std::vector<int64_t> send_counts(ep_), recv_counts(ep_);
  int64_t received = 0;
  for (int r = 0; r < ep_; ++r) {
    send_counts[r] =
        (reverse ? route.recv_counts[r] : route.send_counts[r]) * width;
    recv_counts[r] =
        (reverse ? route.send_counts[r] : route.recv_counts[r]) * width;
    received += recv_counts[r];
  }
  recv->resize(received);
  return comm_->AllToAllV(send.data(), send_counts, recv->data(), recv_counts,
                          v1::FLOAT32, timeout_);
}

absl::Status ExpertExchange::Dispatch(const ExpertRoute& route, const float* x,
                                      const float* weights,
                                      const int32_t* indices, int64_t d,
                                      float* x_r, int32_t* ids_r, float* w_r) {
  const int64_t width = d + kernels::kDispatchRowExtras;
  const int64_t local = local_experts();
  const int64_t rows = static_cast<int64_t>(route.order.size());
  std::vector<float> send(rows * width);
  for (int64_t j = 0; j < rows; ++j) {
    float* row = send.data() + j * width;
    const int64_t slot = route.order[j];
    std::memcpy(row,
                x + kernels::RouteRowToken(route.order.data(), route.k, j) * d,
                d * sizeof(float));
    row[d] = kernels::LocalExpertTag(indices[slot], local);
    row[d + 1] = weights[slot];
  }
  std::vector<float> recv;
  SHARDD_RETURN_IF_ERROR(Exchange(route, /*reverse=*/false, width, send, &recv));
  for (int64_t i = 0; i < route.received; ++i) {
    const float* row = recv.data() + i * width;
    std::memcpy(x_r + i * d, row, d * sizeof(float));
    ids_r[i] = kernels::LocalExpertFromTag(row[d]);
    w_r[i] = row[d + 1];
  }
  return absl::OkStatus();
}

absl::Status ExpertExchange::Combine(const ExpertRoute& route, const float* y_r,
                                     int64_t d, float* y) {
  std::vector<float> send(y_r, y_r + route.received * d);
  std::vector<float> back;
  SHARDD_RETURN_IF_ERROR(Exchange(route, /*reverse=*/true, d, send, &back));
  // Slot s of token i came back at route.position[i * k + s].
  for (int64_t i = 0; i < route.t; ++i) {
    float* out = y + i * d;
    for (int64_t c = 0; c < d; ++c) {
      out[c] = kernels::CombineValue(back.data(), route.position.data(),
                                     route.k, d, i, c);
    }
  }
  return absl::OkStatus();
}

absl::Status ExpertExchange::DispatchGrad(const ExpertRoute& route,
                                          const float* dy, int64_t d,
                                          float* dy_r) {
  const int64_t rows = static_cast<int64_t>(route.order.size());
  std::vector<float> send(rows * d);
  for (int64_t j = 0; j < rows; ++j) {
    std::memcpy(send.data() + j * d,
                dy + kernels::RouteRowToken(route.order.data(), route.k, j) * d,
                d * sizeof(float));
  }
  std::vector<float> recv;
  SHARDD_RETURN_IF_ERROR(Exchange(route, /*reverse=*/false, d, send, &recv));
  std::copy(recv.begin(), recv.end(), dy_r);
  return absl::OkStatus();
}

absl::Status ExpertExchange::CombineGrad(const ExpertRoute& route,
                                         const float* dx_r, const float* dw_r,
                                         int64_t d, float* dx,
                                         float* d_weights) {
  const int64_t width = d + kernels::kCombineGradRowExtras;
  std::vector<float> send(route.received * width);
  for (int64_t i = 0; i < route.received; ++i) {
    std::memcpy(send.data() + i * width, dx_r + i * d, d * sizeof(float));
    send[i * width + d] = dw_r[i];
  }
  std::vector<float> back;
  SHARDD_RETURN_IF_ERROR(Exchange(route, /*reverse=*/true, width, send, &back));
  const std::vector<int64_t>& where = route.position;
  for (int64_t i = 0; i < route.t; ++i) {
    float* out = dx + i * d;
    for (int64_t c = 0; c < d; ++c) {
      out[c] = kernels::CombineValue(back.data(), where.data(), route.k, width,
                                     i, c);
    }
    for (int s = 0; s < route.k; ++s) {
      d_weights[i * route.k + s] = back[where[i * route.k + s] * width + d];
    }
  }
  return absl::OkStatus();
}

}  // namespace shardd
