#include "kernels/cpu/compute_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

extern "C" void openblas_set_num_threads(int);

namespace shardd {
namespace kernels {
namespace {

thread_local bool in_region = false;

struct Job {
  absl::FunctionRef<void(int64_t, int64_t)> fn;
  int64_t n;
  int64_t grain;
  int64_t chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Runs chunks of `job` until none are left.
void Drain(Job* job) {
  for (;;) {
    const int64_t c = job->next.fetch_add(1, std::memory_order_relaxed);
    if (c >= job->chunks) return;
    const int64_t begin = c * job->grain;
    job->fn(begin, std::min(job->n, begin + job->grain));
    job->done.fetch_add(1, std::memory_order_acq_rel);
  }
}

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Loop(); });
  }
  ~Pool() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : workers_) t.join();
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // False when another caller holds the pool (the caller runs inline).
  bool Run(Job* job) {
    if (!submit_mu_.TryLock()) return false;
    {
      absl::MutexLock lock(&mu_);
      job_ = job;
      ++generation_;
    }
    in_region = true;
    Drain(job);
    in_region = false;
    {
      // Waits for the chunks other threads took, and for every thread that
      // saw the job to let go of it, before the job (on the caller's stack)
      // goes away.
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Pool::JobFinished));
      job_ = nullptr;
    }
    submit_mu_.Unlock();
    return true;
  }

 private:
  // What a pool thread waits for: a new job or the stop.
  struct Wake {
    const Pool* pool;
    uint64_t seen;
    bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->mu_) {
      return pool->stop_ || pool->generation_ != seen;
    }
  };

  bool JobFinished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return busy_ == 0 &&
           job_->done.load(std::memory_order_acquire) == job_->chunks;
  }

  void Loop() {
    in_region = true;
    uint64_t seen = 0;
    for (;;) {
      Job* job = nullptr;
      {
        absl::MutexLock lock(&mu_);
        const Wake wake{this, seen};
        mu_.Await(absl::Condition(&wake, &Wake::Ready));
        if (stop_) return;
        seen = generation_;
        job = job_;
        if (job == nullptr) continue;  // finished before this thread woke
        ++busy_;
      }
      Drain(job);
      absl::MutexLock lock(&mu_);
      --busy_;
    }
  }

  absl::Mutex submit_mu_;
  absl::Mutex mu_;
  Job* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// The CPUs this process may run on (a container's cpuset, taskset), not
// every core of the host.
int AffinityCpus() {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int n = sched_getaffinity(0, sizeof(cpus), &cpus) == 0
                    ? CPU_COUNT(&cpus)
                    : static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(n, 1, kMaxComputeThreads);
}

absl::Mutex pool_mu(absl::kConstInit);
Pool* pool ABSL_GUARDED_BY(pool_mu) = nullptr;

Pool* GetPool() {
  absl::MutexLock lock(&pool_mu);
  if (pool == nullptr) {
    // Every GEMM goes through Sgemm, which splits it over this pool.
    openblas_set_num_threads(1);
    const absl::StatusOr<int> threads = ComputeThreadsFromEnvironment();
    pool = new Pool(threads.ok() ? *threads : AffinityCpus());
  }
  return pool;
}

}  // namespace

int ComputeThreads() { return GetPool()->threads(); }

absl::StatusOr<int> ComputeThreadsFromEnvironment() {
  for (const char* name : {kComputeThreadsEnv, "OPENBLAS_NUM_THREADS"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    int n = 0;
    if (!absl::SimpleAtoi(value, &n) || n < 1 || n > kMaxComputeThreads) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be an integer in [1, ", kMaxComputeThreads,
                       "], got \"", value, "\""));
    }
    return n;
  }
  return AffinityCpus();
}

absl::Status SetComputeThreads(int n) {
  if (n < 1 || n > kMaxComputeThreads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compute threads must be in [1, ", kMaxComputeThreads, "], got ", n));
  }
  GetPool();
  absl::MutexLock lock(&pool_mu);
  if (pool->threads() != n) {
    delete pool;
    pool = new Pool(n);
  }
  return absl::OkStatus();
}

bool InParallelRegion() { return in_region; }

int UsableThreads() { return in_region ? 1 : ComputeThreads(); }

void FillZero(void* data, int64_t bytes) {
  char* bytes_at = static_cast<char*>(data);
  constexpr int64_t kBytes = kElementGrain * sizeof(float);
  ParallelFor(bytes, kBytes, [&](int64_t begin, int64_t end) {
    std::memset(bytes_at + begin, 0, static_cast<size_t>(end - begin));
  });
}

void ParallelFor(int64_t n, int64_t grain,
                 absl::FunctionRef<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  if (chunks > 1 && !in_region) {
    Pool* p = GetPool();
    if (p->threads() > 1) {
      Job job{fn, n, grain, chunks};
      if (p->Run(&job)) return;
    }
  }
  for (int64_t begin = 0; begin < n; begin += grain) {
    fn(begin, std::min(n, begin + grain));
  }
}

}  // namespace kernels
}  // namespace shardd
