#include "worker/comm/collective_args.h"

#include <cstdint>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace shardd {

bool IsReducibleDType(v1::DType dtype) {
  return dtype == v1::FLOAT32 || dtype == v1::BFLOAT16 || dtype == v1::INT32 ||
         dtype == v1::INT64;
}

absl::StatusOr<int64_t> CollectiveElementBytes(v1::DType dtype,
                                               bool needs_reduction,
                                               ReduceOp op) {
  const int64_t bytes = DTypeBytes(dtype);
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", v1::DType_Name(dtype),
                     " is not supported; allowed: FLOAT32, BFLOAT16, FLOAT16, "
                     "FLOAT8_E4M3, INT32, INT64"));
  }
  if (needs_reduction) {
    if (!IsReducibleDType(dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype ", v1::DType_Name(dtype),
          " cannot be reduced; allowed: FLOAT32, BFLOAT16, INT32, INT64"));
    }
    if (op == ReduceOp::kAvg && (dtype == v1::INT32 || dtype == v1::INT64)) {
      return absl::InvalidArgumentError(
          absl::StrCat("op kAvg needs a float dtype, got ",
                       v1::DType_Name(dtype), "; use kSum"));
    }
  }
  return bytes;
}

absl::StatusOr<int64_t> CollectiveBufferBytes(int64_t count, int64_t ranks,
                                              int64_t element_bytes,
                                              absl::string_view count_name) {
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(count_name, " must be >= 0, got ", count));
  }
  const int64_t per_element = ranks * element_bytes;
  if (count > std::numeric_limits<int64_t>::max() / per_element) {
    return absl::InvalidArgumentError(
        absl::StrCat(count_name, " ", count, " overflows the buffer size"));
  }
  return count * per_element;
}

absl::StatusOr<AllToAllVBytes> CollectiveAllToAllVBytes(
    const std::vector<int64_t>& send_counts,
    const std::vector<int64_t>& recv_counts, int rank, int world_size,
    int64_t element_bytes) {
  AllToAllVBytes out;
  for (const auto& [counts, name, total] :
       {std::make_tuple(&send_counts, "send_counts", &out.send),
        std::make_tuple(&recv_counts, "recv_counts", &out.recv)}) {
    if (static_cast<int64_t>(counts->size()) != world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must have one entry per rank (", world_size,
                       "), got ", counts->size()));
    }
    int64_t elements = 0;
    for (size_t r = 0; r < counts->size(); ++r) {
      const int64_t c = (*counts)[r];
      if (c < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, "[", r, "] must be >= 0, got ", c));
      }
      if (__builtin_add_overflow(elements, c, &elements)) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": the total overflows int64"));
      }
    }
    SHARDD_ASSIGN_OR_RETURN(
        *total, CollectiveBufferBytes(elements, 1, element_bytes, name));
  }
  out.element = element_bytes;
  if (rank < 0 || rank >= world_size ||
      send_counts[rank] != recv_counts[rank]) {
    return absl::InvalidArgumentError(
        absl::StrCat("recv_counts[", rank, "] must equal send_counts[", rank,
                     "] (the piece this rank sends itself)"));
  }
  return out;
}

absl::Status CheckCollectiveBuffer(const void* ptr, int64_t bytes,
                                   absl::string_view name) {
  if (ptr == nullptr && bytes > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must not be null when the count is positive"));
  }
  return absl::OkStatus();
}

absl::Status CheckPositiveFinite(absl::Duration duration,
                                 absl::string_view name) {
  if (duration <= absl::ZeroDuration() ||
      duration == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be positive and finite, got ",
                     absl::FormatDuration(duration)));
  }
  return absl::OkStatus();
}

namespace {

bool Disjoint(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return a_bytes == 0 || b_bytes == 0 || x + a_bytes <= y || y + b_bytes <= x;
}

}  // namespace

absl::StatusOr<CollectiveSizes> CollectiveArgs::Sizes(
    v1::DType dtype, bool reduces, ReduceOp op, int64_t count, int ranks,
    absl::string_view count_name, absl::Duration timeout) const {
  CollectiveSizes s;
  SHARDD_ASSIGN_OR_RETURN(s.element,
                          CollectiveElementBytes(dtype, reduces, op));
  SHARDD_ASSIGN_OR_RETURN(
      s.chunk, CollectiveBufferBytes(count, 1, s.element, count_name));
  SHARDD_ASSIGN_OR_RETURN(
      s.total, CollectiveBufferBytes(count, ranks, s.element, count_name));
  SHARDD_RETURN_IF_ERROR(CheckPositiveFinite(timeout, "timeout"));
  return s;
}

absl::StatusOr<CollectiveSizes> CollectiveArgs::AllGather(
    const void* input, const void* output, int64_t count_per_rank,
    v1::DType dtype, absl::Duration timeout) const {
  SHARDD_ASSIGN_OR_RETURN(
      CollectiveSizes s,
      Sizes(dtype, /*reduces=*/false, ReduceOp::kSum, count_per_rank,
            options_.world_size, "count_per_rank", timeout));
  SHARDD_RETURN_IF_ERROR(options_.check_buffer(input, s.chunk, "input"));
  SHARDD_RETURN_IF_ERROR(options_.check_buffer(output, s.total, "output"));
  s.in_place = input == static_cast<const char*>(output) +
                            int64_t{options_.rank} * s.chunk;
  if (!s.in_place && !Disjoint(input, s.chunk, output, s.total)) {
    return absl::InvalidArgumentError(
        "input overlaps output other than as this rank's slot");
  }
  return s;
}

absl::StatusOr<CollectiveSizes> CollectiveArgs::ReduceScatter(
    const void* input, const void* output, int64_t count_per_rank,
    v1::DType dtype, ReduceOp op, absl::Duration timeout) const {
  SHARDD_ASSIGN_OR_RETURN(
      CollectiveSizes s, Sizes(dtype, /*reduces=*/true, op, count_per_rank,
                               options_.world_size, "count_per_rank", timeout));
  SHARDD_RETURN_IF_ERROR(options_.check_buffer(input, s.total, "input"));
  SHARDD_RETURN_IF_ERROR(options_.check_buffer(output, s.chunk, "output"));
  s.in_place = output == static_cast<const char*>(input) +
                             int64_t{options_.rank} * s.chunk;
  if (!options_.reduce_scatter_overlap_anywhere && !s.in_place &&
      !Disjoint(input, s.total, output, s.chunk)) {
    return absl::InvalidArgumentError(
        "output overlaps input other than as this rank's chunk (this "
        "backend's reduce-scatter is in place only there)");
  }
  return s;
}

absl::StatusOr<CollectiveSizes> CollectiveArgs::AllReduce(
    const void* inout, int64_t count, v1::DType dtype, ReduceOp op,
    absl::Duration timeout) const {
  SHARDD_ASSIGN_OR_RETURN(CollectiveSizes s, Sizes(dtype, /*reduces=*/true, op,
                                                   count, 1, "count", timeout));
  SHARDD_RETURN_IF_ERROR(options_.check_buffer(inout, s.total, "inout"));
  s.in_place = true;
  return s;
}

absl::StatusOr<CollectiveSizes> CollectiveArgs::Broadcast(
    const void* inout, int64_t count, v1::DType dtype, int root,
    absl::Duration timeout) const {
  if (root < 0 || root >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "root must be in [0, ", options_.world_size, "), got ", root));
  }
  SHARDD_ASSIGN_OR_RETURN(CollectiveSizes s,
                          Sizes(dtype, /*reduces=*/false, ReduceOp::kSum, count,
                                1, "count", timeout));
  SHARDD_RETURN_IF_ERROR(options_.check_buffer(inout, s.total, "inout"));
  s.in_place = true;
  return s;
}

absl::StatusOr<AllToAllVBytes> CollectiveArgs::AllToAllV(
    const void* send, const std::vector<int64_t>& send_counts, const void* recv,
    const std::vector<int64_t>& recv_counts, v1::DType dtype,
    absl::Duration timeout) const {
  SHARDD_ASSIGN_OR_RETURN(const int64_t element,
                          CollectiveElementBytes(dtype, false, ReduceOp::kSum));
  SHARDD_ASSIGN_OR_RETURN(
      const AllToAllVBytes bytes,
      CollectiveAllToAllVBytes(send_counts, recv_counts, options_.rank,
                               options_.world_size, element));
  SHARDD_RETURN_IF_ERROR(CheckPositiveFinite(timeout, "timeout"));
  SHARDD_RETURN_IF_ERROR(options_.check_buffer(send, bytes.send, "send"));
  SHARDD_RETURN_IF_ERROR(options_.check_buffer(recv, bytes.recv, "recv"));
  if (!Disjoint(send, bytes.send, recv, bytes.recv)) {
    return absl::InvalidArgumentError("send and recv must not overlap");
  }
  return bytes;
}

absl::Status CollectiveArgs::Barrier(absl::Duration timeout) const {
  return CheckPositiveFinite(timeout, "timeout");
}

}  // namespace shardd
