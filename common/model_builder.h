#ifndef SHARDD_COMMON_MODEL_BUILDER_H_
#define SHARDD_COMMON_MODEL_BUILDER_H_

// Test helpers for writing module trees by hand (test-only target).

#include <cstdint>
#include <string>
#include <vector>

#include "proto/model.pb.h"

namespace shardd {
namespace testing_util {

// Appends an fp32 parameter `name` of `shape` to module `m`.
inline v1::TensorSpec* AddParam(v1::ModuleSpec* m, const std::string& name,
                                std::vector<int64_t> shape) {
  v1::TensorSpec* t = m->add_params();
  t->set_name(name);
  for (int64_t d : shape) t->add_shape(d);
  t->set_dtype(v1::FLOAT32);
  return t;
}

// Appends a child module `name` of `kind` to module `m`.
inline v1::ModuleSpec* AddChild(v1::ModuleSpec* m, const std::string& name,
                                v1::ModuleKind kind) {
  v1::ModuleSpec* c = m->add_children();
  c->set_name(name);
  c->set_kind(kind);
  return c;
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_COMMON_MODEL_BUILDER_H_
