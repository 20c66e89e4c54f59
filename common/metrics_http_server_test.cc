#include "common/metrics_http_server.h"

#include <httplib.h>

#include <string>

#include "common/metrics_registry.h"
#include "common/metrics_text_parser.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;
using ::testing::Optional;

class MetricsHttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        counter_,
        registry_.AddCounter("test_requests_total", "Requests.", {"path"}));
    counter_->Add({"/a"}, 7);
    registry_.AddCollector([this] { ++scrapes_; });
    SHARDD_ASSERT_OK_AND_ASSIGN(server_,
                                MetricsHttpServer::Start({}, &registry_));
  }

  httplib::Client Client() {
    httplib::Client client("127.0.0.1", server_->port());
    client.set_connection_timeout(5);
    client.set_read_timeout(5);
    return client;
  }

  MetricsRegistry registry_;
  CounterFamily* counter_ = nullptr;
  std::atomic<int> scrapes_{0};
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpServerTest, ServesMetricsOverLoopback) {
  ASSERT_GT(server_->port(), 0);
  EXPECT_EQ(server_->address(), "127.0.0.1:" + std::to_string(server_->port()));
  httplib::Client client = Client();
  httplib::Result result = client.Get("/metrics");
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_EQ(result->status, 200);
  EXPECT_EQ(result->get_header_value("Content-Type"),
            "text/plain; version=0.0.4; charset=utf-8");
  SHARDD_ASSERT_OK_AND_ASSIGN(ParsedMetrics parsed,
                              ParseMetricsText(result->body));
  EXPECT_THAT(parsed.Find("test_requests_total", {{"path", "/a"}}),
              Optional(7.0));
  EXPECT_EQ(scrapes_.load(), 1);

  // A second scrape sees new values (rendered per request).
  counter_->Add({"/a"}, 1);
  result = client.Get("/metrics?x=1");
  ASSERT_TRUE(result);
  SHARDD_ASSERT_OK_AND_ASSIGN(parsed, ParseMetricsText(result->body));
  EXPECT_THAT(parsed.Find("test_requests_total", {{"path", "/a"}}),
              Optional(8.0));
  EXPECT_EQ(scrapes_.load(), 2);
}

TEST_F(MetricsHttpServerTest, HealthzAndErrors) {
  httplib::Client client = Client();
  httplib::Result health = client.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "ok\n");

  httplib::Result missing = client.Get("/nope");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);

  httplib::Result post = client.Post("/metrics", "x", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);

  // Bodies over the limit are refused by their declared length.
  httplib::Result big =
      client.Post("/metrics", std::string(64 << 10, 'x'), "text/plain");
  if (big) {
    EXPECT_EQ(big->status, 413);
  }
  EXPECT_EQ(scrapes_.load(), 0);
  // The server still answers afterwards.
  httplib::Result again = Client().Get("/metrics");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200);
  EXPECT_EQ(scrapes_.load(), 1);
}

TEST_F(MetricsHttpServerTest, ShutdownStopsServingAndIsIdempotent) {
  const int port = server_->port();
  server_->Shutdown();
  server_->Shutdown();
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(1);
  EXPECT_FALSE(client.Get("/healthz"));
}

TEST(MetricsHttpServerStartTest, RefusesBadAddressesAndBusyPorts) {
  MetricsRegistry registry;
  for (const char* bad : {"", "no-port", "host:", "host:65536", ":80",
                          "127.0.0.1:-1", "127.0.0.1:x"}) {
    MetricsHttpServerOptions options;
    options.listen_address = bad;
    EXPECT_THAT(MetricsHttpServer::Start(options, &registry),
                StatusIs(absl::StatusCode::kInvalidArgument))
        << bad;
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(auto first,
                              MetricsHttpServer::Start({}, &registry));
  MetricsHttpServerOptions taken;
  taken.listen_address = "127.0.0.1:" + std::to_string(first->port());
  EXPECT_THAT(MetricsHttpServer::Start(taken, &registry),
              StatusIs(absl::StatusCode::kUnavailable));
}

TEST(MetricsHttpServerStartTest, ImmediateShutdownAfterStart) {
  MetricsRegistry registry;
  for (int i = 0; i < 20; ++i) {
    SHARDD_ASSERT_OK_AND_ASSIGN(auto server,
                                MetricsHttpServer::Start({}, &registry));
    server->Shutdown();
  }
}

TEST(SplitHostPortTest, Splits) {
  EXPECT_THAT(SplitHostPort("[::1]:9100"),
              IsOkAndHolds(std::make_pair(std::string("::1"), 9100)));
  EXPECT_THAT(SplitHostPort("0.0.0.0:0"),
              IsOkAndHolds(std::make_pair(std::string("0.0.0.0"), 0)));
}

}  // namespace
}  // namespace shardd
