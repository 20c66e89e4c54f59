#ifndef SHARDD_TESTING_SHARD_STATE_H_
#define SHARDD_TESTING_SHARD_STATE_H_

// Reading and writing a rank's training state (master parameters and AdamW
// moments) as unsharded maps, for tests that compare runs across layouts or
// start a step from another run's state.

#include "proto/plan.pb.h"
#include "testing/numerics.h"
#include "worker/shards/shard_store.h"

namespace shardd {
namespace testing_util {

// Writes the elements this rank owns of every parameter of `plan` into
// `out` (each map entry sized to the parameter; other ranks' elements are
// left as they are, so the ranks of a replica can fill one state).
void CollectOwnedState(const v1::ShardingPlan& plan, const ShardStore& shards,
                       TrainingStateMaps* out);

// Overwrites the elements this rank owns with those of `state`, which must
// hold every parameter of `plan`.
void WriteOwnedState(const v1::ShardingPlan& plan,
                     const TrainingStateMaps& state, ShardStore* shards);

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_SHARD_STATE_H_
