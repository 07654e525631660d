// Persistent worker pool used by the CPU bodies of the native ops (see thread_pool.h).

#include "common/thread_pool.h"

#include <algorithm>
#include <exception>

#if defined(__linux__)
#include <dlfcn.h>
#include <sched.h>
#endif

namespace vllm_metal::cpu {

int ThreadPool::default_num_threads() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

ThreadPool& ThreadPool::instance() {
  // Leaked on purpose: joining threads during interpreter teardown is not safe.
  static ThreadPool* pool = new ThreadPool(default_num_threads());
  return *pool;
}

ThreadPool::ThreadPool(int n) { start(n); }

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::start(int n) {
  num_threads_ = n < 1 ? 1 : n;
  stopping_ = false;
  for (int t = 1; t < num_threads_; ++t) {
    workers_.emplace_back([this, t] { worker_loop(t); });
  }
}

void ThreadPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
  workers_.clear();
}

void ThreadPool::set_num_threads(int n) {
  std::lock_guard<std::mutex> call(call_mutex_);
  if (n <= 0) n = default_num_threads();
  if (n == num_threads_) return;
  stop();
  start(n);
}

void ThreadPool::run_share(int thread_id) {
  if (thread_id >= job_threads_) return;
  const auto& fn = *job_;
  for (;;) {
    int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= job_size_) break;
    fn(i, thread_id);
  }
}

void ThreadPool::worker_loop(int thread_id) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    run_share(thread_id);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_workers_ == 0) done_.notify_one();
    }
  }
}

bool ThreadPool::use_host_openmp(bool on) {
  std::lock_guard<std::mutex> call(call_mutex_);
  omp_parallel_ = nullptr;
  omp_thread_num_ = nullptr;
#if defined(__linux__)
  if (on) {
    // The ABI libgomp gives `#pragma omp parallel` (GCC >= 4.9); looked up, not linked, so the
    // extension adds no OpenMP runtime of its own and uses the one torch or MKL loaded.
    using Parallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
    using ThreadNum = int (*)();
    auto parallel = reinterpret_cast<Parallel>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
    auto thread_num = reinterpret_cast<ThreadNum>(dlsym(RTLD_DEFAULT, "omp_get_thread_num"));
    if (parallel != nullptr && thread_num != nullptr) {
      omp_parallel_ = parallel;
      omp_thread_num_ = thread_num;
    }
  }
#else
  (void)on;
#endif
  return omp_parallel_ != nullptr;
}

namespace {

struct OpenMPJob {
  const std::function<void(int64_t, int)>* fn;
  int64_t n;
  int (*thread_num)();
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
};

// Each thread of the OpenMP team takes indices until none are left. An exception must not
// unwind through libgomp: the first one is kept and rethrown by the caller.
void openmp_body(void* data) {
  auto* job = static_cast<OpenMPJob*>(data);
  const int tid = job->thread_num();
  try {
    for (;;) {
      const int64_t i = job->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job->n || job->failed.load(std::memory_order_relaxed)) break;
      (*job->fn)(i, tid);
    }
  } catch (...) {
    if (!job->failed.exchange(true)) job->error = std::current_exception();
  }
}

}  // namespace

void ThreadPool::parallel_for_openmp(int64_t n, const std::function<void(int64_t, int)>& fn,
                                     int threads) {
  OpenMPJob job{&fn, n, omp_thread_num_};
  omp_parallel_(openmp_body, &job, static_cast<unsigned>(threads), 0);
  if (job.error) std::rethrow_exception(job.error);
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn,
                              int max_threads) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> call(call_mutex_);
  if (num_threads_ == 1 || n == 1 || max_threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  if (omp_parallel_ != nullptr) {
    parallel_for_openmp(n, fn, std::min(num_threads_, max_threads));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_size_ = n;
    job_threads_ = max_threads;
    next_.store(0, std::memory_order_relaxed);
    busy_workers_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  run_share(0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return busy_workers_ == 0; });
  job_ = nullptr;
}

}  // namespace vllm_metal::cpu
