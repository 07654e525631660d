// A small persistent worker pool for the CPU bodies of the native ops.
//
// MLX runs each CPU primitive as a task on its stream thread; that thread calls parallel_for and
// takes part in the work, so the pool adds num_threads() - 1 workers. Calls are serialised.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace vllm_metal::cpu {

class ThreadPool {
 public:
  // The process-wide pool, sized to the CPUs this process may run on.
  static ThreadPool& instance();

  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads taking part in parallel_for, the calling thread included.
  int num_threads() const { return num_threads_; }
  // Resizes the pool (n <= 0 restores the default). Waits for a running parallel_for.
  void set_num_threads(int n);

  // Calls fn(index, thread_id) for every index in [0, n) and returns when all are done.
  // Indices are handed out dynamically; thread_id is in [0, min(num_threads(), max_threads)), so
  // per-thread state sized before the call stays valid even if the pool is resized meanwhile.
  void parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn, int max_threads);

  // CPUs in this process's affinity mask (at least 1).
  static int default_num_threads();

  // With `on`, parallel_for runs on the team of the GNU OpenMP runtime already loaded in this
  // process (torch's and oneDNN's, MKL's) instead of this pool's threads. Between two OpenMP
  // regions that team's threads spin on the cores for a while; a second set of threads would
  // compete with them for the same cores. Returns whether the calls now go to OpenMP (False when
  // no GNU OpenMP runtime is loaded; the pool's threads are then kept).
  bool use_host_openmp(bool on);
  bool host_openmp() const { return omp_parallel_ != nullptr; }

 private:
  explicit ThreadPool(int n);
  void start(int n);
  void stop();
  void worker_loop(int thread_id);
  void run_share(int thread_id);
  void parallel_for_openmp(int64_t n, const std::function<void(int64_t, int)>& fn, int threads);

  std::mutex call_mutex_;  // serialises parallel_for and resizing
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  int num_threads_ = 1;
  bool stopping_ = false;
  uint64_t generation_ = 0;
  int busy_workers_ = 0;

  const std::function<void(int64_t, int)>* job_ = nullptr;
  int64_t job_size_ = 0;
  int job_threads_ = 1;
  std::atomic<int64_t> next_{0};

  // libgomp's entry points (GOMP_parallel, omp_get_thread_num) when use_host_openmp is on.
  void (*omp_parallel_)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*omp_thread_num_)() = nullptr;
};

// Calls body(i, scratch) for every i in [0, n): on the calling thread alone when the call is small
// (work < min_work), has fewer than two items or the pool has one thread, else on the pool. Each
// thread has its own Scratch (default-constructed), kept across the items it runs.
template <typename Scratch, typename Body>
void for_each_item(int64_t n, int64_t work, int64_t min_work, const Body& body) {
  ThreadPool& pool = ThreadPool::instance();
  if (work < min_work || n < 2 || pool.num_threads() == 1) {
    Scratch scratch;
    for (int64_t i = 0; i < n; ++i) body(i, scratch);
    return;
  }
  const int nthreads = pool.num_threads();
  std::vector<Scratch> scratch(nthreads);
  pool.parallel_for(n, [&](int64_t i, int tid) { body(i, scratch[tid]); }, nthreads);
}

}  // namespace vllm_metal::cpu
