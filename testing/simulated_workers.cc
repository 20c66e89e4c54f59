#include "testing/simulated_workers.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "worker/grpc/heartbeat_relay.h"

namespace shardd {
namespace testing_util {
namespace {

// One asynchronous call: its context, messages and start.
template <typename Request, typename Response>
struct Call {
  grpc::ClientContext context;
  Request request;
  Response response;
  absl::Time start;
};

// What a batch of calls measured.
struct BatchRecord {
  absl::Mutex mu;
  std::vector<double> seconds ABSL_GUARDED_BY(mu);
  std::vector<absl::Time> done ABSL_GUARDED_BY(mu);
  int64_t errors ABSL_GUARDED_BY(mu) = 0;
  std::string first_error ABSL_GUARDED_BY(mu);
};

// Issues `n` calls at once (request i from make(i), sent by
// issue(i, call)), waits for every answer, and returns their latencies;
// `last_sent` and `last_done` receive the last send and answer times.
template <typename Request, typename Response>
Latencies RunBatch(
    int n, absl::Duration deadline,
    const std::function<void(int, Request*)>& make,
    const std::function<void(int, Call<Request, Response>*,
                             std::function<void(grpc::Status)>)>& issue,
    absl::Time* last_sent = nullptr, absl::Time* last_done = nullptr) {
  BatchRecord record;
  absl::BlockingCounter pending(n);
  const absl::Time begin = absl::Now();
  absl::Time sent = begin;
  for (int i = 0; i < n; ++i) {
    auto* call = new Call<Request, Response>();
    make(i, &call->request);
    call->context.set_deadline(std::chrono::system_clock::now() +
                               absl::ToChronoNanoseconds(deadline));
    call->start = absl::Now();
    sent = call->start;
    issue(i, call, [call, &record, &pending](grpc::Status status) {
      const absl::Time end = absl::Now();
      {
        absl::MutexLock lock(&record.mu);
        record.seconds.push_back(absl::ToDoubleSeconds(end - call->start));
        record.done.push_back(end);
        if (!status.ok()) {
          if (record.errors++ == 0) {
            record.first_error =
                absl::StrCat(status.error_code(), ": ", status.error_message());
          }
        }
      }
      delete call;
      pending.DecrementCount();
    });
  }
  pending.Wait();
  Latencies out;
  absl::MutexLock lock(&record.mu);
  out.errors = record.errors;
  out.first_error = record.first_error;
  Summarize(&record.seconds, &out);
  absl::Time end = begin;
  for (absl::Time t : record.done) end = std::max(end, t);
  out.wall = absl::ToDoubleSeconds(end - begin);
  if (last_sent != nullptr) *last_sent = sent;
  if (last_done != nullptr) *last_done = end;
  return out;
}

}  // namespace

void Summarize(std::vector<double>* seconds, Latencies* out) {
  out->calls = static_cast<int64_t>(seconds->size());
  if (seconds->empty()) return;
  std::sort(seconds->begin(), seconds->end());
  auto at = [&](double q) {
    const size_t i =
        std::min(seconds->size() - 1, static_cast<size_t>(q * seconds->size()));
    return (*seconds)[i];
  };
  out->p50 = at(0.50);
  out->p90 = at(0.90);
  out->p99 = at(0.99);
  out->max = seconds->back();
}

SimulatedWorkers::SimulatedWorkers(const Options& options)
    : options_(options),
      relay_of_(new std::atomic<int>[options.workers]),
      ranks_(options.workers, -1),
      incarnations_(options.workers, 0),
      silenced_(new std::atomic<bool>[options.workers]) {
  for (int i = 0; i < options.workers; ++i) {
    silenced_[i] = false;
    relay_of_[i] = -1;
  }
}

absl::StatusOr<std::unique_ptr<SimulatedWorkers>> SimulatedWorkers::Create(
    const Options& options) {
  if (options.coordinator.empty() || options.workers < 1 ||
      options.channels < 1 ||
      (!options.addresses.empty() &&
       static_cast<int>(options.addresses.size()) != options.workers)) {
    return absl::InvalidArgumentError(
        "simulated workers: need a coordinator address, workers >= 1, "
        "channels >= 1, and no addresses or one per worker");
  }
  std::unique_ptr<SimulatedWorkers> workers(new SimulatedWorkers(options));
  for (int c = 0; c < options.channels; ++c) {
    grpc::ChannelArguments args;
    // Separate connections, not one shared subchannel.
    args.SetInt("shardd.simulated_channel", c);
    workers->stubs_.push_back(
        v1::Coordinator::NewStub(grpc::CreateCustomChannel(
            options.coordinator, grpc::InsecureChannelCredentials(), args)));
  }
  for (int i = 0; i < options.workers; ++i) {
    workers->incarnations_[i] = 1000 + static_cast<uint64_t>(i);
  }
  if (options.service != nullptr) {
    for (int c = 0; c < options.channels; ++c) {
      grpc::ChannelArguments args;
      args.SetInt("shardd.simulated_relay_channel", c);
      workers->relay_stubs_.push_back(v1::Worker::NewStub(
          grpc::CreateCustomChannel(options.service->address(0),
                                    grpc::InsecureChannelCredentials(), args)));
    }
  }
  return workers;
}

SimulatedWorkers::~SimulatedWorkers() {
  if (heartbeats_.joinable()) StopHeartbeats();
}

absl::StatusOr<Latencies> SimulatedWorkers::RegisterAll() {
  using Call = Call<v1::RegisterWorkerRequest, v1::RegisterWorkerResponse>;
  std::vector<v1::RegisterWorkerResponse> responses(options_.workers);
  absl::Mutex mu;
  const Latencies out =
      RunBatch<v1::RegisterWorkerRequest, v1::RegisterWorkerResponse>(
          options_.workers, options_.deadline,
          [&](int i, v1::RegisterWorkerRequest* request) {
            request->set_address(options_.addresses.empty()
                                     ? absl::StrCat("127.0.0.1:", 40000 + i)
                                     : options_.addresses[i]);
            request->set_incarnation(incarnations_[i]);
            request->set_device("cpu");
            request->set_hostname("simulated");
            request->set_requested_rank(i);
          },
          [&](int i, Call* call, std::function<void(grpc::Status)> done) {
            stub(i)->async()->RegisterWorker(
                &call->context, &call->request, &call->response,
                [&, i, call, done = std::move(done)](grpc::Status status) {
                  {
                    absl::MutexLock lock(&mu);
                    responses[i] = call->response;
                  }
                  done(status);
                });
          });
  if (out.errors > 0) {
    return absl::UnavailableError(absl::StrCat(
        out.errors, " registrations failed, the first: ", out.first_error));
  }
  index_of_rank_.clear();
  for (int i = 0; i < options_.workers; ++i) {
    ranks_[i] = responses[i].rank();
    interval_ = absl::Milliseconds(responses[i].heartbeat_interval_ms());
    if (ranks_[i] >= static_cast<int>(index_of_rank_.size())) {
      index_of_rank_.resize(ranks_[i] + 1, -1);
    }
    if (ranks_[i] >= 0) index_of_rank_[ranks_[i]] = i;
  }
  return out;
}

void SimulatedWorkers::StartHeartbeats(absl::Duration interval) {
  {
    absl::MutexLock lock(&mu_);
    beat_seconds_.clear();
    beat_errors_ = 0;
    beat_first_error_.clear();
  }
  stop_ = false;
  beats_started_ = absl::Now();
  heartbeats_ = std::thread([this, interval] { HeartbeatLoop(interval); });
}

void SimulatedWorkers::HeartbeatLoop(absl::Duration interval) {
  if (options_.service != nullptr) {
    // As CoordinatorAgent.
    for (int i = 0; i < options_.workers; ++i) {
      options_.service->relay(i)->set_stale_after(interval *
                                                  kRelayStaleIntervals);
    }
  }
  // Ticks of 1 ms, each sending its share of the round.
  const absl::Duration tick = absl::Milliseconds(1);
  const double per_tick = options_.workers * absl::FDivDuration(tick, interval);
  double owed = 0;
  int next = 0;
  absl::Time at = absl::Now();
  while (!stop_) {
    owed += per_tick;
    for (; owed >= 1; owed -= 1) {
      const int i = next;
      next = (next + 1) % options_.workers;
      if (silenced_[i] || ranks_[i] < 0) continue;
      {
        absl::MutexLock lock(&mu_);
        ++in_flight_;
      }
      const int relay = relay_of_[i].load();
      if (relay >= 0) {
        BeatThroughRelay(i, relay, interval);
      } else {
        BeatCoordinator(i, interval, absl::Now());
      }
    }
    at += tick;
    absl::SleepFor(at - absl::Now());
  }
}

void SimulatedWorkers::BeatDone(absl::Time start, const grpc::Status& status) {
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock lock(&mu_);
  beat_seconds_.push_back(seconds);
  if (!status.ok() && beat_errors_++ == 0) {
    beat_first_error_ =
        absl::StrCat(status.error_code(), ": ", status.error_message());
  }
  --in_flight_;
}

void SimulatedWorkers::BeatCoordinator(int i, absl::Duration interval,
                                       absl::Time start) {
  auto* call = new Call<v1::HeartbeatRequest, v1::HeartbeatResponse>();
  call->request.set_rank(ranks_[i]);
  call->request.set_incarnation(incarnations_[i]);
  HeartbeatRelay* relay =
      options_.service != nullptr ? options_.service->relay(i) : nullptr;
  if (relay != nullptr) {
    for (v1::RelayedHeartbeat& beat : relay->TakePending()) {
      *call->request.add_relayed() = std::move(beat);
    }
  }
  call->context.set_deadline(std::chrono::system_clock::now() +
                             absl::ToChronoNanoseconds(interval));
  call->start = start;
  stub(i)->async()->Heartbeat(
      &call->context, &call->request, &call->response,
      [this, i, call, relay](grpc::Status status) {
        if (relay != nullptr) {
          if (status.ok()) {
            relay->Delivered(call->response);
          } else {
            relay->Failed();
          }
        }
        if (status.ok() && options_.service != nullptr) {
          const int r = call->response.relay_address().empty()
                            ? -1
                            : call->response.relay_rank();
          relay_of_[i] = r >= 0 && r < static_cast<int>(index_of_rank_.size())
                             ? index_of_rank_[r]
                             : -1;
        }
        const absl::Time begun = call->start;
        delete call;
        BeatDone(begun, status);
      });
}

void SimulatedWorkers::BeatThroughRelay(int i, int relay,
                                        absl::Duration interval) {
  auto* call = new Call<v1::HeartbeatRequest, v1::HeartbeatResponse>();
  call->request.set_rank(ranks_[i]);
  call->request.set_incarnation(incarnations_[i]);
  call->context.set_authority(options_.service->address(relay));
  call->context.set_deadline(std::chrono::system_clock::now() +
                             absl::ToChronoNanoseconds(interval *
                                                       kRelayCallIntervals));
  call->start = absl::Now();
  relay_stubs_[i % relay_stubs_.size()]->async()->RelayHeartbeat(
      &call->context, &call->request, &call->response,
      [this, i, call, interval](grpc::Status status) {
        const absl::Time begun = call->start;
        delete call;
        if (RelayAnswered(FromGrpcStatus(status).code())) {
          BeatDone(begun, status);
          return;
        }
        // The relay cannot relay now: the coordinator, in the same beat.
        relay_of_[i] = -1;
        BeatCoordinator(i, interval, begun);
      });
}

Latencies SimulatedWorkers::StopHeartbeats() {
  stop_ = true;
  if (heartbeats_.joinable()) heartbeats_.join();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int64_t* n) { return *n == 0; }, &in_flight_));
  Latencies out;
  out.errors = beat_errors_;
  out.first_error = beat_first_error_;
  out.wall = absl::ToDoubleSeconds(absl::Now() - beats_started_);
  std::vector<double> seconds = beat_seconds_;
  Summarize(&seconds, &out);
  return out;
}

void SimulatedWorkers::Silence(int index) { silenced_[index] = true; }

absl::StatusOr<SimulatedWorkers::BarrierResult> SimulatedWorkers::Barrier(
    const std::string& id) {
  using Call = Call<v1::BarrierRequest, v1::BarrierResponse>;
  BarrierResult result;
  absl::Time last_sent, last_done;
  result.calls = RunBatch<v1::BarrierRequest, v1::BarrierResponse>(
      options_.workers, options_.deadline,
      [&](int i, v1::BarrierRequest* request) {
        request->set_barrier_id(id);
        request->set_participants(options_.workers);
        request->set_caller(absl::StrCat("sim-", i));
        request->set_timeout_ms(absl::ToInt64Milliseconds(options_.deadline));
      },
      [&](int i, Call* call, std::function<void(grpc::Status)> done) {
        stub(i)->async()->Barrier(&call->context, &call->request,
                                  &call->response, std::move(done));
      },
      &last_sent, &last_done);
  if (result.calls.errors > 0) {
    return absl::UnavailableError(absl::StrCat(
        result.calls.errors,
        " barrier calls failed, the first: ", result.calls.first_error));
  }
  result.release = absl::ToDoubleSeconds(last_done - last_sent);
  return result;
}

absl::StatusOr<SimulatedWorkers::FanoutResult> SimulatedWorkers::KvFanout(
    const std::string& key, int64_t bytes) {
  using Get = Call<v1::GetRequest, v1::GetResponse>;
  FanoutResult result;
  const int waiters = options_.workers - 1;
  if (waiters < 1) {
    return absl::InvalidArgumentError("a fan-out needs >= 2 workers");
  }
  absl::Time put_sent;
  std::atomic<int64_t> wrong{0};
  std::thread gets([&] {
    absl::Time last_sent, last_done;
    result.gets = RunBatch<v1::GetRequest, v1::GetResponse>(
        waiters, options_.deadline,
        [&](int, v1::GetRequest* request) {
          request->set_key(key);
          request->set_wait_ms(absl::ToInt64Milliseconds(options_.deadline));
        },
        [&](int i, Get* call, std::function<void(grpc::Status)> done) {
          stub(i + 1)->async()->Get(
              &call->context, &call->request, &call->response,
              [&wrong, bytes, call, done = std::move(done)](grpc::Status s) {
                if (s.ok() && static_cast<int64_t>(
                                  call->response.value().size()) != bytes) {
                  ++wrong;
                }
                done(s);
              });
        },
        &last_sent, &last_done);
    result.fanout = absl::ToDoubleSeconds(last_done - put_sent);
  });
  // Give the waits a moment to arrive, then publish the key.
  absl::SleepFor(absl::Milliseconds(200) +
                 absl::Microseconds(100) * options_.workers);
  v1::PutRequest put;
  put.set_key(key);
  put.set_value(std::string(static_cast<size_t>(bytes), 'k'));
  v1::PutResponse put_response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoNanoseconds(options_.deadline));
  put_sent = absl::Now();
  const grpc::Status put_status = stub(0)->Put(&context, put, &put_response);
  gets.join();
  if (!put_status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("Put: ", put_status.error_message()));
  }
  if (result.gets.errors > 0 || wrong > 0) {
    return absl::UnavailableError(
        absl::StrCat(result.gets.errors,
                     " waits failed (the first: ", result.gets.first_error,
                     "), ", wrong.load(), " returned the wrong value"));
  }
  return result;
}

}  // namespace testing_util
}  // namespace shardd
