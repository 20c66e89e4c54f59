#include "planner/strategy_registry.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/default_strategy.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

class FakeStrategy : public ShardingStrategy {
 public:
  explicit FakeStrategy(std::string name) : name_(std::move(name)) {}
  std::string name() const override { return name_; }
  std::string description() const override { return "fake " + name_; }
  absl::StatusOr<UnitGrouping> GroupParams(
      const v1::ModelSpec&, const v1::PlanOptions&) const override {
    return UnitGrouping();
  }

 private:
  std::string name_;
};

std::vector<std::string> Names(const StrategyRegistry& registry) {
  std::vector<std::string> names;
  for (const v1::StrategyInfo& info : registry.List()) {
    names.push_back(info.name());
  }
  return names;
}

std::vector<std::string> Architectures(const StrategyRegistry& registry,
                                       const std::string& name) {
  for (const v1::StrategyInfo& info : registry.List()) {
    if (info.name() == name) {
      return {info.architectures().begin(), info.architectures().end()};
    }
  }
  return {"<missing>"};
}

TEST(StrategyRegistryTest, EmptyRegistryHasDefault) {
  StrategyRegistry registry;
  EXPECT_THAT(Names(registry), ElementsAre("default"));
  EXPECT_EQ(registry.ForArchitecture("MixtralForCausalLM")->name(), "default");
  EXPECT_EQ(registry.ForArchitecture("")->name(), "default");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto strategy, registry.ByName("default"));
  EXPECT_EQ(strategy->name(), "default");
  EXPECT_THAT(Architectures(registry, "default"), IsEmpty());
}

TEST(StrategyRegistryTest, BuiltinsAreKeyedOnBareClassNames) {
  std::unique_ptr<StrategyRegistry> registry =
      StrategyRegistry::CreateWithBuiltins();
  EXPECT_THAT(Names(*registry),
              ElementsAre("deepseek_v4", "default", "diffusion_gemma",
                          "megatron_fsdp"));
  EXPECT_EQ(
      registry->ForArchitecture("DiffusionGemmaForBlockDiffusion")->name(),
      "diffusion_gemma");
  EXPECT_EQ(registry->ForArchitecture("DeepseekV4ForCausalLM")->name(),
            "deepseek_v4");
  EXPECT_EQ(registry->ForArchitecture("DeepseekV3ForCausalLM")->name(),
            "default");
  // Bare class names only: a module path is another name.
  EXPECT_EQ(registry->ForArchitecture("models.DiffusionGemmaForBlockDiffusion")
                ->name(),
            "default");
  // megatron_fsdp is reachable by name only.
  EXPECT_EQ(registry->ForArchitecture("megatron_fsdp")->name(), "default");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto megatron, registry->ByName("megatron_fsdp"));
  EXPECT_EQ(megatron->name(), "megatron_fsdp");
  EXPECT_THAT(Architectures(*registry, "diffusion_gemma"),
              ElementsAre("DiffusionGemmaForBlockDiffusion"));
  EXPECT_THAT(Architectures(*registry, "deepseek_v4"),
              ElementsAre("DeepseekV4ForCausalLM"));
  EXPECT_THAT(Architectures(*registry, "megatron_fsdp"), IsEmpty());
  for (const v1::StrategyInfo& info : registry->List()) {
    EXPECT_FALSE(info.description().empty()) << info.name();
  }
}

TEST(StrategyRegistryTest, UnknownNameListsRegisteredOnes) {
  std::unique_ptr<StrategyRegistry> registry =
      StrategyRegistry::CreateWithBuiltins();
  EXPECT_THAT(registry->ByName("fsdp3"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("fsdp3"), HasSubstr("deepseek_v4"),
                             HasSubstr("default"), HasSubstr("diffusion_gemma"),
                             HasSubstr("megatron_fsdp"))));
  EXPECT_THAT(registry->ByName(""), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("strategy")));
}

TEST(StrategyRegistryTest, RegisteringTheSameStrategyTwiceIsANoOp) {
  StrategyRegistry registry;
  auto first = std::make_shared<const FakeStrategy>("fake");
  SHARDD_ASSERT_OK(registry.Register("FakeArch", first));
  SHARDD_ASSERT_OK(registry.Register("FakeArch", first));
  // Another object of the same strategy: still a no-op, the first stays.
  SHARDD_ASSERT_OK(
      registry.Register("FakeArch", std::make_shared<FakeStrategy>("fake")));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto held, registry.ByName("fake"));
  EXPECT_EQ(held.get(), first.get());
  EXPECT_EQ(registry.ForArchitecture("FakeArch").get(), first.get());
  EXPECT_THAT(Names(registry), ElementsAre("default", "fake"));
  EXPECT_THAT(Architectures(registry, "fake"), ElementsAre("FakeArch"));
  // The built-in default registered again (by name only) is a no-op too.
  SHARDD_EXPECT_OK(
      registry.Register("", std::make_shared<const DefaultStrategy>()));
}

TEST(StrategyRegistryTest, OneStrategyMayServeSeveralArchitectures) {
  StrategyRegistry registry;
  auto fake = std::make_shared<const FakeStrategy>("fake");
  SHARDD_ASSERT_OK(registry.Register("B", fake));
  SHARDD_ASSERT_OK(registry.Register("A", fake));
  EXPECT_THAT(Architectures(registry, "fake"), ElementsAre("A", "B"));
  EXPECT_EQ(registry.ForArchitecture("A")->name(), "fake");
  EXPECT_EQ(registry.ForArchitecture("B")->name(), "fake");
}

TEST(StrategyRegistryTest, RefusesADifferentStrategyUnderATakenKey) {
  StrategyRegistry registry;
  SHARDD_ASSERT_OK(
      registry.Register("Arch", std::make_shared<FakeStrategy>("one")));
  EXPECT_THAT(registry.Register("Arch", std::make_shared<FakeStrategy>("two")),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       AllOf(HasSubstr("Arch"), HasSubstr("one"))));
  // The refusal changed nothing: "two" was not added by name either.
  EXPECT_EQ(registry.ForArchitecture("Arch")->name(), "one");
  EXPECT_THAT(Names(registry), ElementsAre("default", "one"));
  EXPECT_FALSE(registry.ByName("two").ok());
}

TEST(StrategyRegistryTest, RefusesAnotherImplementationUnderATakenName) {
  StrategyRegistry registry;
  auto impostor = std::make_shared<FakeStrategy>("default");
  EXPECT_THAT(registry.Register("Arch", impostor),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("default")));
  EXPECT_EQ(registry.ForArchitecture("Arch")->name(), "default");
  SHARDD_ASSERT_OK_AND_ASSIGN(auto held, registry.ByName("default"));
  EXPECT_NE(held.get(), impostor.get());
  EXPECT_NE(dynamic_cast<const DefaultStrategy*>(held.get()), nullptr);
  EXPECT_THAT(Architectures(registry, "default"), IsEmpty());
}

TEST(StrategyRegistryTest, RejectsNullAndNamelessStrategies) {
  StrategyRegistry registry;
  EXPECT_THAT(registry.Register("Arch", nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  EXPECT_THAT(registry.Register("Arch", std::make_shared<FakeStrategy>("")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name")));
  EXPECT_THAT(Names(registry), ElementsAre("default"));
}

TEST(StrategyRegistryTest, ConcurrentIdenticalRegistrationsAllSucceed) {
  StrategyRegistry registry;
  constexpr int kThreads = 8;
  constexpr int kRounds = 200;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&registry, &failures]() {
      for (int i = 0; i < kRounds; ++i) {
        if (!registry.Register("Shared", std::make_shared<FakeStrategy>("s"))
                 .ok()) {
          ++failures;
        }
        // Readers interleave with writers.
        const std::string name = registry.ForArchitecture("Shared")->name();
        if (name != "s" && name != "default") ++failures;
        registry.List();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_THAT(Names(registry), ElementsAre("default", "s"));
  EXPECT_THAT(Architectures(registry, "s"), ElementsAre("Shared"));
}

TEST(StrategyRegistryTest, ConcurrentRivalsExactlyOneWins) {
  StrategyRegistry registry;
  constexpr int kThreads = 8;
  std::vector<int> ok(kThreads, 0);
  std::vector<int> refused(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t]() {
      auto mine = std::make_shared<FakeStrategy>(absl::StrCat("rival", t));
      for (int i = 0; i < 50; ++i) {
        absl::Status status = registry.Register("Contested", mine);
        if (status.ok()) {
          ++ok[t];
        } else if (status.code() == absl::StatusCode::kAlreadyExists) {
          ++refused[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const std::string winner = registry.ForArchitecture("Contested")->name();
  int winners = 0;
  for (int t = 0; t < kThreads; ++t) {
    const bool is_winner = winner == absl::StrCat("rival", t);
    winners += is_winner;
    // The winner's every call succeeds (the first registers, the rest are
    // no-ops); every other thread is refused every time.
    EXPECT_EQ(ok[t], is_winner ? 50 : 0) << t;
    EXPECT_EQ(refused[t], is_winner ? 0 : 50) << t;
  }
  EXPECT_EQ(winners, 1);
  EXPECT_THAT(Names(registry), ElementsAre("default", winner));
}

}  // namespace
}  // namespace shardd
