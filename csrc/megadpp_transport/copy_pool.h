// Copy parallelism: a copy of n bytes is cut into pieces of `workload` bytes, one per thread.
#pragma once

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace megadpp {

class CopyPool {
 public:
  CopyPool(size_t workload, int threads) : workload_(workload ? workload : SIZE_MAX) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~CopyPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  void copy(char* dst, const char* src, size_t n) {
    if (n == 0) return;
    size_t pieces = (n + workload_ - 1) / workload_;
    if (pieces <= 1 || workers_.empty()) {
      std::memcpy(dst, src, n);
      return;
    }
    // The caller copies the first piece itself and waits for the others.
    std::mutex done_mutex;
    std::condition_variable done_cv;
    size_t remaining = pieces - 1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t p = 1; p < pieces; ++p) {
        size_t begin = p * workload_, len = std::min(workload_, n - begin);
        tasks_.emplace_back([=, &done_mutex, &done_cv, &remaining] {
          std::memcpy(dst + begin, src + begin, len);
          std::lock_guard<std::mutex> done_lock(done_mutex);
          if (--remaining == 0) done_cv.notify_one();
        });
      }
    }
    cv_.notify_all();
    std::memcpy(dst, src, std::min(workload_, n));
    std::unique_lock<std::mutex> done_lock(done_mutex);
    done_cv.wait(done_lock, [&] { return remaining == 0; });
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (stop_ && tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  size_t workload_;
  std::vector<std::thread> workers_;
  std::deque<std::function<void()>> tasks_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
};

}  // namespace megadpp
