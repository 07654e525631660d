// Persistent worker pool used by the CPU bodies of the native ops (see thread_pool.h).

#include "common/thread_pool.h"

#if defined(__linux__)
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

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn,
                              int max_threads) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> call(call_mutex_);
  if (num_threads_ == 1 || n == 1 || max_threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
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
