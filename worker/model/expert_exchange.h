#ifndef SHARDD_WORKER_MODEL_EXPERT_EXCHANGE_H_
#define SHARDD_WORKER_MODEL_EXPERT_EXCHANGE_H_

// Expert parallelism's token exchange for one MoE layer
// (docs/expert_parallel.md): the ep ranks of a group each hold E / ep
// consecutive experts; a rank routes each of its t * k (token, slot) rows to
// the rank holding the slot's expert, the experts there run over the rows
// they receive, and the outputs come back to be summed per token.
//
//   Route        counts per destination, all-gathered (ep int64 per rank)
//   Dispatch     rows x[i] with the slot's local expert and weight  ->
//   (experts)    the receiving rank's local experts, top-1 per row
//   Combine      weighted outputs back  ->  y[i] = sum over the k slots
//   DispatchGrad dy[i] to every slot's expert  ->
//   CombineGrad  dx rows and weight gradients back  ->  dx[i], d_weights
//
// Rows go in (destination, token, slot) order and come back in the same
// order, and y / dx sum a token's slots in slot order, so a step is
// deterministic and independent of the exchange's timing. Buffers are host
// memory (the CPU path; the GPU's will exchange device buffers through the
// same Communicator). Each exchange is one Communicator::AllToAllV of fp32
// rows (a received row carries its local expert id as an exact float).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace shardd {

// Where one layer's rows went (Route), kept from its forward to its
// backward.
struct ExpertRoute {
  int64_t t = 0;
  int k = 0;
  // The sent rows' slots (token * k + slot), grouped by destination rank,
  // and its inverse: where each slot's row sits in that order (and so in
  // what comes back).
  std::vector<int64_t> order;
  std::vector<int64_t> position;
  std::vector<int64_t> send_counts;  // Rows per destination rank.
  std::vector<int64_t> recv_counts;  // Rows per source rank.
  int64_t received = 0;              // Sum of recv_counts.

  int64_t bytes() const {
    return static_cast<int64_t>((order.size() + position.size()) *
                                    sizeof(int64_t) +
                                (send_counts.size() + recv_counts.size()) *
                                    sizeof(int64_t));
  }
};

class ExpertExchange;

// Which share of a layer's EXPERTS a call runs: all of it, or under expert
// parallelism that of the step program's DISPATCH, EXPERTS or COMBINE
// command (proto/worker.proto), forward or backward.
enum class ExpertsPhase : uint8_t { kAll, kDispatch, kCompute, kCombine };

// A layer's experts run expert-parallel through `exchange`; the layer spec
// that goes with it holds this rank's block of E / ep experts (the
// router's choices stay global ids).
struct RoutedExchange {
  ExpertExchange* exchange = nullptr;  // Not owned.
  int64_t max_received_rows = 0;       // 0: no bound (Route).
};

class ExpertExchange {
 public:
  // `comm` (not owned, outlives this) is the expert-parallel group: its
  // world size is ep, which must divide `experts`; rank r of it holds
  // experts [r * E / ep, (r + 1) * E / ep).
  // Errors: INVALID_ARGUMENT (null comm, experts < 1 or not divisible by
  // the group's size, timeout not positive and finite).
  static absl::StatusOr<ExpertExchange> Create(Communicator* comm,
                                               int64_t experts,
                                               absl::Duration timeout);

  int ep() const { return ep_; }
  int rank() const { return rank_; }
  int64_t experts() const { return experts_; }
  int64_t local_experts() const { return experts_ / ep_; }
  // The first global expert this rank holds.
  int64_t first_expert() const { return rank_ * local_experts(); }

  // Routes the t * k rows of `indices` [t, k] (global expert ids) and
  // exchanges the counts; `max_received_rows` bounds the rows this rank's
  // experts accept (0: no bound; the plan's capacity factor times t * k).
  // Errors: INVALID_ARGUMENT (an expert id outside
  // [0, experts)), RESOURCE_EXHAUSTED (more rows arrive than
  // max_received_rows allows, naming the bound), the communicator's.
  absl::Status Route(const int32_t* indices, int64_t t, int k,
                     int64_t max_received_rows, ExpertRoute* route);

  // x [t, d] and weights [t, k] of the routed rows -> the received rows
  // x_r [R, d], their local expert ids [R] and weights [R] (R =
  // route.received; the outputs hold that many rows).
  absl::Status Dispatch(const ExpertRoute& route, const float* x,
                        const float* weights, const int32_t* indices,
                        int64_t d, float* x_r, int32_t* ids_r, float* w_r);
  // y_r [R, d] back to their senders: y [t, d] = the sum of each token's k
  // rows (overwritten).
  absl::Status Combine(const ExpertRoute& route, const float* y_r, int64_t d,
                       float* y);
  // dy [t, d] to every slot's expert: dy_r [R, d].
  absl::Status DispatchGrad(const ExpertRoute& route, const float* dy,
                            int64_t d, float* dy_r);
  // dx_r [R, d] and dw_r [R] back: dx [t, d] = the sum of each token's k
  // rows (overwritten) and d_weights [t, k].
  absl::Status CombineGrad(const ExpertRoute& route, const float* dx_r,
                           const float* dw_r, int64_t d, float* dx,
                           float* d_weights);

 private:
  ExpertExchange(Communicator* comm, int64_t experts, absl::Duration timeout)
      : comm_(comm),
        experts_(experts),
        ep_(comm->world_size()),
        rank_(comm->rank()),
        timeout_(timeout) {}

  // One exchange of rows of `width` floats: send (in route order) ->
  // recv (in source-rank order), or the reverse.
  absl::Status Exchange(const ExpertRoute& route, bool reverse, int64_t width,
                        const std::vector<float>& send,
                        std::vector<float>* recv);

  Communicator* comm_;
  int64_t experts_;
  int ep_;
  int rank_;
  absl::Duration timeout_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_EXPERT_EXCHANGE_H_
