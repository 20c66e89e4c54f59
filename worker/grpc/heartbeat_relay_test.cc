#include "worker/grpc/heartbeat_relay.h"

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

v1::HeartbeatRequest Beat(int rank, uint64_t incarnation) {
  v1::HeartbeatRequest beat;
  beat.set_rank(rank);
  beat.set_incarnation(incarnation);
  return beat;
}

v1::HeartbeatResponse Answer(uint64_t coordinator, uint64_t epoch) {
  v1::HeartbeatResponse response;
  response.set_coordinator_incarnation(coordinator);
  response.set_membership_epoch(epoch);
  return response;
}

class HeartbeatRelayTest : public ::testing::Test {
 protected:
  HeartbeatRelayOptions Options() {
    HeartbeatRelayOptions options;
    options.stale_after = absl::Seconds(2);
    options.clock = [this] { return now_; };
    return options;
  }
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

TEST_F(HeartbeatRelayTest, TurnsCallersAwayUntilTheCoordinatorAnswered) {
  HeartbeatRelay relay(Options());
  EXPECT_THAT(relay.Record(Beat(1, 11)).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("directly")));
  EXPECT_TRUE(relay.TakePending().empty());
  relay.Delivered(Answer(7, 3));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::HeartbeatResponse got,
                              relay.Record(Beat(1, 11)));
  EXPECT_EQ(got.coordinator_incarnation(), 7u);
  EXPECT_EQ(got.membership_epoch(), 3u);
  EXPECT_TRUE(got.relay_address().empty());
}

TEST_F(HeartbeatRelayTest, ForwardsEachRanksNewestBeatOnce) {
  HeartbeatRelay relay(Options());
  relay.Delivered(Answer(7, 3));
  SHARDD_ASSERT_OK(relay.Record(Beat(4, 40)).status());
  SHARDD_ASSERT_OK(relay.Record(Beat(2, 20)).status());
  SHARDD_ASSERT_OK(relay.Record(Beat(4, 41)).status());
  std::vector<v1::RelayedHeartbeat> taken = relay.TakePending();
  ASSERT_EQ(taken.size(), 2u);
  EXPECT_EQ(taken[0].rank(), 2);
  EXPECT_EQ(taken[0].incarnation(), 20u);
  EXPECT_EQ(taken[1].rank(), 4);
  EXPECT_EQ(taken[1].incarnation(), 41u);
  EXPECT_TRUE(relay.TakePending().empty());
  EXPECT_EQ(relay.relayed(), 0);
  relay.Delivered(Answer(7, 4));
  EXPECT_EQ(relay.relayed(), 0);  // The second TakePending carried none.
  SHARDD_ASSERT_OK(relay.Record(Beat(2, 20)).status());
  ASSERT_EQ(relay.TakePending().size(), 1u);
  relay.Delivered(Answer(7, 4));
  EXPECT_EQ(relay.relayed(), 1);
}

TEST_F(HeartbeatRelayTest, PassesTheCoordinatorsRefusalOnOnce) {
  HeartbeatRelay relay(Options());
  relay.Delivered(Answer(7, 3));
  SHARDD_ASSERT_OK(relay.Record(Beat(2, 20)).status());
  SHARDD_ASSERT_OK(relay.Record(Beat(3, 30)).status());
  relay.TakePending();
  v1::HeartbeatResponse answer = Answer(7, 5);
  v1::RelayedHeartbeatError* error = answer.add_relayed_errors();
  error->set_rank(3);
  error->set_code(static_cast<int>(absl::StatusCode::kAborted));
  error->set_message("rank 3 was declared dead");
  relay.Delivered(answer);
  EXPECT_THAT(relay.Record(Beat(3, 30)).status(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("declared dead")));
  // Said once: the worker registers again and beats anew.
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::HeartbeatResponse got,
                              relay.Record(Beat(3, 30)));
  EXPECT_EQ(got.membership_epoch(), 5u);
  EXPECT_TRUE(got.relayed_errors().empty());
  SHARDD_EXPECT_OK(relay.Record(Beat(2, 20)).status());
}

TEST_F(HeartbeatRelayTest, IgnoresARefusalOfAnotherIncarnation) {
  HeartbeatRelay relay(Options());
  relay.Delivered(Answer(7, 3));
  SHARDD_ASSERT_OK(relay.Record(Beat(3, 30)).status());
  relay.TakePending();
  v1::HeartbeatResponse answer = Answer(7, 3);
  v1::RelayedHeartbeatError* error = answer.add_relayed_errors();
  error->set_rank(3);
  error->set_code(static_cast<int>(absl::StatusCode::kNotFound));
  relay.Delivered(answer);
  // A restarted worker on rank 3 (a new incarnation) is not refused.
  SHARDD_EXPECT_OK(relay.Record(Beat(3, 31)).status());
}

TEST_F(HeartbeatRelayTest, StaleOrFailedAnswersTurnCallersAway) {
  HeartbeatRelay relay(Options());
  relay.Delivered(Answer(7, 3));
  now_ += absl::Seconds(2);
  SHARDD_ASSERT_OK(relay.Record(Beat(1, 10)).status());
  now_ += absl::Milliseconds(1);
  EXPECT_THAT(relay.Record(Beat(1, 10)).status(),
              StatusIs(absl::StatusCode::kUnavailable));
  relay.Delivered(Answer(7, 3));
  SHARDD_ASSERT_OK(relay.Record(Beat(2, 20)).status());
  ASSERT_EQ(relay.TakePending().size(), 2u);
  relay.Failed();
  EXPECT_THAT(relay.Record(Beat(1, 10)).status(),
              StatusIs(absl::StatusCode::kUnavailable));
  // The failed heartbeat's beats are lost, not retried.
  relay.Delivered(Answer(7, 3));
  EXPECT_TRUE(relay.TakePending().empty());
  EXPECT_EQ(relay.relayed(), 0);
}

TEST_F(HeartbeatRelayTest, BoundsWhatItHolds) {
  HeartbeatRelayOptions options = Options();
  options.max_pending = 2;
  HeartbeatRelay relay(options);
  relay.Delivered(Answer(7, 3));
  SHARDD_ASSERT_OK(relay.Record(Beat(1, 10)).status());
  SHARDD_ASSERT_OK(relay.Record(Beat(2, 20)).status());
  EXPECT_THAT(relay.Record(Beat(3, 30)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("relays for 2 workers")));
  SHARDD_EXPECT_OK(relay.Record(Beat(1, 11)).status());
  relay.TakePending();
  SHARDD_EXPECT_OK(relay.Record(Beat(3, 30)).status());
}

TEST_F(HeartbeatRelayTest, RefusesMalformedBeatsByName) {
  HeartbeatRelay relay(Options());
  relay.Delivered(Answer(7, 3));
  EXPECT_THAT(relay.Record(Beat(-1, 10)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
  EXPECT_THAT(
      relay.Record(Beat(1, 0)).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("incarnation")));
  EXPECT_TRUE(relay.TakePending().empty());
}

}  // namespace
}  // namespace shardd
