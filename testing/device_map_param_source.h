#ifndef SHARDD_TESTING_DEVICE_MAP_PARAM_SOURCE_H_
#define SHARDD_TESTING_DEVICE_MAP_PARAM_SOURCE_H_

// A DeviceParamSource over plain cudaMalloc memory for GPU model tests: the
// parameters' values (fp32, or bf16 rounded from them) and fp32 gradient
// buffers, kept apart from the model's allocator, whose backend calls the
// tests count.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "model/model_util.h"
#include "proto/model.pb.h"
#include "worker/model/device_param_source.h"

namespace shardd {
namespace testing_util {

class TestDeviceSource : public DeviceParamSource {
 public:
  ~TestDeviceSource() override {
    for (auto& [name, p] : params_) {
      cudaFree(p.data);
      cudaFree(p.grad);
    }
  }

  // Every parameter of `values` in `dtype`; those `spec` freezes (DeepSeek's
  // e_score_correction_bias, DiffusionGemma's router) get no gradient
  // buffer, as on a worker.
  void AddAll(const v1::ModelSpec& spec,
              const std::map<std::string, std::vector<float>>& values,
              DeviceDType dtype) {
    std::set<std::string> frozen;
    for (const ParamRef& ref : ListParams(spec)) {
      if (ref.tensor->frozen()) frozen.insert(ref.fqn);
    }
    for (const auto& [name, v] : values) {
      Add(name, v, dtype, frozen.count(name) > 0);
    }
  }

  void Add(const std::string& name, const std::vector<float>& values,
           DeviceDType dtype, bool frozen) {
    Entry& e = params_[name];
    e.dtype = dtype;
    e.numel = static_cast<int64_t>(values.size());
    e.frozen = frozen;
    if (dtype == DeviceDType::kFloat32) {
      ASSERT_EQ(cudaMalloc(&e.data, values.size() * sizeof(float)),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(e.data, values.data(), values.size() * sizeof(float),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    } else {
      std::vector<uint16_t> bits(values.size());
      kernels::Fp32ToBf16Array(values.data(), bits.data(), e.numel);
      ASSERT_EQ(cudaMalloc(&e.data, bits.size() * sizeof(uint16_t)),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(e.data, bits.data(), bits.size() * sizeof(uint16_t),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    if (!frozen) {
      ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&e.grad),
                           values.size() * sizeof(float)),
                cudaSuccess);
    }
  }

  void ZeroGrads() {
    for (auto& [name, e] : params_) {
      if (e.grad != nullptr) {
        ASSERT_EQ(cudaMemset(e.grad, 0, e.numel * sizeof(float)), cudaSuccess);
      }
    }
  }

  // Synchronous (the test waits; the model never does).
  std::map<std::string, std::vector<float>> Grads() {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::map<std::string, std::vector<float>> out;
    for (auto& [name, e] : params_) {
      if (e.grad == nullptr) continue;
      std::vector<float>& v = out[name];
      v.resize(e.numel);
      EXPECT_EQ(cudaMemcpy(v.data(), e.grad, e.numel * sizeof(float),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return out;
  }

  absl::StatusOr<DeviceTensor> Param(const std::string& name,
                                     void* /*stream*/) override {
    auto it = params_.find(name);
    if (it == params_.end()) return absl::NotFoundError(name);
    DeviceTensor t;
    t.data = it->second.data;
    t.dtype = it->second.dtype;
    t.numel = it->second.numel;
    return t;
  }

  absl::StatusOr<float*> Grad(const std::string& name,
                              void* /*stream*/) override {
    auto it = params_.find(name);
    if (it == params_.end()) return absl::NotFoundError(name);
    if (it->second.frozen) {
      return absl::FailedPreconditionError(
          absl::StrCat("gradient of frozen '", name, "' requested"));
    }
    return it->second.grad;
  }

 private:
  struct Entry {
    void* data = nullptr;
    float* grad = nullptr;
    DeviceDType dtype = DeviceDType::kFloat32;
    int64_t numel = 0;
    bool frozen = false;
  };
  std::map<std::string, Entry> params_;
};

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_DEVICE_MAP_PARAM_SOURCE_H_
