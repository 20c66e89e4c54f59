#include "kernels/cuda/grouped_experts.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "kernels/cuda/bias_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/grouped_experts_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using internal::DeviceDtype;
using internal::DeviceGate;
using internal::ExpertOperand;

static_assert(kMaxGroupedExperts == internal::kMaxRoutingExperts,
              "public and kernel expert limits must agree");

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
constexpr uint64_t kRegionAlign = 256;
constexpr uint32_t kNoBadSlot = 0xFFFFFFFFu;

// The six per-expert GEMMs; each has its own device pointer arrays and host
// argument arrays so no call reuses another's buffers.
enum GemmSlot : int {
  kGateUpForward = 0,  // H = Xs @ W_gu[e]
  kDownForward,        // O = A @ W_d[e]
  kDownDgrad,          // dA = dO @ W_d[e]^T
  kDownWgrad,          // dW_d[e] += A^T @ dO
  kGateUpWgrad,        // dW_gu[e] += Xs^T @ dH
  kGateUpDgrad,        // dXs = dH @ W_gu[e]^T
  kGemmSlots,
};

// Byte offsets of the device workspace regions.
struct Layout {
  uint64_t status = 0;         // uint32 [1 + E]: bad slot, then rows per expert
  uint64_t chunk_counts = 0;   // int32 [chunks, E]
  uint64_t offsets = 0;        // int32 [E + 1]
  uint64_t nonempty = 0;       // int32 [E]
  uint64_t row_of_slot = 0;    // int32 [T*K]
  uint64_t row_token = 0;      // int32 [T*K]
  uint64_t row_weight = 0;     // fp32 [T*K]
  uint64_t row_dweight = 0;    // fp32 [T*K]
  uint64_t gemm_pointers = 0;  // void* [kGemmSlots, 3, E]
  uint64_t xs = 0;             // storage [T*K, D]   saved
  uint64_t h = 0;              // storage [T*K, 2I]  saved
  uint64_t a = 0;              // storage [T*K, I]   saved
  uint64_t o = 0;              // storage [T*K, D]   O, then dO, then dXs
  uint64_t da = 0;             // storage [T*K, I]
  uint64_t dh = 0;             // storage [T*K, 2I]
  uint64_t total = 0;
};

// Hands out 256-byte aligned regions; records overflow instead of wrapping.
class LayoutBuilder {
 public:
  uint64_t Take(uint64_t count, uint64_t elem_bytes) {
    uint64_t bytes = 0, start = 0, end = 0;
    if (__builtin_mul_overflow(count, elem_bytes, &bytes) ||
        __builtin_add_overflow(next_, kRegionAlign - 1, &start)) {
      overflow_ = true;
      return 0;
    }
    start &= ~(kRegionAlign - 1);
    if (__builtin_add_overflow(start, bytes, &end)) {
      overflow_ = true;
      return 0;
    }
    next_ = end;
    return start;
  }
  bool overflow() const { return overflow_; }
  uint64_t size() const { return next_; }

 private:
  uint64_t next_ = 0;
  bool overflow_ = false;
};

uint64_t ElementBytes(ExpertStorage storage) {
  return storage == ExpertStorage::kFloat32 ? 4 : 2;
}

DeviceDtype ToDeviceDtype(ExpertStorage storage) {
  return storage == ExpertStorage::kFloat32 ? DeviceDtype::kFloat32
                                            : DeviceDtype::kBFloat16;
}

DeviceGate ToDeviceGate(GatedActivation activation) {
  switch (activation) {
    case GatedActivation::kSwiGLU:
      return DeviceGate::kSilu;
    case GatedActivation::kGeGLU:
      return DeviceGate::kGeluTanh;
    case GatedActivation::kClampedSwiGLU:
      break;
  }
  return DeviceGate::kClampedSilu;
}

internal::GateParams ToGateParams(const GroupedExpertsOptions& o) {
  return {o.alpha, o.limit};
}

DType ToDType(ExpertStorage storage) {
  return storage == ExpertStorage::kFloat32 ? DType::kFloat32
                                            : DType::kBFloat16;
}

absl::StatusOr<Layout> ComputeLayout(const ExpertDims& d,
                                     ExpertStorage storage) {
  SHARDD_RETURN_IF_ERROR(ValidateExpertDims(d));
  const uint64_t slots = static_cast<uint64_t>(d.tokens * d.top_k);
  const uint64_t e = static_cast<uint64_t>(d.experts);
  const uint64_t chunks = static_cast<uint64_t>(
      internal::RoutingChunks(static_cast<int64_t>(slots)));
  const uint64_t dim = static_cast<uint64_t>(d.dim);
  const uint64_t inter = static_cast<uint64_t>(d.intermediate);
  const uint64_t s = ElementBytes(storage);
  LayoutBuilder b;
  Layout l;
  l.status = b.Take(1 + e, 4);
  l.chunk_counts = b.Take(chunks * e, 4);  // chunks * e < 2^31 * 2^13
  l.offsets = b.Take(e + 1, 4);
  l.nonempty = b.Take(e, 4);
  l.row_of_slot = b.Take(slots, 4);
  l.row_token = b.Take(slots, 4);
  l.row_weight = b.Take(slots, 4);
  l.row_dweight = b.Take(slots, 4);
  l.gemm_pointers = b.Take(kGemmSlots * 3 * e, sizeof(void*));
  // slots, dim and 2 * inter are each below 2^31, so each product of two
  // fits in 64 bits; Take checks the multiplication by s.
  l.xs = b.Take(slots * dim, s);
  l.h = b.Take(slots * 2 * inter, s);
  l.a = b.Take(slots * inter, s);
  l.o = b.Take(slots * dim, s);
  l.da = b.Take(slots * inter, s);
  l.dh = b.Take(slots * 2 * inter, s);
  if (b.overflow() || b.size() > std::numeric_limits<size_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "experts workspace size overflows size_t for tokens=", d.tokens,
        " top_k=", d.top_k, " dim=", d.dim, " intermediate=", d.intermediate));
  }
  l.total = b.size();
  return l;
}

bool SameDims(const ExpertDims& a, const ExpertDims& b) {
  return a.tokens == b.tokens && a.dim == b.dim &&
         a.intermediate == b.intermediate && a.experts == b.experts &&
         a.top_k == b.top_k;
}

absl::Status ValidateOptions(const GroupedExpertsOptions& o) {
  if (o.activation != GatedActivation::kSwiGLU &&
      o.activation != GatedActivation::kGeGLU &&
      o.activation != GatedActivation::kClampedSwiGLU) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts options.activation must be kSwiGLU, kGeGLU or "
                     "kClampedSwiGLU, got ",
                     static_cast<int>(o.activation)));
  }
  if (o.activation == GatedActivation::kClampedSwiGLU &&
      !(o.alpha > 0 && o.limit > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts clamped SwiGLU needs alpha and limit > 0, got ",
                     o.alpha, " and ", o.limit));
  }
  if (o.storage != ExpertStorage::kFloat32 &&
      o.storage != ExpertStorage::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts options.storage must be kFloat32 or kBFloat16, "
                     "got ",
                     static_cast<int>(o.storage)));
  }
  if (o.gemm_path != ExpertGemmPath::kGrouped &&
      o.gemm_path != ExpertGemmPath::kPerExpertLoop &&
      o.gemm_path != ExpertGemmPath::kAuto) {
    return absl::InvalidArgumentError(absl::StrCat(
        "experts options.gemm_path must be kGrouped, kPerExpertLoop or kAuto, "
        "got ",
        static_cast<int>(o.gemm_path)));
  }
  return absl::OkStatus();
}

struct NamedPointer {
  const char* name;
  const void* pointer;
};

absl::Status RequireNonNull(std::initializer_list<NamedPointer> pointers,
                            const char* when) {
  for (const NamedPointer& p : pointers) {
    if (p.pointer == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("experts ", p.name, " must not be null", when));
    }
  }
  return absl::OkStatus();
}

// Runs the op's cuBLAS calls on `stream` in host pointer mode (the grouped
// GEMM supports no other) and puts the handle back as it was.
class CublasScope {
 public:
  CublasScope() = default;
  CublasScope(const CublasScope&) = delete;
  CublasScope& operator=(const CublasScope&) = delete;
  ~CublasScope() {
    if (handle_ == nullptr) return;
    if (restore_stream_) cublasSetStream(handle_, old_stream_);
    if (restore_mode_) cublasSetPointerMode(handle_, old_mode_);
  }

  absl::Status Enter(cublasHandle_t handle, cudaStream_t stream) {
    handle_ = handle;
    SHARDD_RETURN_IF_ERROR(
        CublasStatus(cublasGetStream(handle, &old_stream_), "cublasGetStream"));
    SHARDD_RETURN_IF_ERROR(CublasStatus(
        cublasGetPointerMode(handle, &old_mode_), "cublasGetPointerMode"));
    if (old_stream_ != stream) {
      SHARDD_RETURN_IF_ERROR(
          CublasStatus(cublasSetStream(handle, stream), "cublasSetStream"));
      restore_stream_ = true;
    }
    if (old_mode_ != CUBLAS_POINTER_MODE_HOST) {
      SHARDD_RETURN_IF_ERROR(
          CublasStatus(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST),
                       "cublasSetPointerMode"));
      restore_mode_ = true;
    }
    return absl::OkStatus();
  }

 private:
  cublasHandle_t handle_ = nullptr;
  cudaStream_t old_stream_ = nullptr;
  cublasPointerMode_t old_mode_ = CUBLAS_POINTER_MODE_HOST;
  bool restore_stream_ = false;
  bool restore_mode_ = false;
};

// Host-side argument arrays of one cublasGemmGroupedBatchedEx call, sized
// for max_experts groups once.
struct GroupedGemmArgs {
  std::vector<cublasOperation_t> trans_a, trans_b;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size;
  std::vector<float> alpha, beta;

  void Resize(size_t groups) {
    trans_a.resize(groups);
    trans_b.resize(groups);
    m.resize(groups);
    n.resize(groups);
    k.resize(groups);
    lda.resize(groups);
    ldb.resize(groups);
    ldc.resize(groups);
    group_size.resize(groups);
    alpha.resize(groups);
    beta.resize(groups);
  }
};

}  // namespace

struct GroupedExpertsWorkspace::State {
  char* device = nullptr;
  size_t device_bytes = 0;
  int64_t max_experts = 0;
  uint32_t* pinned_status = nullptr;  // [1 + max_experts], pinned
  cudaEvent_t status_ready = nullptr;
  int64_t host_syncs = 0;

  // The last successful forward.
  bool has_forward = false;
  ExpertDims dims;
  GroupedExpertsOptions options;
  Layout layout;
  int64_t rows = 0;
  std::vector<int32_t> expert_rows;  // [max_experts]; first E valid
  std::vector<int64_t> offsets;      // [max_experts + 1]
  std::vector<int32_t> nonempty;     // [max_experts]; first `groups` valid
  int64_t groups = 0;

  std::array<GroupedGemmArgs, kGemmSlots> gemm_args;

  template <typename T>
  T* At(uint64_t offset) const {
    return reinterpret_cast<T*>(device + offset);
  }
};

namespace {

using State = GroupedExpertsWorkspace::State;

// One per-expert GEMM in row-major terms: C = op(A) @ op(B) (+ C when
// beta = 1), with M = n_e for the data GEMMs and K = n_e for the weight
// gradients. Row-major X is column-major X^T, so cuBLAS computes
// C^T = op(B)^T op(A)^T: operands swapped, flags unchanged.
struct ExpertGemm {
  GemmSlot slot;
  const char* what;
  bool trans_a = false;
  bool trans_b = false;
  bool rows_are_k = false;
  int64_t fixed = 0;  // K when rows_are_k is false, else M
  int64_t n = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;  // row lengths of the stored matrices
  ExpertOperand a, b, c;
  cudaDataType_t ab_type = CUDA_R_16BF;
  cudaDataType_t c_type = CUDA_R_16BF;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  float beta = 0.0f;
};

const void* OperandAt(const ExpertOperand& op, int64_t expert, int64_t row) {
  return static_cast<const char*>(op.base) + row * op.row_stride_bytes +
         expert * op.expert_stride_bytes;
}

absl::Status RunExpertGemm(const ExpertGemm& g, ExpertGemmPath path, State& st,
                           cublasHandle_t handle, cudaStream_t stream) {
  const int64_t groups = st.groups;
  if (groups == 0) return absl::OkStatus();
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const float alpha = 1.0f;
  // cuBLAS' grouped GEMM writes only the input type (bf16 -> bf16 or
  // fp32 -> fp32); fp32 accumulation from bf16 inputs takes the loop.
  int64_t total_rows = 0;
  for (int64_t j = 0; j < groups; ++j)
    total_rows += st.expert_rows[st.nonempty[j]];
  const bool grouped =
      g.ab_type == g.c_type &&
      (path == ExpertGemmPath::kGrouped ||
       (path == ExpertGemmPath::kAuto && total_rows < kAutoLoopRows * groups));
  if (!grouped) {
    for (int64_t j = 0; j < groups; ++j) {
      const int32_t e = st.nonempty[j];
      const int64_t rows = st.expert_rows[e], row = st.offsets[e];
      const int64_t m = g.rows_are_k ? g.fixed : rows;
      const int64_t k = g.rows_are_k ? rows : g.fixed;
      SHARDD_RETURN_IF_ERROR(CublasStatus(
          cublasGemmEx(handle, op_b, op_a, static_cast<int>(g.n),
                       static_cast<int>(m), static_cast<int>(k), &alpha,
                       OperandAt(g.b, e, row), g.ab_type,
                       static_cast<int>(g.ldb), OperandAt(g.a, e, row),
                       g.ab_type, static_cast<int>(g.lda), &g.beta,
                       const_cast<void*>(OperandAt(g.c, e, row)), g.c_type,
                       static_cast<int>(g.ldc), g.compute, CUBLAS_GEMM_DEFAULT),
          absl::StrCat("cublasGemmEx ", g.what, " expert ", e)));
    }
    return absl::OkStatus();
  }

  // Device pointer arrays, built on the device from the device offsets:
  // [0, G) A, [G, 2G) B, [2G, 3G) C in row-major terms.
  void** pointers = st.At<void*>(st.layout.gemm_pointers) +
                    static_cast<int64_t>(g.slot) * 3 * st.dims.experts;
  SHARDD_CUDA_RETURN_IF_ERROR(
      internal::LaunchExpertGemmPointers(
          g.a, g.b, g.c, st.At<int32_t>(st.layout.nonempty),
          st.At<int32_t>(st.layout.offsets), groups, pointers, stream),
      absl::StrCat("experts GEMM pointers ", g.what));
  GroupedGemmArgs& args = st.gemm_args[g.slot];
  for (int64_t j = 0; j < groups; ++j) {
    const int64_t rows = st.expert_rows[st.nonempty[j]];
    args.trans_a[j] = op_b;
    args.trans_b[j] = op_a;
    args.m[j] = static_cast<int>(g.n);
    args.n[j] = static_cast<int>(g.rows_are_k ? g.fixed : rows);
    args.k[j] = static_cast<int>(g.rows_are_k ? rows : g.fixed);
    args.lda[j] = static_cast<int>(g.ldb);
    args.ldb[j] = static_cast<int>(g.lda);
    args.ldc[j] = static_cast<int>(g.ldc);
    args.group_size[j] = 1;
    args.alpha[j] = 1.0f;
    args.beta[j] = g.beta;
  }
  return CublasStatus(
      cublasGemmGroupedBatchedEx(
          handle, args.trans_a.data(), args.trans_b.data(), args.m.data(),
          args.n.data(), args.k.data(), args.alpha.data(),
          const_cast<const void* const*>(pointers + groups), g.ab_type,
          args.lda.data(), const_cast<const void* const*>(pointers), g.ab_type,
          args.ldb.data(), args.beta.data(), pointers + 2 * groups, g.c_type,
          args.ldc.data(), static_cast<int>(groups), args.group_size.data(),
          g.compute),
      absl::StrCat("cublasGemmGroupedBatchedEx ", g.what));
}

cudaDataType_t StorageDataType(ExpertStorage storage) {
  return storage == ExpertStorage::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
}

cublasComputeType_t StorageCompute(ExpertStorage storage) {
  // PEDANTIC keeps fp32 storage in true fp32 even if the handle allows TF32.
  return storage == ExpertStorage::kFloat32 ? CUBLAS_COMPUTE_32F_PEDANTIC
                                            : CUBLAS_COMPUTE_32F;
}

ExpertOperand RowsOperand(const void* base, int64_t row_elems,
                          uint64_t elem_bytes) {
  ExpertOperand op;
  op.base = base;
  op.row_stride_bytes = row_elems * static_cast<int64_t>(elem_bytes);
  return op;
}

ExpertOperand ExpertsOperand(const void* base, int64_t expert_elems,
                             uint64_t elem_bytes) {
  ExpertOperand op;
  op.base = base;
  op.expert_stride_bytes = expert_elems * static_cast<int64_t>(elem_bytes);
  return op;
}

}  // namespace

absl::Status ValidateExpertDims(const ExpertDims& d) {
  if (d.tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts tokens must be >= 0, got ", d.tokens));
  }
  if (d.dim < 1 || d.dim > kMaxInt) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts dim must be in [1, ", kMaxInt, "], got ", d.dim));
  }
  if (d.intermediate < 1 || d.intermediate > kMaxInt / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts intermediate must be in [1, ", kMaxInt / 2,
                     "], got ", d.intermediate));
  }
  if (d.experts < 1 || d.experts > kMaxGroupedExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts count must be in [1, ", kMaxGroupedExperts,
                     "], got ", d.experts));
  }
  if (d.top_k < 1 || d.top_k > d.experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts top_k must be in [1, experts=", d.experts,
                     "], got ", d.top_k));
  }
  if (d.tokens > kMaxInt / d.top_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts tokens * top_k must be at most ", kMaxInt,
                     ", got ", d.tokens, " * ", d.top_k));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> GroupedExpertsWorkspaceBytes(const ExpertDims& dims,
                                                    ExpertStorage storage) {
  if (storage != ExpertStorage::kFloat32 &&
      storage != ExpertStorage::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts storage must be kFloat32 or kBFloat16, got ",
                     static_cast<int>(storage)));
  }
  SHARDD_ASSIGN_OR_RETURN(const Layout layout, ComputeLayout(dims, storage));
  return static_cast<size_t>(layout.total);
}

GroupedExpertsWorkspace::GroupedExpertsWorkspace(std::unique_ptr<State> state)
    : state_(std::move(state)) {}

GroupedExpertsWorkspace::~GroupedExpertsWorkspace() {
  if (state_->pinned_status != nullptr) cudaFreeHost(state_->pinned_status);
  if (state_->status_ready != nullptr) cudaEventDestroy(state_->status_ready);
}

absl::StatusOr<std::unique_ptr<GroupedExpertsWorkspace>>
GroupedExpertsWorkspace::Create(void* device_memory, size_t device_bytes,
                                int64_t max_experts) {
  if (device_memory == nullptr && device_bytes > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "experts workspace device_memory must not be null with device_bytes=",
        device_bytes));
  }
  if (max_experts < 1 || max_experts > kMaxGroupedExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts workspace max_experts must be in [1, ",
                     kMaxGroupedExperts, "], got ", max_experts));
  }
  auto state = std::make_unique<State>();
  state->device = static_cast<char*>(device_memory);
  state->device_bytes = device_bytes;
  state->max_experts = max_experts;
  state->expert_rows.assign(max_experts, 0);
  state->offsets.assign(max_experts + 1, 0);
  state->nonempty.assign(max_experts, 0);
  for (GroupedGemmArgs& args : state->gemm_args) args.Resize(max_experts);
  // The destructor frees whatever was allocated if a later step fails.
  std::unique_ptr<GroupedExpertsWorkspace> ws(
      new GroupedExpertsWorkspace(std::move(state)));
  State& st = *ws->state_;
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMallocHost(reinterpret_cast<void**>(&st.pinned_status),
                     sizeof(uint32_t) * (1 + max_experts)),
      "experts workspace cudaMallocHost");
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&st.status_ready, cudaEventDisableTiming),
      "experts workspace cudaEventCreate");
  return ws;
}

int64_t GroupedExpertsWorkspace::host_syncs() const {
  return state_->host_syncs;
}

bool GroupedExpertsWorkspace::has_forward() const {
  return state_->has_forward;
}

int64_t GroupedExpertsWorkspace::rows() const {
  return state_->has_forward ? state_->rows : 0;
}

absl::Span<const int32_t> GroupedExpertsWorkspace::expert_rows() const {
  if (!state_->has_forward) return {};
  return absl::Span<const int32_t>(state_->expert_rows.data(),
                                   static_cast<size_t>(state_->dims.experts));
}

const int32_t* GroupedExpertsWorkspace::device_row_of_slot() const {
  if (!state_->has_forward || state_->dims.tokens == 0) return nullptr;
  return state_->At<int32_t>(state_->layout.row_of_slot);
}

size_t GroupedExpertsWorkspace::device_bytes() const {
  return state_->device_bytes;
}

absl::Status GroupedExpertsForward(const ExpertDims& dims,
                                   const GroupedExpertsOptions& options,
                                   const void* x, const int32_t* indices,
                                   const float* weights, const bool* token_mask,
                                   const void* w_gu, const void* w_d, void* y,
                                   GroupedExpertsWorkspace* ws,
                                   cublasHandle_t cublas, cudaStream_t stream) {
  SHARDD_RETURN_IF_ERROR(ValidateExpertDims(dims));
  SHARDD_RETURN_IF_ERROR(ValidateOptions(options));
  const int64_t t_count = dims.tokens, d = dims.dim, inter = dims.intermediate,
                e_count = dims.experts, k = dims.top_k;
  if (t_count > 0) {
    SHARDD_RETURN_IF_ERROR(RequireNonNull({{"x", x},
                                           {"indices", indices},
                                           {"weights", weights},
                                           {"w_gu", w_gu},
                                           {"w_d", w_d},
                                           {"y", y},
                                           {"cublas handle", cublas}},
                                          " when tokens > 0"));
  }
  if (ws == nullptr) {
    return absl::InvalidArgumentError("experts workspace must not be null");
  }
  State& st = *ws->state_;
  if (e_count > st.max_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts count ", e_count,
                     " exceeds the workspace's max_experts ", st.max_experts));
  }
  SHARDD_ASSIGN_OR_RETURN(const Layout layout,
                          ComputeLayout(dims, options.storage));
  if (layout.total > st.device_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts workspace has ", st.device_bytes,
                     " device bytes, these dims "
                     "need ",
                     layout.total, " (GroupedExpertsWorkspaceBytes)"));
  }

  st.has_forward = false;
  st.dims = dims;
  st.options = options;
  st.layout = layout;
  if (t_count == 0) {
    std::fill(st.expert_rows.begin(), st.expert_rows.begin() + e_count, 0);
    std::fill(st.offsets.begin(), st.offsets.begin() + e_count + 1, 0);
    st.rows = 0;
    st.groups = 0;
    st.has_forward = true;
    return absl::OkStatus();
  }

  CublasScope scope;
  SHARDD_RETURN_IF_ERROR(scope.Enter(cublas, stream));
  const DeviceDtype dtype = ToDeviceDtype(options.storage);
  const uint64_t s = ElementBytes(options.storage);
  const int64_t chunks = internal::RoutingChunks(t_count * k);
  uint32_t* status = st.At<uint32_t>(layout.status);
  int32_t* chunk_counts = st.At<int32_t>(layout.chunk_counts);
  int32_t* offsets = st.At<int32_t>(layout.offsets);
  int32_t* row_of_slot = st.At<int32_t>(layout.row_of_slot);
  int32_t* row_token = st.At<int32_t>(layout.row_token);
  float* row_weight = st.At<float>(layout.row_weight);
  void* xs = st.At<void>(layout.xs);
  void* h = st.At<void>(layout.h);
  void* a = st.At<void>(layout.a);
  void* o = st.At<void>(layout.o);

  // Routing counts, then the one host wait: the grouped GEMMs need them on
  // the host. The placement and the gather are enqueued before waiting so
  // they overlap the copy and the wait.
  SHARDD_CUDA_RETURN_IF_ERROR(
      internal::LaunchRoutingCount(indices, token_mask, t_count, k, e_count,
                                   chunk_counts, status, stream),
      "experts routing count");
  SHARDD_CUDA_RETURN_IF_ERROR(
      internal::LaunchRoutingScan(
          chunk_counts, chunks, e_count, reinterpret_cast<int32_t*>(status + 1),
          offsets, st.At<int32_t>(layout.nonempty), stream),
      "experts routing scan");
  SHARDD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.pinned_status, status,
                                              sizeof(uint32_t) * (1 + e_count),
                                              cudaMemcpyDeviceToHost, stream),
                              "experts routing counts to host");
  SHARDD_CUDA_RETURN_IF_ERROR(cudaEventRecord(st.status_ready, stream),
                              "experts routing counts event");
  SHARDD_CUDA_RETURN_IF_ERROR(
      internal::LaunchRoutingPlace(indices, token_mask, weights, t_count, k,
                                   e_count, chunk_counts, offsets, row_of_slot,
                                   row_token, row_weight, stream),
      "experts routing place");
  SHARDD_CUDA_RETURN_IF_ERROR(
      internal::LaunchGatherRows(dtype, x, row_of_slot, t_count, k, d, xs,
                                 stream),
      "experts gather x");
  ++st.host_syncs;
  SHARDD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(st.status_ready),
                              "experts wait for routing counts");

  const uint32_t bad_slot = st.pinned_status[0];
  if (bad_slot != kNoBadSlot) {
    int32_t value = 0;
    ++st.host_syncs;
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&value, indices + bad_slot, sizeof(value),
                        cudaMemcpyDeviceToHost, stream),
        "experts read bad index");
    SHARDD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream),
                                "experts read bad index");
    return absl::InvalidArgumentError(
        absl::StrCat("experts indices[", bad_slot / k, ", ", bad_slot % k,
                     "] must be in [0, ", e_count, "), got ", value));
  }
  int64_t groups = 0;
  st.offsets[0] = 0;
  for (int64_t e = 0; e < e_count; ++e) {
    const int32_t rows = static_cast<int32_t>(st.pinned_status[1 + e]);
    st.expert_rows[e] = rows;
    st.offsets[e + 1] = st.offsets[e] + rows;
    if (rows > 0) st.nonempty[groups++] = static_cast<int32_t>(e);
  }
  st.groups = groups;
  st.rows = st.offsets[e_count];

  const cudaDataType_t type = StorageDataType(options.storage);
  const cublasComputeType_t compute = StorageCompute(options.storage);
  ExpertGemm gate_up;
  gate_up.slot = kGateUpForward;
  gate_up.what = "H = Xs @ W_gu";
  gate_up.fixed = d;
  gate_up.n = 2 * inter;
  gate_up.lda = d;
  gate_up.ldb = 2 * inter;
  gate_up.ldc = 2 * inter;
  gate_up.a = RowsOperand(xs, d, s);
  gate_up.b = ExpertsOperand(w_gu, d * 2 * inter, s);
  gate_up.c = RowsOperand(h, 2 * inter, s);
  gate_up.ab_type = gate_up.c_type = type;
  gate_up.compute = compute;
  SHARDD_RETURN_IF_ERROR(
      RunExpertGemm(gate_up, options.gemm_path, st, cublas, stream));
  // Per-expert biases: each row finds its expert in the device offsets.
  const int32_t* device_offsets = offsets;
  if (options.gate_up_bias != nullptr) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchAddRowBias(ToDType(options.storage), options.gate_up_bias,
                         ToDType(options.storage), h, st.rows, 2 * inter,
                         device_offsets, e_count, /*row_scale=*/nullptr,
                         stream),
        "experts gate_up bias");
  }

  SHARDD_CUDA_RETURN_IF_ERROR(
      internal::LaunchGatedActivationForward(
          dtype, ToDeviceGate(options.activation), ToGateParams(options), h,
          row_weight, st.rows, inter, a, stream),
      "experts activation forward");

  ExpertGemm down;
  down.slot = kDownForward;
  down.what = "O = A @ W_d";
  down.fixed = inter;
  down.n = d;
  down.lda = inter;
  down.ldb = d;
  down.ldc = d;
  down.a = RowsOperand(a, inter, s);
  down.b = ExpertsOperand(w_d, inter * d, s);
  down.c = RowsOperand(o, d, s);
  down.ab_type = down.c_type = type;
  down.compute = compute;
  SHARDD_RETURN_IF_ERROR(
      RunExpertGemm(down, options.gemm_path, st, cublas, stream));
  if (options.down_bias != nullptr) {
    // O += w * b_d[e]: Hugging Face's (A W_d + b_d) * w with w inside A.
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchAddRowBias(ToDType(options.storage), options.down_bias,
                         ToDType(options.storage), o, st.rows, d,
                         device_offsets, e_count, row_weight, stream),
        "experts down bias");
  }

  SHARDD_CUDA_RETURN_IF_ERROR(
      internal::LaunchCombineRows(dtype, o, row_of_slot, t_count, k, d,
                                  /*accumulate=*/false, y, stream),
      "experts combine y");
  st.has_forward = true;
  return absl::OkStatus();
}

absl::Status GroupedExpertsBackward(
    const ExpertDims& dims, const GroupedExpertsOptions& options,
    const void* w_gu, const void* w_d, const void* dy, void* dx,
    bool accumulate_dx, float* d_weights, float* dw_gu, float* dw_d,
    GroupedExpertsWorkspace* ws, cublasHandle_t cublas, cudaStream_t stream) {
  return GroupedExpertsBackward(dims, options, w_gu, w_d, dy, dx, accumulate_dx,
                                d_weights, dw_gu, dw_d, ExpertBiasGrads(), ws,
                                cublas, stream);
}

absl::Status GroupedExpertsBackward(
    const ExpertDims& dims, const GroupedExpertsOptions& options,
    const void* w_gu, const void* w_d, const void* dy, void* dx,
    bool accumulate_dx, float* d_weights, float* dw_gu, float* dw_d,
    const ExpertBiasGrads& bias_grads, GroupedExpertsWorkspace* ws,
    cublasHandle_t cublas, cudaStream_t stream) {
  if (ws == nullptr || !ws->state_->has_forward) {
    return absl::FailedPreconditionError(
        "GroupedExpertsBackward needs a workspace filled by "
        "GroupedExpertsForward");
  }
  State& st = *ws->state_;
  if (!SameDims(dims, st.dims) || options.activation != st.options.activation ||
      options.storage != st.options.storage) {
    return absl::FailedPreconditionError(
        "GroupedExpertsBackward dims, activation or storage differ from the "
        "forward's");
  }
  if (options.alpha != st.options.alpha || options.limit != st.options.limit ||
      (options.gate_up_bias == nullptr) !=
          (st.options.gate_up_bias == nullptr) ||
      (options.down_bias == nullptr) != (st.options.down_bias == nullptr)) {
    return absl::FailedPreconditionError(
        "GroupedExpertsBackward options differ from the forward's");
  }
  SHARDD_RETURN_IF_ERROR(ValidateOptions(options));
  const int64_t t_count = dims.tokens, d = dims.dim, inter = dims.intermediate,
                k = dims.top_k;
  if (t_count == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(RequireNonNull(
      {{"dy", dy}, {"w_d", w_d}, {"cublas handle", cublas}}, ""));
  if (dx != nullptr) {
    SHARDD_RETURN_IF_ERROR(RequireNonNull({{"w_gu", w_gu}}, " when dx is set"));
  }
  const bool need_dh = dx != nullptr || d_weights != nullptr ||
                       dw_gu != nullptr || bias_grads.gate_up != nullptr;
  if (!need_dh && dw_d == nullptr && bias_grads.down == nullptr) {
    return absl::OkStatus();
  }

  CublasScope scope;
  SHARDD_RETURN_IF_ERROR(scope.Enter(cublas, stream));
  const Layout& layout = st.layout;
  const DeviceDtype dtype = ToDeviceDtype(options.storage);
  const uint64_t s = ElementBytes(options.storage);
  const cudaDataType_t type = StorageDataType(options.storage);
  const cublasComputeType_t compute = StorageCompute(options.storage);
  const int32_t* row_of_slot = st.At<int32_t>(layout.row_of_slot);
  const float* row_weight = st.At<float>(layout.row_weight);
  float* row_dweight = st.At<float>(layout.row_dweight);
  void* xs = st.At<void>(layout.xs);
  void* h = st.At<void>(layout.h);
  void* a = st.At<void>(layout.a);
  void* d_o = st.At<void>(layout.o);  // dO, later dXs
  void* da = st.At<void>(layout.da);
  void* dh = st.At<void>(layout.dh);
  const int32_t* device_offsets = st.At<int32_t>(layout.offsets);
  const DType type_tag = ToDType(options.storage);
  const int64_t e_count = dims.experts;

  SHARDD_CUDA_RETURN_IF_ERROR(
      internal::LaunchGatherRows(dtype, dy, row_of_slot, t_count, k, d, d_o,
                                 stream),
      "experts gather dy");
  if (bias_grads.down != nullptr) {
    // O = ... + w * b_d[e]: db_d[e] += sum over e's rows of w * dO.
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchColumnSums(type_tag, d_o, st.rows, d, device_offsets, e_count,
                         row_weight, bias_grads.down, stream),
        "experts down bias gradient");
  }

  if (dw_d != nullptr) {
    ExpertGemm wgrad;
    wgrad.slot = kDownWgrad;
    wgrad.what = "dW_d += A^T @ dO";
    wgrad.trans_a = true;
    wgrad.rows_are_k = true;
    wgrad.fixed = inter;
    wgrad.n = d;
    wgrad.lda = inter;
    wgrad.ldb = d;
    wgrad.ldc = d;
    wgrad.a = RowsOperand(a, inter, s);
    wgrad.b = RowsOperand(d_o, d, s);
    wgrad.c = ExpertsOperand(dw_d, inter * d, sizeof(float));
    wgrad.ab_type = type;
    wgrad.c_type = CUDA_R_32F;
    wgrad.compute = compute;
    wgrad.beta = 1.0f;
    SHARDD_RETURN_IF_ERROR(
        RunExpertGemm(wgrad, options.gemm_path, st, cublas, stream));
  }
  if (need_dh) {
    ExpertGemm dgrad;
    dgrad.slot = kDownDgrad;
    dgrad.what = "dA = dO @ W_d^T";
    dgrad.trans_b = true;
    dgrad.fixed = d;
    dgrad.n = inter;
    dgrad.lda = d;
    dgrad.ldb = d;
    dgrad.ldc = inter;
    dgrad.a = RowsOperand(d_o, d, s);
    dgrad.b = ExpertsOperand(w_d, inter * d, s);
    dgrad.c = RowsOperand(da, inter, s);
    dgrad.ab_type = dgrad.c_type = type;
    dgrad.compute = compute;
    SHARDD_RETURN_IF_ERROR(
        RunExpertGemm(dgrad, options.gemm_path, st, cublas, stream));
    SHARDD_CUDA_RETURN_IF_ERROR(
        internal::LaunchGatedActivationBackward(
            dtype, ToDeviceGate(options.activation), ToGateParams(options), h,
            row_weight, da, st.rows, inter, dh, row_dweight, stream),
        "experts activation backward");
    if (options.down_bias != nullptr) {
      // ... and the routing weight gains dO . b_d[e] (dO is still intact).
      SHARDD_CUDA_RETURN_IF_ERROR(
          LaunchAddRowBiasDot(type_tag, d_o, options.down_bias, st.rows, d,
                              device_offsets, e_count, row_dweight, stream),
          "experts down bias routing gradient");
    }
    if (bias_grads.gate_up != nullptr) {
      SHARDD_CUDA_RETURN_IF_ERROR(
          LaunchColumnSums(type_tag, dh, st.rows, 2 * inter, device_offsets,
                           e_count, /*row_scale=*/nullptr, bias_grads.gate_up,
                           stream),
          "experts gate_up bias gradient");
    }
  }
  if (d_weights != nullptr) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        internal::LaunchSlotValues(row_dweight, row_of_slot, t_count * k,
                                   d_weights, stream),
        "experts d_weights");
  }
  if (dw_gu != nullptr) {
    ExpertGemm wgrad;
    wgrad.slot = kGateUpWgrad;
    wgrad.what = "dW_gu += Xs^T @ dH";
    wgrad.trans_a = true;
    wgrad.rows_are_k = true;
    wgrad.fixed = d;
    wgrad.n = 2 * inter;
    wgrad.lda = d;
    wgrad.ldb = 2 * inter;
    wgrad.ldc = 2 * inter;
    wgrad.a = RowsOperand(xs, d, s);
    wgrad.b = RowsOperand(dh, 2 * inter, s);
    wgrad.c = ExpertsOperand(dw_gu, d * 2 * inter, sizeof(float));
    wgrad.ab_type = type;
    wgrad.c_type = CUDA_R_32F;
    wgrad.compute = compute;
    wgrad.beta = 1.0f;
    SHARDD_RETURN_IF_ERROR(
        RunExpertGemm(wgrad, options.gemm_path, st, cublas, stream));
  }
  if (dx != nullptr) {
    // dXs reuses the dO buffer: every reader of dO is already enqueued.
    ExpertGemm dgrad;
    dgrad.slot = kGateUpDgrad;
    dgrad.what = "dXs = dH @ W_gu^T";
    dgrad.trans_b = true;
    dgrad.fixed = 2 * inter;
    dgrad.n = d;
    dgrad.lda = 2 * inter;
    dgrad.ldb = 2 * inter;
    dgrad.ldc = d;
    dgrad.a = RowsOperand(dh, 2 * inter, s);
    dgrad.b = ExpertsOperand(w_gu, d * 2 * inter, s);
    dgrad.c = RowsOperand(d_o, d, s);
    dgrad.ab_type = dgrad.c_type = type;
    dgrad.compute = compute;
    SHARDD_RETURN_IF_ERROR(
        RunExpertGemm(dgrad, options.gemm_path, st, cublas, stream));
    SHARDD_CUDA_RETURN_IF_ERROR(
        internal::LaunchCombineRows(dtype, d_o, row_of_slot, t_count, k, d,
                                    accumulate_dx, dx, stream),
        "experts combine dx");
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
