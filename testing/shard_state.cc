#include "testing/shard_state.h"

#include <string>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardd {
namespace testing_util {
namespace {

// The three buffers of a state and where each lives in a ShardStore.
template <typename Maps>
auto Buffers(Maps& state) {
  return std::vector<std::pair<decltype(&state.params), ShardBuffer>>{
      {&state.params, ShardBuffer::kParams},
      {&state.exp_avg, ShardBuffer::kExpAvg},
      {&state.exp_avg_sq, ShardBuffer::kExpAvgSq}};
}

}  // namespace

void CollectOwnedState(const v1::ShardingPlan& plan, const ShardStore& shards,
                       TrainingStateMaps* out) {
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      for (auto [map, buffer] : Buffers(*out)) {
        std::vector<float>& values = (*map)[param.name()];
        values.resize(param.numel(), 0.0f);
        SHARDD_EXPECT_OK(
            shards.CopyOwnedParamSlice(param.name(), values.data(), buffer));
      }
    }
  }
}

void WriteOwnedState(const v1::ShardingPlan& plan,
                     const TrainingStateMaps& state, ShardStore* shards) {
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      for (auto [map, buffer] : Buffers(state)) {
        ASSERT_EQ(map->count(param.name()), 1u) << param.name();
        SHARDD_EXPECT_OK(shards->WriteOwnedParamSlice(
            param.name(), map->at(param.name()).data(), buffer));
      }
    }
  }
}

}  // namespace testing_util
}  // namespace shardd
