// One outstanding send or receive, shared between the Python handle and the channel thread that
// carries it out.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "shm_ring.h"

namespace megadpp {

struct Request {
  explicit Request(int64_t tag_) : tag(tag_), start_ns(monotonic_ns()) {}

  int64_t tag;
  int64_t start_ns;
  int64_t end_ns = 0;
  uint64_t seq = 0;
  uint64_t nbytes = 0;
  at::Tensor tensor;  // sent (contiguous) or received; read only after done
  std::string error;  // set instead of the tensor when the transfer failed

  bool is_completed() const { return done_.load(std::memory_order_acquire); }

  void complete(std::string failure = "") {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error = std::move(failure);
      end_ns = monotonic_ns();
      done_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }

  // Spin briefly (a small message completes in microseconds), then sleep on the condition variable.
  // timeout_s < 0: no limit. Returns whether the request completed.
  bool wait(double timeout_s) {
    for (int i = 0; i < 1000; ++i) {
      if (is_completed()) return true;
      std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    if (timeout_s < 0) {
      cv_.wait(lock, [&] { return is_completed(); });
      return true;
    }
    return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return is_completed(); });
  }

 private:
  std::atomic<bool> done_{false};
  std::mutex mutex_;
  std::condition_variable cv_;
};

}  // namespace megadpp
