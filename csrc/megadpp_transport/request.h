// One outstanding send or receive, shared between the Python handle and the channel thread that
// carries it out.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "shm_ring.h"

namespace megadpp {

struct Request;

// A channel that can make progress on the caller's thread: a waiting caller drains the ring itself
// instead of waiting for the channel thread to be scheduled (on a loaded machine that hand-over,
// a cross-process wake-up, costs far more than the copy).
struct Progress {
  virtual ~Progress() = default;
  virtual void poll() = 0;
  virtual bool wait(Request& request, double timeout_s) = 0;
};

struct Request {
  explicit Request(int64_t tag_) : tag(tag_), start_ns(monotonic_ns()) {}

  int64_t tag;
  int64_t start_ns;
  int64_t end_ns = 0;
  uint64_t seq = 0;
  uint64_t nbytes = 0;
  at::Tensor tensor;  // sent (contiguous) or received; read only after done
  std::string error;  // set instead of the tensor when the transfer failed
  std::weak_ptr<Progress> progress;  // the channel that can drive this request, while it exists
  // What taking the completed request's tensor must do first, once (CUDA IPC: order the taker's stream after
  // the copy); empty where a completed request's tensor is ready as it is.
  std::function<void()> on_take;

  bool is_completed() const { return done_.load(std::memory_order_acquire); }

  // What Python calls: let the channel progress on this thread, then answer.
  bool poll() {
    if (!is_completed())
      if (auto channel = progress.lock()) channel->poll();
    return is_completed();
  }
  bool wait_progressing(double timeout_s) {
    if (auto channel = progress.lock()) return channel->wait(*this, timeout_s);
    return wait(timeout_s);
  }

  // Called by whoever uses the tensor of a completed request, on its thread and stream.
  void take() {
    if (!on_take) return;
    auto first_use = std::move(on_take);
    on_take = nullptr;
    first_use();
  }

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
    if (spin_for([&] { return is_completed(); })) return true;
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
