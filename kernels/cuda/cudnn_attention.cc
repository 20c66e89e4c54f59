#include "kernels/cuda/cudnn_attention.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cudnn_frontend.h>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"

// The frontend's handle to the dynamically loaded libcudnn
// (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): set by LoadCudnn.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

namespace fe = ::cudnn_frontend;

// Tensor uids of the graphs' variant packs.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
};

absl::StatusOr<int64_t> OpenCudnn() {
  const char* env = std::getenv(kCudnnLibraryEnv);
  const std::string name =
      env != nullptr && env[0] != '\0' ? env : "libcudnn.so.9";
  dlerror();
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDNN: cannot open '", name, "' (", why == nullptr ? "" : why,
        "); install cuDNN 9 (pip's nvidia-cudnn-cu13 puts it in "
        "site-packages/nvidia/cudnn/lib) and put its directory on "
        "LD_LIBRARY_PATH, or name the library in ",
        kCudnnLibraryEnv));
  }
  using GetVersion = size_t (*)();
  auto get_version =
      reinterpret_cast<GetVersion>(dlsym(handle, "cudnnGetVersion"));
  if (get_version == nullptr) {
    dlclose(handle);
    return absl::FailedPreconditionError(
        absl::StrCat("cuDNN: '", name, "' has no cudnnGetVersion"));
  }
  const int64_t version = static_cast<int64_t>(get_version());
  if (version < kMinCudnnVersion || version >= 100000) {
    dlclose(handle);
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDNN: '", name, "' is version ", version, "; shardd's fused "
        "attention needs cuDNN 9 at ",
        kMinCudnnVersion, " (9.5.0) or newer"));
  }
  fe::cudnn_dlhandle = handle;
  return version;
}

std::string StrOf(fe::error_t& e) { return e.get_message(); }

// The own kernels' token-major layout as cuDNN's [B, H, T, D] dims and
// strides.
std::vector<int64_t> Dims(int64_t b, int64_t h, int64_t t, int64_t d) {
  return {b, h, t, d};
}
std::vector<int64_t> TokenMajor(int64_t h, int64_t t, int64_t d) {
  return {t * h * d, d, h * d, 1};
}

}  // namespace

absl::StatusOr<AttentionKernels> AttentionKernelsFromEnvironment() {
  const char* env = std::getenv(kAttentionKernelsEnv);
  const std::string value = env == nullptr ? "" : env;
  if (value.empty() || value == "own") return AttentionKernels::kOwn;
  if (value == "auto") return AttentionKernels::kAuto;
  if (value == "cudnn") return AttentionKernels::kCudnn;
  return absl::InvalidArgumentError(
      absl::StrCat(kAttentionKernelsEnv, "='", value,
                   "': allowed are own, auto and cudnn"));
}

absl::StatusOr<int64_t> LoadCudnn() {
  static absl::once_flag once;
  static absl::StatusOr<int64_t>* result = nullptr;
  absl::call_once(once, [] {
    result = new absl::StatusOr<int64_t>(OpenCudnn());
  });
  return *result;
}

absl::Status CudnnAttentionSupports(const AttentionDims& dims,
                                    const AttentionOptions& options,
                                    bool bf16) {
  const int64_t dv = dims.v_head_dim == 0 ? dims.head_dim : dims.v_head_dim;
  if (!bf16) {
    return absl::UnimplementedError(
        "cuDNN attention: fp32 storage (cuDNN's fused attention takes 16-bit "
        "inputs)");
  }
  if (dv != dims.head_dim || dims.head_dim % 8 != 0 || dims.head_dim > 256) {
    return absl::UnimplementedError(absl::StrCat(
        "cuDNN attention: head dims ", dims.head_dim, "/", dv,
        " (needs equal q and v widths, a multiple of 8, at most 256)"));
  }
  if (options.sinks != nullptr) {
    return absl::UnimplementedError("cuDNN attention: sink logits");
  }
  if (options.key_begin != nullptr) {
    return absl::UnimplementedError(
        "cuDNN attention: packed rows (options.key_begin)");
  }
  if (options.mask != AttentionMask::kCausal &&
      options.mask != AttentionMask::kSlidingWindow) {
    return absl::UnimplementedError(
        "cuDNN attention: masks other than causal and sliding window");
  }
  if (options.q_offset != 0 || dims.q_len != dims.kv_len) {
    return absl::UnimplementedError(
        "cuDNN attention: queries offset from the keys (decodes)");
  }
  if (options.mask == AttentionMask::kSlidingWindow && options.window < 1) {
    return absl::UnimplementedError("cuDNN attention: a window below 1");
  }
  if (dims.q_len < 1 || dims.batch < 1 || dims.q_heads < 1 ||
      dims.kv_heads < 1 || dims.q_heads % dims.kv_heads != 0) {
    return absl::UnimplementedError(
        "cuDNN attention: empty or ungrouped shapes");
  }
  return absl::OkStatus();
}

struct CudnnAttention::Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
};

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    cudaStream_t stream) {
  absl::StatusOr<int64_t> version = LoadCudnn();
  if (!version.ok()) return version.status();
  std::unique_ptr<CudnnAttention> out(new CudnnAttention());
  try {
    cudnnHandle_t handle = nullptr;
    cudnnStatus_t status = fe::detail::create_handle(&handle);
    if (status != CUDNN_STATUS_SUCCESS) {
      return absl::InternalError(
          absl::StrCat("cudnnCreate failed: ", fe::detail::get_error_string(status)));
    }
    out->handle_ = handle;
    status = fe::detail::set_stream(handle, stream);
    if (status != CUDNN_STATUS_SUCCESS) {
      return absl::InternalError(absl::StrCat(
          "cudnnSetStream failed: ", fe::detail::get_error_string(status)));
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("cuDNN: ", e.what()));
  }
  return out;
}

CudnnAttention::~CudnnAttention() {
  plans_.clear();
  if (handle_ != nullptr) {
    try {
      (void)fe::detail::destroy_handle(static_cast<cudnnHandle_t>(handle_));
    } catch (const std::exception&) {
    }
  }
}

absl::StatusOr<CudnnAttention::Plan*> CudnnAttention::PlanFor(
    const AttentionDims& dims, const AttentionOptions& options,
    bool backward) {
  if (absl::Status s = CudnnAttentionSupports(dims, options, /*bf16=*/true);
      !s.ok()) {
    return s;
  }
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &options.scale, sizeof(scale_bits));
  const bool sliding = options.mask == AttentionMask::kSlidingWindow;
  const Key key{backward,       dims.batch,    dims.q_len,
                dims.kv_len,    dims.q_heads,  dims.kv_heads,
                dims.head_dim,  dims.head_dim, static_cast<int>(options.mask),
                sliding ? options.window : 0, scale_bits};
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second.get();

  const int64_t b = dims.batch, t = dims.q_len, s = dims.kv_len;
  const int64_t hq = dims.q_heads, hkv = dims.kv_heads, d = dims.head_dim;
  auto plan = std::make_unique<Plan>();
  try {
    auto graph = std::make_shared<fe::graph::Graph>();
    graph->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto tensor = [&](const char* name, Uid uid, int64_t h, int64_t rows) {
      return graph->tensor(fe::graph::Tensor_attributes()
                               .set_name(name)
                               .set_uid(uid)
                               .set_dim(Dims(b, h, rows, d))
                               .set_stride(TokenMajor(h, rows, d)));
    };
    auto q = tensor("Q", kQ, hq, t);
    auto k = tensor("K", kK, hkv, s);
    auto v = tensor("V", kV, hkv, s);
    if (!backward) {
      auto attrs = fe::graph::SDPA_attributes()
                       .set_name("shardd_attention")
                       .set_generate_stats(true)
                       .set_attn_scale(options.scale)
                       .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                       .set_diagonal_band_right_bound(0);
      if (sliding) {
        attrs.set_diagonal_band_left_bound(static_cast<int>(options.window));
      }
      auto [o, stats] = graph->sdpa(q, k, v, attrs);
      o->set_output(true)
          .set_uid(kO)
          .set_dim(Dims(b, hq, t, d))
          .set_stride(TokenMajor(hq, t, d));
      stats->set_output(true)
          .set_uid(kStats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim({b, hq, t, 1})
          .set_stride({hq * t, t, 1, 1});
    } else {
      auto o = tensor("O", kO, hq, t);
      auto d_o = tensor("dO", kDO, hq, t);
      auto stats = graph->tensor(fe::graph::Tensor_attributes()
                                     .set_name("Stats")
                                     .set_uid(kStats)
                                     .set_dim({b, hq, t, 1})
                                     .set_stride({hq * t, t, 1, 1})
                                     .set_data_type(fe::DataType_t::FLOAT));
      auto attrs =
          fe::graph::SDPA_backward_attributes()
              .set_name("shardd_attention_backward")
              .set_attn_scale(options.scale)
              .set_deterministic_algorithm(true)
              .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
              .set_diagonal_band_right_bound(0);
      if (sliding) {
        attrs.set_diagonal_band_left_bound(static_cast<int>(options.window));
      }
      auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, d_o, stats, attrs);
      dq->set_output(true)
          .set_uid(kDQ)
          .set_dim(Dims(b, hq, t, d))
          .set_stride(TokenMajor(hq, t, d));
      dk->set_output(true)
          .set_uid(kDK)
          .set_dim(Dims(b, hkv, s, d))
          .set_stride(TokenMajor(hkv, s, d));
      dv->set_output(true)
          .set_uid(kDV)
          .set_dim(Dims(b, hkv, s, d))
          .set_stride(TokenMajor(hkv, s, d));
    }
    fe::error_t e =
        graph->build(static_cast<cudnnHandle_t>(handle_), {fe::HeurMode_t::A});
    if (!e.is_good()) {
      return absl::InternalError(
          absl::StrCat("cuDNN attention ", backward ? "backward" : "forward",
                       " [B=", b, " T=", t, " Hq=", hq, " Hkv=", hkv, " D=", d,
                       "]: ", StrOf(e)));
    }
    e = graph->get_workspace_size(plan->workspace);
    if (!e.is_good()) {
      return absl::InternalError(
          absl::StrCat("cuDNN attention workspace: ", StrOf(e)));
    }
    plan->graph = std::move(graph);
  } catch (const std::exception& ex) {
    return absl::InternalError(absl::StrCat("cuDNN attention: ", ex.what()));
  }
  ++plans_built_;
  Plan* raw = plan.get();
  plans_.emplace(key, std::move(plan));
  return raw;
}

absl::StatusOr<size_t> CudnnAttention::ForwardWorkspaceBytes(
    const AttentionDims& dims, const AttentionOptions& options) {
  absl::StatusOr<Plan*> plan = PlanFor(dims, options, /*backward=*/false);
  if (!plan.ok()) return plan.status();
  return static_cast<size_t>((*plan)->workspace);
}

absl::StatusOr<size_t> CudnnAttention::BackwardWorkspaceBytes(
    const AttentionDims& dims, const AttentionOptions& options) {
  absl::StatusOr<Plan*> plan = PlanFor(dims, options, /*backward=*/true);
  if (!plan.ok()) return plan.status();
  return static_cast<size_t>((*plan)->workspace);
}

namespace {

absl::Status Execute(void* handle, fe::graph::Graph& graph,
                     std::unordered_map<int64_t, void*>& pack, void* workspace,
                     size_t workspace_bytes, int64_t needed,
                     const char* what) {
  if (static_cast<int64_t>(workspace_bytes) < needed ||
      (needed > 0 && workspace == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuDNN attention ", what, ": workspace of ",
                     workspace_bytes, " bytes, needs ", needed));
  }
  try {
    fe::error_t e =
        graph.execute(static_cast<cudnnHandle_t>(handle), pack, workspace);
    if (!e.is_good()) {
      return absl::InternalError(
          absl::StrCat("cuDNN attention ", what, ": ", StrOf(e)));
    }
  } catch (const std::exception& ex) {
    return absl::InternalError(
        absl::StrCat("cuDNN attention ", what, ": ", ex.what()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudnnAttention::Forward(const AttentionDims& dims,
                                     const AttentionOptions& options,
                                     const uint16_t* q, const uint16_t* k,
                                     const uint16_t* v, uint16_t* out,
                                     float* lse, void* workspace,
                                     size_t workspace_bytes) {
  absl::StatusOr<Plan*> plan = PlanFor(dims, options, /*backward=*/false);
  if (!plan.ok()) return plan.status();
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<uint16_t*>(q)}, {kK, const_cast<uint16_t*>(k)},
      {kV, const_cast<uint16_t*>(v)}, {kO, out},
      {kStats, lse}};
  return Execute(handle_, *(*plan)->graph, pack, workspace, workspace_bytes,
                 (*plan)->workspace, "forward");
}

absl::Status CudnnAttention::Backward(
    const AttentionDims& dims, const AttentionOptions& options,
    const uint16_t* q, const uint16_t* k, const uint16_t* v,
    const uint16_t* out, const float* lse, const uint16_t* d_out, uint16_t* dq,
    uint16_t* dk, uint16_t* dv, void* workspace, size_t workspace_bytes) {
  absl::StatusOr<Plan*> plan = PlanFor(dims, options, /*backward=*/true);
  if (!plan.ok()) return plan.status();
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<uint16_t*>(q)},
      {kK, const_cast<uint16_t*>(k)},
      {kV, const_cast<uint16_t*>(v)},
      {kO, const_cast<uint16_t*>(out)},
      {kStats, const_cast<float*>(lse)},
      {kDO, const_cast<uint16_t*>(d_out)},
      {kDQ, dq},
      {kDK, dk},
      {kDV, dv}};
  return Execute(handle_, *(*plan)->graph, pack, workspace, workspace_bytes,
                 (*plan)->workspace, "backward");
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
