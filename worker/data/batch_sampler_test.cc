#include "worker/data/batch_sampler.h"

#include <algorithm>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace data {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Token t of sequence k is k * 1000 + t, so every row names its sequence.
class CountingSource : public SequenceSource {
 public:
  explicit CountingSource(uint64_t tag = 0) : tag_(tag) {}
  int64_t vocab_size() const override { return 1 << 30; }
  absl::Status Fill(int64_t index, absl::Span<int32_t> out) const override {
    for (size_t t = 0; t < out.size(); ++t) {
      out[t] = static_cast<int32_t>(index * 1000 + t);
    }
    return absl::OkStatus();
  }
  uint64_t Fingerprint() const override { return 1234 + tag_; }
  std::string Describe() const override { return "counting"; }

 private:
  uint64_t tag_;
};

BatchSampler MakeSampler(int64_t b, int64_t s, int32_t m, int32_t r,
                         std::shared_ptr<const SequenceSource> source =
                             std::make_shared<CountingSource>()) {
  BatchSamplerOptions options;
  options.global_batch = b;
  options.seq_len = s;
  options.microbatches = m;
  options.ranks = r;
  auto sampler = BatchSampler::Create(std::move(source), options);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  return *std::move(sampler);
}

TEST(BatchSamplerTest, MappingMatchesDocumentedFormula) {
  // B = 8, M = 2, R = 2: b = 2, micro-batch blocks of B / M = 4.
  // Step 1 covers sequences 8..15; micro-batch 0 = 8..11 split as rank 0:
  // 8, 9 and rank 1: 10, 11; micro-batch 1 = 12..15.
  BatchSampler sampler = MakeSampler(8, 3, 2, 2);
  EXPECT_EQ(sampler.rows_per_rank(), 2);
  EXPECT_EQ(sampler.rows_per_microbatch(), 4);
  SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch r1m0, sampler.Get(1, 1, 0));
  EXPECT_THAT(r1m0.sequence_indices, ElementsAre(10, 11));
  SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch r0m1, sampler.Get(1, 0, 1));
  EXPECT_THAT(r0m1.sequence_indices, ElementsAre(12, 13));
  EXPECT_EQ(*sampler.SequenceIndex(1, 1, 1, 1), 15);
  EXPECT_EQ(*sampler.SequenceIndex(0, 0, 0, 0), 0);
  // Rows: inputs t_0..t_{S-1}, targets t_1..t_S of the sequence.
  EXPECT_EQ(r1m0.rows, 2);
  EXPECT_EQ(r1m0.seq_len, 3);
  EXPECT_THAT(r1m0.inputs,
              ElementsAre(10000, 10001, 10002, 11000, 11001, 11002));
  EXPECT_THAT(r1m0.targets,
              ElementsAre(10001, 10002, 10003, 11001, 11002, 11003));
}

TEST(BatchSamplerTest, SlicesAreDisjointAndCoverEachStep) {
  for (auto [b, m, r] : std::vector<std::tuple<int64_t, int32_t, int32_t>>{
           {8, 1, 1}, {8, 2, 2}, {12, 3, 2}, {16, 2, 4}, {24, 4, 3}}) {
    BatchSampler sampler = MakeSampler(b, 2, m, r);
    for (int64_t step = 0; step < 3; ++step) {
      std::multiset<int64_t> seen;
      for (int32_t rank = 0; rank < r; ++rank) {
        for (int32_t mb = 0; mb < m; ++mb) {
          SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch batch,
                                      sampler.Get(step, rank, mb));
          EXPECT_EQ(batch.rows, b / (r * m));
          for (int64_t row = 0; row < batch.rows; ++row) {
            const int64_t index = batch.sequence_indices[row];
            seen.insert(index);
            // The row really holds that sequence (seq_len 2).
            EXPECT_EQ(batch.inputs[row * 2], index * 1000);
          }
        }
      }
      std::multiset<int64_t> expected;
      for (int64_t i = step * b; i < (step + 1) * b; ++i) expected.insert(i);
      EXPECT_EQ(seen, expected)
          << "B=" << b << " M=" << m << " R=" << r << " step " << step;
    }
  }
}

TEST(BatchSamplerTest, AllRanksViewIsConcatenationInRankOrder) {
  BatchSampler sampler = MakeSampler(12, 4, 3, 2);
  for (int64_t step : {0, 5}) {
    for (int32_t mb = 0; mb < 3; ++mb) {
      MicroBatch concat;
      for (int32_t rank = 0; rank < 2; ++rank) {
        SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch part,
                                    sampler.Get(step, rank, mb));
        concat.inputs.insert(concat.inputs.end(), part.inputs.begin(),
                             part.inputs.end());
        concat.targets.insert(concat.targets.end(), part.targets.begin(),
                              part.targets.end());
        concat.sequence_indices.insert(concat.sequence_indices.end(),
                                       part.sequence_indices.begin(),
                                       part.sequence_indices.end());
      }
      SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch all,
                                  sampler.GetAllRanks(step, mb));
      EXPECT_EQ(all.rows, 4);
      EXPECT_EQ(all.inputs, concat.inputs);
      EXPECT_EQ(all.targets, concat.targets);
      EXPECT_EQ(all.sequence_indices, concat.sequence_indices);
    }
  }
}

TEST(BatchSamplerTest, MicroBatchContentsDoNotDependOnRanks) {
  MarkovOptions markov;
  markov.seed = 5;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto markov_source, MarkovSource::Create(markov));
  std::shared_ptr<const SequenceSource> source = std::move(markov_source);
  BatchSampler one = MakeSampler(16, 8, 2, 1, source);
  BatchSampler four = MakeSampler(16, 8, 2, 4, source);
  EXPECT_EQ(one.fingerprint(), four.fingerprint());
  for (int32_t mb = 0; mb < 2; ++mb) {
    SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch unsharded, one.Get(3, 0, mb));
    SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch all, four.GetAllRanks(3, mb));
    EXPECT_EQ(unsharded.inputs, all.inputs);
    EXPECT_EQ(unsharded.targets, all.targets);
  }
}

TEST(BatchSamplerTest, MarkovTargetsAreChainSuccessors) {
  MarkovOptions markov;
  markov.seed = 9;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto markov_source, MarkovSource::Create(markov));
  const MarkovChain& chain = markov_source->chain();
  std::shared_ptr<const SequenceSource> source = std::move(markov_source);
  BatchSampler sampler = MakeSampler(8, 16, 1, 2, source);
  SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch batch, sampler.Get(2, 1, 0));
  ASSERT_EQ(batch.inputs.size(), 4u * 16u);
  std::vector<int32_t> direct(17);
  for (int64_t row = 0; row < 4; ++row) {
    // Row `row` of rank 1 at step 2 is sequence 2 * 8 + 4 + row.
    SHARDD_ASSERT_OK(source->Fill(20 + row, absl::MakeSpan(direct)));
    for (int t = 0; t < 16; ++t) {
      EXPECT_EQ(batch.inputs[row * 16 + t], direct[t]);
      EXPECT_EQ(batch.targets[row * 16 + t], direct[t + 1]);
      EXPECT_GT(chain.Probability(batch.inputs[row * 16 + t],
                                  batch.targets[row * 16 + t]),
                0.0);
    }
  }
}

TEST(BatchSamplerTest, RejectsBadOptions) {
  auto create = [](int64_t b, int64_t s, int32_t m, int32_t r) {
    BatchSamplerOptions options;
    options.global_batch = b;
    options.seq_len = s;
    options.microbatches = m;
    options.ranks = r;
    return BatchSampler::Create(std::make_shared<CountingSource>(), options);
  };
  EXPECT_THAT(
      create(10, 4, 3, 4),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("global_batch (10)"), HasSubstr("ranks (4)"),
                     HasSubstr("microbatches (3)"))));
  EXPECT_THAT(create(0, 4, 1, 1), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("global_batch")));
  EXPECT_THAT(create(4, 0, 1, 1), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("seq_len")));
  EXPECT_THAT(create(4, 4, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("microbatches")));
  EXPECT_THAT(create(4, 4, 1, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ranks")));
  BatchSamplerOptions options;
  options.global_batch = 4;
  options.seq_len = 4;
  EXPECT_THAT(BatchSampler::Create(nullptr, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  options.model_vocab_size = 100;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto markov, MarkovSource::Create({}));
  EXPECT_THAT(
      BatchSampler::Create(std::move(markov), options),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("model_vocab_size 100"), HasSubstr("256"))));
}

TEST(BatchSamplerTest, RejectsOutOfRangeCoordinates) {
  BatchSampler sampler = MakeSampler(8, 2, 2, 2);
  EXPECT_THAT(sampler.Get(-1, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step")));
  EXPECT_THAT(sampler.Get(0, 2, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank must be in [0, 2)")));
  EXPECT_THAT(sampler.Get(0, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("microbatch must be in [0, 2)")));
  EXPECT_THAT(
      sampler.GetAllRanks(0, -1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("microbatch")));
  EXPECT_THAT(sampler.SequenceIndex(0, 0, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("row")));
  // step * B would overflow int64.
  EXPECT_THAT(sampler.Get(int64_t{1} << 61, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step")));
}

TEST(BatchSamplerTest, SourceErrorsPropagate) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/short_for_sampler.txt");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << "abcd";
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(auto file, TokenFileSource::Open(path, {}, {}));
  BatchSampler sampler = MakeSampler(2, 4, 1, 1, std::move(file));
  // Rows need seq_len + 1 = 5 tokens; the file has 4.
  EXPECT_THAT(sampler.Get(0, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("4 tokens"))));
}

TEST(BatchSamplerTest, ResumingReproducesBatches) {
  DataSourceOptions data;
  data.model_vocab_size = 128;
  data.seed = 77;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source, CreateDataSource(data));
  BatchSampler sampler = MakeSampler(8, 16, 2, 2, source);
  const DataPosition position = sampler.PositionAt(6);
  EXPECT_EQ(position.step, 6);

  // A fresh process: source rebuilt from the same config, other world size.
  SHARDD_ASSERT_OK_AND_ASSIGN(auto rebuilt, CreateDataSource(data));
  BatchSampler resumed = MakeSampler(8, 16, 2, 1, rebuilt);
  SHARDD_ASSERT_OK_AND_ASSIGN(int64_t step, resumed.ResumeStep(position));
  EXPECT_EQ(step, 6);
  for (int32_t mb = 0; mb < 2; ++mb) {
    SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch before, sampler.GetAllRanks(6, mb));
    SHARDD_ASSERT_OK_AND_ASSIGN(MicroBatch after, resumed.Get(step, 0, mb));
    EXPECT_EQ(before.inputs, after.inputs);
    EXPECT_EQ(before.targets, after.targets);
  }

  // Another seed, global batch or sequence length is another stream.
  DataSourceOptions other_data = data;
  other_data.seed = 78;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto other, CreateDataSource(other_data));
  EXPECT_THAT(MakeSampler(8, 16, 2, 2, other).ResumeStep(position),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("different data stream")));
  EXPECT_FALSE(MakeSampler(16, 16, 2, 2, source).ResumeStep(position).ok());
  EXPECT_FALSE(MakeSampler(8, 32, 2, 2, source).ResumeStep(position).ok());
  DataPosition negative = position;
  negative.step = -1;
  EXPECT_THAT(sampler.ResumeStep(negative),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step")));
}

TEST(CreateDataSourceTest, PicksMarkovOrTokenFile) {
  DataSourceOptions options;
  options.model_vocab_size = 300;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto markov, CreateDataSource(options));
  EXPECT_EQ(markov->vocab_size(), 300);
  EXPECT_THAT(markov->Describe(), HasSubstr("markov"));

  options.markov.vocab_size = 64;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto small, CreateDataSource(options));
  EXPECT_EQ(small->vocab_size(), 64);
  options.markov.vocab_size = 512;
  EXPECT_THAT(CreateDataSource(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("markov vocab_size (512)")));

  const std::string path =
      absl::StrCat(::testing::TempDir(), "/create_source.txt");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << "hello world";
  }
  options.path = path;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto file, CreateDataSource(options));
  EXPECT_EQ(file->vocab_size(), 300);
  EXPECT_THAT(file->Describe(), HasSubstr("format=bytes"));

  options.model_vocab_size = 1;
  EXPECT_THAT(CreateDataSource(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model_vocab_size")));
}

}  // namespace
}  // namespace data
}  // namespace shardd
