#ifndef SHARDD_TESTING_STEP_BATCHES_H_
#define SHARDD_TESTING_STEP_BATCHES_H_

// One rank's micro-batches for `steps` steps of a plan's step shape, from
// the synthetic data source (test-only): what executor tests feed
// StepExecutor::Execute.

#include <cstdint>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "proto/plan.pb.h"
#include "worker/data/batch_sampler.h"

namespace shardd {
namespace testing_util {

// `rows` sequences of `seq` tokens per micro-batch, for a world of one
// rank. Test failures (ADD_FAILURE) on a sampler error.
inline std::vector<std::vector<data::MicroBatch>> StepBatches(
    const v1::ShardingPlan& plan, int64_t vocab, uint64_t seed, int64_t seq,
    int64_t rows, int steps) {
  data::DataSourceOptions source_options;
  source_options.model_vocab_size = vocab;
  source_options.seed = seed;
  auto source = data::CreateDataSource(source_options);
  EXPECT_TRUE(source.ok()) << source.status();
  std::vector<std::vector<data::MicroBatch>> out(steps);
  if (!source.ok()) return out;
  data::BatchSamplerOptions options;
  options.global_batch = rows * plan.step().microbatches();
  options.seq_len = seq;
  options.microbatches = plan.step().microbatches();
  options.ranks = 1;
  options.model_vocab_size = vocab;
  auto sampler = data::BatchSampler::Create(*source, options);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  if (!sampler.ok()) return out;
  for (int s = 0; s < steps; ++s) {
    for (int m = 0; m < options.microbatches; ++m) {
      auto batch = sampler->Get(s, 0, m);
      EXPECT_TRUE(batch.ok()) << batch.status();
      if (batch.ok()) out[s].push_back(*std::move(batch));
    }
  }
  return out;
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_STEP_BATCHES_H_
