#include "worker/comm/gloo_communicator.h"

#include <signal.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/base/call_once.h"
#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoall.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "kernels/cpu/bf16.h"
#include "worker/comm/collective_args.h"
#include "worker/comm/gloo_status.h"

namespace shardd {
namespace {

using kernels::Bf16ToFp32;
using kernels::Fp32ToBf16;

// Elements per block when reducing bf16 chunks through an fp32 accumulator
// kept on the stack.
constexpr int64_t kBf16Block = 2048;

absl::StatusOr<std::chrono::milliseconds> ToGlooTimeout(
    absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout must be positive and finite, got ",
                     absl::FormatDuration(timeout)));
  }
  const int64_t ms =
      absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1)));
  return std::chrono::milliseconds(ms);
}

template <typename T>
void WrappingSum(void* out, const void* a, const void* b, size_t n) {
  // Unsigned arithmetic: overflow wraps instead of being undefined.
  using U = std::make_unsigned_t<T>;
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  T* z = static_cast<T*>(out);
  for (size_t i = 0; i < n; ++i) {
    z[i] = static_cast<T>(static_cast<U>(x[i]) + static_cast<U>(y[i]));
  }
}

void FloatSum(void* out, const void* a, const void* b, size_t n) {
  const float* x = static_cast<const float*>(a);
  const float* y = static_cast<const float*>(b);
  float* z = static_cast<float*>(out);
  for (size_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
}

void DivideInPlace(float* x, int64_t n, int world_size) {
  const float divisor = static_cast<float>(world_size);
  for (int64_t i = 0; i < n; ++i) x[i] /= divisor;
}

// out[i] = reduction over r in 0..ranks-1 (in that order) of
// chunks[r * count + i]. `out` must not overlap `chunks`.
void ReduceChunks(const uint8_t* chunks, void* out, int64_t count, int ranks,
                  v1::DType dtype, ReduceOp op) {
  switch (dtype) {
    case v1::FLOAT32: {
      const float* in = reinterpret_cast<const float*>(chunks);
      float* dst = static_cast<float*>(out);
      std::memcpy(dst, in, count * sizeof(float));
      for (int r = 1; r < ranks; ++r) FloatSum(dst, dst, in + r * count, count);
      if (op == ReduceOp::kAvg) DivideInPlace(dst, count, ranks);
      return;
    }
    case v1::BFLOAT16: {
      const uint16_t* in = reinterpret_cast<const uint16_t*>(chunks);
      uint16_t* dst = static_cast<uint16_t*>(out);
      float acc[kBf16Block];
      for (int64_t begin = 0; begin < count; begin += kBf16Block) {
        const int64_t n = std::min(kBf16Block, count - begin);
        for (int64_t i = 0; i < n; ++i) acc[i] = Bf16ToFp32(in[begin + i]);
        for (int r = 1; r < ranks; ++r) {
          const uint16_t* chunk = in + r * count + begin;
          for (int64_t i = 0; i < n; ++i) acc[i] += Bf16ToFp32(chunk[i]);
        }
        if (op == ReduceOp::kAvg) DivideInPlace(acc, n, ranks);
        for (int64_t i = 0; i < n; ++i) dst[begin + i] = Fp32ToBf16(acc[i]);
      }
      return;
    }
    case v1::INT32: {
      const int32_t* in = reinterpret_cast<const int32_t*>(chunks);
      std::memcpy(out, in, count * sizeof(int32_t));
      for (int r = 1; r < ranks; ++r) {
        WrappingSum<int32_t>(out, out, in + r * count, count);
      }
      return;
    }
    case v1::INT64: {
      const int64_t* in = reinterpret_cast<const int64_t*>(chunks);
      std::memcpy(out, in, count * sizeof(int64_t));
      for (int r = 1; r < ranks; ++r) {
        WrappingSum<int64_t>(out, out, in + r * count, count);
      }
      return;
    }
    default:
      // Unreachable: dtypes are checked before any communication.
      throw gloo::Exception("ReduceChunks: unsupported dtype");
  }
}

// Gloo writes to sockets with writev() and expects EPIPE when a peer is
// gone; with the default SIGPIPE action the write would kill the process
// instead. Only a default action is replaced; a handler the program
// installed is left alone.
void IgnoreSigpipeUnlessHandled() {
  static absl::once_flag once;
  absl::call_once(once, [] {
    struct sigaction current;
    if (sigaction(SIGPIPE, nullptr, &current) == 0 &&
        (current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

std::string RankName(int rank, int world_size) {
  return absl::StrCat("rank ", rank, " of ", world_size);
}

}  // namespace

GlooCommunicator::GlooCommunicator(std::string prefix, int rank, int world_size)
    : prefix_(std::move(prefix)),
      rank_(rank),
      world_size_(world_size),
      args_(CollectiveArgs::Options{rank, world_size}) {}

GlooCommunicator::~GlooCommunicator() {
  try {
    context_.reset();
    device_.reset();
  } catch (...) {
    // Nothing useful to do while tearing down; never let it escape.
  }
}

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    gloo::rendezvous::Store* store, const std::string& prefix, int rank,
    int world_size, const std::string& bind_address, absl::Duration timeout) {
  if (store == nullptr) {
    return absl::InvalidArgumentError("store must not be null");
  }
  if (prefix.empty()) {
    return absl::InvalidArgumentError("prefix must not be empty");
  }
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size must be >= 1, got ", world_size));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank must be in [0, ", world_size, "), got ", rank));
  }
  if (bind_address.empty()) {
    return absl::InvalidArgumentError(
        "bind_address must not be empty (e.g. \"127.0.0.1\")");
  }
  SHARDD_ASSIGN_OR_RETURN(const std::chrono::milliseconds gloo_timeout,
                          ToGlooTimeout(timeout));

  auto comm = absl::WrapUnique(new GlooCommunicator(prefix, rank, world_size));
  if (world_size == 1) return comm;
  IgnoreSigpipeUnlessHandled();

  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = bind_address;
    comm->device_ = gloo::transport::tcp::CreateDevice(attr);
  } catch (...) {
    const absl::Status status = CurrentGlooExceptionToStatus("tcp device");
    return absl::InvalidArgumentError(
        absl::StrCat("bind_address '", bind_address,
                     "' cannot be used: ", status.message()));
  }

  try {
    auto context =
        std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    context->setTimeout(gloo_timeout);
    gloo::rendezvous::PrefixStore prefixed(prefix, *store);
    context->connectFullMesh(prefixed, comm->device_);
    comm->context_ = std::move(context);
  } catch (...) {
    return CurrentGlooExceptionToStatus(absl::StrCat(
        "rendezvous '", prefix, "' as ", RankName(rank, world_size)));
  }
  return comm;
}

absl::Status GlooCommunicator::Run(CollectiveStats CommunicatorStats::*kind,
                                   absl::string_view name, int64_t bytes,
                                   Body body) {
  const absl::Time start = absl::Now();
  absl::Status status;
  {
    absl::MutexLock lock(&op_mu_);
    if (!poisoned_.ok()) {
      status = absl::FailedPreconditionError(absl::StrCat(
          name, " on '", prefix_, "' ", RankName(rank_, world_size_),
          ": communicator unusable after an earlier failure (",
          poisoned_.ToString(), "); create a new one"));
    } else {
      const uint32_t tag = next_tag_++;
      try {
        body(tag);
      } catch (...) {
        status = CurrentGlooExceptionToStatus(absl::StrCat(
            name, " on '", prefix_, "' ", RankName(rank_, world_size_)));
      }
      if (!status.ok()) {
        poisoned_ = status;
        // Peers blocked on this rank fail now instead of at their deadline;
        // the tags of the two sides no longer line up anyway.
        if (context_ != nullptr) {
          try {
            context_->closeConnections();
          } catch (...) {
            // Already closed by the failure itself.
          }
        }
      }
    }
  }
  Record(kind, status.ok(), bytes, absl::Now() - start);
  return status;
}

absl::Status GlooCommunicator::RecordInvalid(
    CollectiveStats CommunicatorStats::*kind, absl::Status status) {
  Record(kind, /*ok=*/false, 0, absl::ZeroDuration());
  return status;
}

void GlooCommunicator::Record(CollectiveStats CommunicatorStats::*kind, bool ok,
                              int64_t bytes, absl::Duration time) {
  absl::MutexLock lock(&stats_mu_);
  CollectiveStats& s = stats_.*kind;
  ++s.calls;
  if (!ok) {
    ++s.failures;
    return;
  }
  s.bytes += bytes;
  s.time += time;
}

CommunicatorStats GlooCommunicator::stats() const {
  absl::MutexLock lock(&stats_mu_);
  return stats_;
}

absl::Status GlooCommunicator::AllGather(const void* input, void* output,
                                         int64_t count_per_rank,
                                         v1::DType dtype,
                                         absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::all_gather;
  const absl::StatusOr<CollectiveSizes> checked =
      args_.AllGather(input, output, count_per_rank, dtype, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const int64_t chunk = checked->chunk;
  const int64_t total = checked->total;
  if (chunk == 0) return Run(kKind, "AllGather", 0, [](uint32_t) {});
  const std::chrono::milliseconds gloo_timeout = *ToGlooTimeout(timeout);
  auto* out = static_cast<uint8_t*>(output);
  auto* in = const_cast<uint8_t*>(static_cast<const uint8_t*>(input));
  const bool in_place = checked->in_place;
  return Run(kKind, "AllGather", total, [&](uint32_t tag) {
    if (world_size_ == 1) {
      if (!in_place) std::memcpy(out, in, chunk);
      return;
    }
    gloo::AllgatherOptions opts(context_);
    // Gloo copies a separate input into this rank's slot; without one the
    // slot already holds it.
    if (!in_place) opts.setInput<uint8_t>(in, chunk);
    opts.setOutput<uint8_t>(out, total);
    opts.setTag(tag);
    opts.setTimeout(gloo_timeout);
    gloo::allgather(opts);
  });
}

absl::Status GlooCommunicator::ReduceScatter(const void* input, void* output,
                                             int64_t count_per_rank,
                                             v1::DType dtype, ReduceOp op,
                                             absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::reduce_scatter;
  const absl::StatusOr<CollectiveSizes> checked = args_.ReduceScatter(
      input, output, count_per_rank, dtype, op, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const int64_t total = checked->total;
  if (total == 0) return Run(kKind, "ReduceScatter", 0, [](uint32_t) {});
  const std::chrono::milliseconds gloo_timeout = *ToGlooTimeout(timeout);
  auto* in = const_cast<uint8_t*>(static_cast<const uint8_t*>(input));
  return Run(kKind, "ReduceScatter", total, [&](uint32_t tag) {
    if (world_size_ == 1) {
      // One rank: the sum is the input and dividing by 1 is exact.
      std::memmove(output, in, total);
      return;
    }
    // Receive buffer for the world_size chunks addressed to this rank;
    // reducing out of it makes any aliasing of output and input safe.
    std::unique_ptr<uint8_t[]> received(new uint8_t[total]);
    gloo::AlltoallOptions opts(context_);
    opts.setInput<uint8_t>(in, total);
    opts.setOutput<uint8_t>(received.get(), total);
    opts.setTag(tag);
    opts.setTimeout(gloo_timeout);
    gloo::alltoall(opts);
    ReduceChunks(received.get(), output, count_per_rank, world_size_, dtype,
                 op);
  });
}

absl::Status GlooCommunicator::AllToAllV(
    const void* send, const std::vector<int64_t>& send_counts, void* recv,
    const std::vector<int64_t>& recv_counts, v1::DType dtype,
    absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::all_to_all;
  const absl::StatusOr<AllToAllVBytes> checked =
      args_.AllToAllV(send, send_counts, recv, recv_counts, dtype, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const AllToAllVBytes bytes = *checked;
  const int64_t element = bytes.element;
  const std::chrono::milliseconds gloo_timeout = *ToGlooTimeout(timeout);
  return Run(kKind, "AllToAllV", bytes.send, [&](uint32_t tag) {
    const auto* in = static_cast<const uint8_t*>(send);
    auto* out = static_cast<uint8_t*>(recv);
    if (world_size_ == 1) {
      if (bytes.send > 0) std::memcpy(out, in, bytes.send);
      return;
    }
    // Gloo counts in elements of the type it is given: bytes here.
    std::vector<int64_t> send_bytes(world_size_), recv_bytes(world_size_);
    for (int r = 0; r < world_size_; ++r) {
      send_bytes[r] = send_counts[r] * element;
      recv_bytes[r] = recv_counts[r] * element;
    }
    // Gloo wants buffers even where nothing moves.
    uint8_t none = 0;
    gloo::AlltoallvOptions opts(context_);
    opts.setInput<uint8_t>(bytes.send > 0 ? const_cast<uint8_t*>(in) : &none,
                           std::move(send_bytes));
    opts.setOutput<uint8_t>(bytes.recv > 0 ? out : &none,
                            std::move(recv_bytes));
    opts.setTag(tag);
    opts.setTimeout(gloo_timeout);
    gloo::alltoallv(opts);
  });
}

absl::Status GlooCommunicator::AllReduce(void* inout, int64_t count,
                                         v1::DType dtype, ReduceOp op,
                                         absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::all_reduce;
  const absl::StatusOr<CollectiveSizes> checked =
      args_.AllReduce(inout, count, dtype, op, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const int64_t total = checked->total;
  if (total == 0) return Run(kKind, "AllReduce", 0, [](uint32_t) {});
  const std::chrono::milliseconds gloo_timeout = *ToGlooTimeout(timeout);
  return Run(kKind, "AllReduce", total, [&](uint32_t tag) {
    // One rank: the sum is the buffer itself and dividing by 1 is exact.
    if (world_size_ == 1) return;
    gloo::AllreduceOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(gloo_timeout);
    switch (dtype) {
      case v1::FLOAT32: {
        float* data = static_cast<float*>(inout);
        opts.setOutput<float>(data, count);
        opts.setReduceFunction(&FloatSum);
        gloo::allreduce(opts);
        if (op == ReduceOp::kAvg) DivideInPlace(data, count, world_size_);
        return;
      }
      case v1::BFLOAT16: {
        // No bf16 type in Gloo: reduce an fp32 copy, round once at the end.
        uint16_t* data = static_cast<uint16_t*>(inout);
        std::unique_ptr<float[]> wide(new float[count]);
        kernels::Bf16ToFp32Array(data, wide.get(), count);
        opts.setOutput<float>(wide.get(), count);
        opts.setReduceFunction(&FloatSum);
        gloo::allreduce(opts);
        if (op == ReduceOp::kAvg) DivideInPlace(wide.get(), count, world_size_);
        kernels::Fp32ToBf16Array(wide.get(), data, count);
        return;
      }
      case v1::INT32:
        opts.setOutput<int32_t>(static_cast<int32_t*>(inout), count);
        opts.setReduceFunction(&WrappingSum<int32_t>);
        gloo::allreduce(opts);
        return;
      case v1::INT64:
        opts.setOutput<int64_t>(static_cast<int64_t*>(inout), count);
        opts.setReduceFunction(&WrappingSum<int64_t>);
        gloo::allreduce(opts);
        return;
      default:
        throw gloo::Exception("AllReduce: unsupported dtype");
    }
  });
}

absl::Status GlooCommunicator::Broadcast(void* inout, int64_t count,
                                         v1::DType dtype, int root,
                                         absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::broadcast;
  const absl::StatusOr<CollectiveSizes> checked =
      args_.Broadcast(inout, count, dtype, root, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const int64_t total = checked->total;
  if (total == 0) return Run(kKind, "Broadcast", 0, [](uint32_t) {});
  const std::chrono::milliseconds gloo_timeout = *ToGlooTimeout(timeout);
  return Run(kKind, "Broadcast", total, [&](uint32_t tag) {
    if (world_size_ == 1) return;
    gloo::BroadcastOptions opts(context_);
    opts.setOutput<uint8_t>(static_cast<uint8_t*>(inout), total);
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(gloo_timeout);
    gloo::broadcast(opts);
  });
}

absl::Status GlooCommunicator::Barrier(absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::barrier;
  const absl::Status valid = args_.Barrier(timeout);
  if (!valid.ok()) return RecordInvalid(kKind, valid);
  const absl::StatusOr<std::chrono::milliseconds> gloo_timeout =
      ToGlooTimeout(timeout);
  return Run(kKind, "Barrier", 0, [&](uint32_t tag) {
    if (world_size_ == 1) return;
    gloo::BarrierOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(*gloo_timeout);
    gloo::barrier(opts);
  });
}

}  // namespace shardd
