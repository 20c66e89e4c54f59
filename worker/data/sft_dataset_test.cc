// The SFT dataset's files (Megatron's indexed dataset, the manifest and its
// checksums), their corruption, and the padded, packed and DiffusionGemma
// rows of SftSource.

#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/sft_dataset_writer.h"
#include "worker/data/indexed_dataset.h"
#include "worker/data/sft_dataset.h"
#include "worker/data/sft_source.h"

namespace shardd {
namespace data {
namespace {

using ::testing::HasSubstr;

using testing_util::SftExample;
using testing_util::WriteSftDataset;
using testing_util::sft_internal::Append;

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class SftDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/sft_",
                        ::testing::UnitTest::GetInstance()
                            ->current_test_info()
                            ->name());
    std::string rm = "rm -rf '" + dir_ + "' && mkdir -p '" + dir_ + "'";
    ASSERT_EQ(std::system(rm.c_str()), 0);
    examples_ = {
        {{1, 2, 3, 4, 5}, {0, 0, 1, 1, 1}, 1},
        {{6, 7, 8}, {0, 1, 1}, 3},
        {{9, 10, 11, 12}, {0, 0, 0, 1}, 4},
    };
  }

  // Writes the dataset with checksums over chunks of `chunk` bytes.
  void Write(int64_t chunk = 16, int version = 1) {
    WriteSftDataset(dir_, examples_, /*vocab=*/16, chunk, version);
  }

  std::string Path(const std::string& name) const {
    return dir_ + "/" + name;
  }

  // Flips one byte of `name` at `offset`.
  void Flip(const std::string& name, size_t offset) {
    std::string bytes = ReadFile(Path(name));
    bytes[offset] ^= 0x40;
    WriteFile(Path(name), bytes);
  }

  std::string dir_;
  std::vector<SftExample> examples_;
};

TEST_F(SftDatasetTest, OpensAndReadsEveryExample) {
  Write();
  ASSERT_TRUE(SftDataset::IsDataset(dir_));
  EXPECT_FALSE(SftDataset::IsDataset(dir_ + "/nothing"));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto d, SftDataset::Open(dir_, 16));
  ASSERT_EQ(d->examples(), 3);
  EXPECT_EQ(d->max_length(), 5);
  for (int64_t e = 0; e < 3; ++e) {
    ASSERT_EQ(d->length(e), static_cast<int64_t>(examples_[e].tokens.size()));
    EXPECT_EQ(d->SourceLine(e), examples_[e].line);
    for (int64_t j = 0; j < d->length(e); ++j) {
      EXPECT_EQ(d->Token(e, j), examples_[e].tokens[j]);
      EXPECT_EQ(d->Counted(e, j), examples_[e].mask[j] == 1);
    }
  }
  // The fingerprint follows the bytes.
  const uint64_t before = d->fingerprint();
  examples_[1].tokens[0] = 5;
  Write();
  SHARDD_ASSERT_OK_AND_ASSIGN(auto changed, SftDataset::Open(dir_, 16));
  EXPECT_NE(changed->fingerprint(), before);
}

TEST_F(SftDatasetTest, CorruptionIsDataLossNamingTheFileAndOffset) {
  Write(/*chunk=*/16);
  // Byte 37 of the tokens sits in the chunk [32, 48).
  Flip("tokens.bin", 37);
  EXPECT_THAT(SftDataset::Open(dir_, 16),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("tokens.bin: byte 32"),
                             HasSubstr("[32, 48)"))));
  Write();
  // A truncated mask.
  std::string mask = ReadFile(Path("loss_mask.bin"));
  WriteFile(Path("loss_mask.bin"), mask.substr(0, mask.size() - 2));
  EXPECT_THAT(SftDataset::Open(dir_, 16),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("loss_mask.bin: byte 10")));
  Write();
  WriteFile(Path(SftDataset::kManifest), "{\"format\": ");
  EXPECT_THAT(SftDataset::Open(dir_, 16),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("shardd_sft.json: not a JSON object")));
  Write(16, /*version=*/2);
  EXPECT_THAT(SftDataset::Open(dir_, 16),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("version 2")));
  std::remove(Path(SftDataset::kManifest).c_str());
  EXPECT_THAT(SftDataset::Open(dir_, 16),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(SftDatasetTest, TokensOutsideTheModelsVocabularyNameTheLine) {
  examples_[2].tokens[1] = 20;
  Write();
  EXPECT_THAT(SftDataset::Open(dir_, 16),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("example 2 (line 4), token 1: id 20"),
                             HasSubstr("[0, 16)"))));
  SHARDD_EXPECT_OK(SftDataset::Open(dir_, 21).status());
}

TEST(IndexedDatasetTest, BrokenIndexesAreDataLossAtTheField) {
  const std::string prefix = ::testing::TempDir() + "/indexed";
  const std::vector<int> lengths = {2, 3};
  std::string bin;
  for (int16_t v : {1, -2, 3, 4, 5}) Append<int16_t>(&bin, v);
  WriteFile(prefix + ".bin", bin);
  const std::string idx = testing_util::sft_internal::Index(3, 2, lengths);
  WriteFile(prefix + ".idx", idx);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto d, IndexedDataset::Open(prefix));
  EXPECT_EQ(d->sequences(), 2);
  EXPECT_EQ(d->documents(), 2);
  EXPECT_EQ(d->Item(0, 1), -2);
  EXPECT_EQ(d->Item(1, 2), 5);

  std::string bad = idx;
  bad[0] = 'X';
  WriteFile(prefix + ".idx", bad);
  EXPECT_THAT(IndexedDataset::Open(prefix),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("indexed.idx: byte 0: not a Megatron")));
  // Sequence 1's pointer (header 34 + lengths 8 + pointer 0's 8 = byte 50).
  bad = idx;
  bad[50] = 7;
  WriteFile(prefix + ".idx", bad);
  EXPECT_THAT(IndexedDataset::Open(prefix),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("indexed.idx: byte 50: sequence 1 starts")));
  bad = idx;
  bad[17] = 9;  // Dtype code.
  WriteFile(prefix + ".idx", bad);
  EXPECT_THAT(IndexedDataset::Open(prefix),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("byte 17: dtype code")));
  WriteFile(prefix + ".idx", idx);
  WriteFile(prefix + ".bin", bin.substr(0, 8));
  EXPECT_THAT(IndexedDataset::Open(prefix),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("indexed.bin: byte 8: the data file has 8 "
                                 "bytes; the index describes 10")));
}

TEST_F(SftDatasetTest, PaddedRowsCountOnlyTheMaskedTargets) {
  Write();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SftDataset> opened,
                              SftDataset::Open(dir_, 16));
  std::shared_ptr<const SftDataset> d = std::move(opened);
  SftSource source(d, /*seed=*/3, /*packing=*/false);
  // Every epoch holds every example once.
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::set<int64_t> seen;
    for (int64_t k = 0; k < 3; ++k) seen.insert(source.Example(epoch * 3 + k));
    EXPECT_EQ(seen.size(), 3u);
  }
  for (int64_t k = 0; k < 6; ++k) {
    const SftExample& e = examples_[source.Example(k)];
    std::vector<int32_t> in(6), tg(6);
    SHARDD_ASSERT_OK(
        source.FillRow(k, absl::MakeSpan(in), absl::MakeSpan(tg), {}));
    const size_t n = e.tokens.size();
    for (size_t j = 0; j < 6; ++j) {
      EXPECT_EQ(in[j], j < n ? e.tokens[j] : 0) << k << " " << j;
      const bool counted = j + 1 < n && e.mask[j + 1] == 1;
      EXPECT_EQ(tg[j], counted ? e.tokens[j + 1] : -1) << k << " " << j;
    }
  }
  // Example 0 has 5 tokens: a sequence of 3 cannot hold it.
  int64_t first = 0;
  while (source.Example(first) != 0) ++first;
  std::vector<int32_t> in(3), tg(3);
  EXPECT_THAT(source.FillRow(first, absl::MakeSpan(in), absl::MakeSpan(tg),
                             {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("example 0 (line 1) has 5 tokens; a "
                                 "sequence of 3 holds at most 4")));
  // Another seed, another order; the same seed, the same.
  SftSource again(d, 3, false), other(d, 4, false);
  bool differs = false;
  for (int64_t k = 0; k < 30; ++k) {
    EXPECT_EQ(again.Example(k), source.Example(k));
    differs |= other.Example(k) != source.Example(k);
  }
  EXPECT_TRUE(differs);
  EXPECT_NE(again.Fingerprint(), other.Fingerprint());
}

// Packed rows: each epoch's examples in order, cut greedily; every example
// appears once per epoch, whole, with its own segment, its own targets
// (none across an example's end) and the rest of the row padding.
TEST_F(SftDatasetTest, PackedRowsHoldWholeExamplesInOrder) {
  examples_.push_back({{1, 2, 3, 4, 5, 6, 7, 8, 9}, std::vector<uint8_t>(9, 1),
                       7});  // 9 tokens: S + 1 for S = 8, a row alone.
  Write();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SftDataset> opened,
                              SftDataset::Open(dir_, 16));
  std::shared_ptr<const SftDataset> d = std::move(opened);
  SftSource packed(d, /*seed=*/3, /*packing=*/true);
  SftSource padded(d, /*seed=*/3, /*packing=*/false);
  ASSERT_TRUE(packed.packed());
  constexpr int64_t kS = 8;
  // Rows of the first 3 epochs: 4 examples each, in the padded order.
  int64_t k = 0;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> seen;
    while (static_cast<int64_t>(seen.size()) < 4) {
      SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<int64_t> pack,
                                  packed.Pack(k, kS));
      std::vector<int32_t> in(kS), tg(kS), seg(kS);
      SHARDD_ASSERT_OK(packed.FillRow(k, absl::MakeSpan(in),
                                      absl::MakeSpan(tg), absl::MakeSpan(seg)));
      int64_t pos = 0, tokens = 0;
      for (int64_t e : pack) tokens += std::min<int64_t>(d->length(e), kS);
      EXPECT_LE(tokens, kS);
      for (int64_t e : pack) {
        const SftExample& x = examples_[e];
        const int64_t n = x.tokens.size();
        for (int64_t j = 0; j < std::min<int64_t>(n, kS); ++j) {
          EXPECT_EQ(in[pos + j], x.tokens[j]);
          EXPECT_EQ(seg[pos + j], pos);
          const bool counted = j + 1 < n && x.mask[j + 1] == 1;
          EXPECT_EQ(tg[pos + j], counted ? x.tokens[j + 1] : -1);
        }
        pos += std::min<int64_t>(n, kS);
        seen.push_back(e);
      }
      for (; pos < kS; ++pos) {
        EXPECT_EQ(tg[pos], -1);
        EXPECT_EQ(in[pos], 0);
      }
      ++k;
    }
    ASSERT_EQ(seen.size(), 4u);
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ(seen[i], padded.Example(epoch * 4 + i)) << epoch << " " << i;
    }
  }
  // A shorter sequence cannot hold the 9-token example.
  bool refused = false;
  for (int64_t r = 0; r < 8 && !refused; ++r) {
    std::vector<int32_t> in(6), tg(6), seg(6);
    const absl::Status st = packed.FillRow(
        r, absl::MakeSpan(in), absl::MakeSpan(tg), absl::MakeSpan(seg));
    refused = !st.ok();
    if (refused) {
      EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("example 3 (line 7) has 9 tokens")));
    }
  }
  EXPECT_TRUE(refused);
  EXPECT_NE(packed.Fingerprint(), padded.Fingerprint());
}

// DiffusionGemma's rows: the prompt before the first counted token, the
// response then EOS to a multiple of the block, padding; the encoder's
// targets every next token of those, the canvas the response's scored
// tokens (an uncounted one inside it kept out) and the EOS fill.
TEST_F(SftDatasetTest, DiffusionRowsSplitPromptAndCanvas) {
  constexpr int32_t kEos = 15;
  examples_.push_back({{13, 14, 15, 1, 2}, {0, 1, 0, 1, 0}, 6});
  WriteSftDataset(dir_, examples_, /*vocab=*/16, 1 << 20, 1, kEos);
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SftDataset> opened,
                              SftDataset::Open(dir_, 16));
  std::shared_ptr<const SftDataset> d = std::move(opened);
  EXPECT_EQ(d->eos_id(), kEos);
  DiffusionRows rows;
  rows.canvas = 8;
  rows.block = 4;
  SftSource source(d, /*seed=*/3, /*packing=*/true, rows);
  EXPECT_FALSE(source.packed());  // One example per row, whatever asked.
  EXPECT_EQ(source.canvas(), 8);
  SHARDD_EXPECT_OK(source.CheckSequenceLength(8));
  struct Want {
    std::vector<int32_t> inputs, targets, canvas;
    int32_t start;
  };
  const int32_t e = kEos;
  const std::vector<Want> want = {
      {{1, 2, 3, 4, 5, e, 0, 0}, {2, 3, 4, 5, e, -1, -1, -1},
       {3, 4, 5, e, -1, -1, -1, -1}, 2},
      {{6, 7, 8, e, e, 0, 0, 0}, {7, 8, e, e, -1, -1, -1, -1},
       {7, 8, e, e, -1, -1, -1, -1}, 1},
      {{9, 10, 11, 12, e, e, e, 0}, {10, 11, 12, e, e, e, -1, -1},
       {12, e, e, e, -1, -1, -1, -1}, 3},
      {{13, 14, 15, 1, 2, 0, 0, 0}, {14, 15, 1, 2, -1, -1, -1, -1},
       {14, -1, 1, -1, -1, -1, -1, -1}, 1},
  };
  for (int64_t k = 0; k < 8; ++k) {
    const Want& w = want[source.Example(k)];
    std::vector<int32_t> in(8), tg(8), canvas(8);
    int32_t start = -1;
    SHARDD_ASSERT_OK(
        source.FillRow(k, absl::MakeSpan(in), absl::MakeSpan(tg), {}));
    SHARDD_ASSERT_OK(source.FillCanvas(k, 8, &start, absl::MakeSpan(canvas)));
    EXPECT_EQ(in, w.inputs) << k;
    EXPECT_EQ(tg, w.targets) << k;
    EXPECT_EQ(canvas, w.canvas) << k;
    EXPECT_EQ(start, w.start) << k;
  }
  // Example 2 needs 3 + 4 positions; its response 4 canvas rows.
  EXPECT_THAT(source.CheckSequenceLength(6),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("example 2 (line 4): its prompt (3 tokens) "
                                 "and response (1, padded with EOS to blocks "
                                 "of 4: 4) need 7 positions; a sequence has "
                                 "6 (raise --seq)")));
  rows.canvas = 2;
  EXPECT_THAT(SftSource(d, 3, false, rows).CheckSequenceLength(8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("needs 4 canvas rows (padded with EOS to "
                                 "blocks of 4); the canvas has 2 (raise "
                                 "--response-length)")));
  // The canvas layout is part of the stream's identity.
  rows.canvas = 12;
  EXPECT_NE(SftSource(d, 3, false, rows).Fingerprint(), source.Fingerprint());
  // A dataset without eos_id cannot be laid out so.
  Write();
  SHARDD_ASSERT_OK_AND_ASSIGN(opened, SftDataset::Open(dir_, 16));
  EXPECT_EQ(opened->eos_id(), -1);
  std::shared_ptr<const SftDataset> no_eos = std::move(opened);
  EXPECT_THAT(SftSource(no_eos, 3, false, rows).CheckSequenceLength(8),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("has no eos_id")));
}

}  // namespace
}  // namespace data
}  // namespace shardd
