// The two ends of a shared-memory channel. Each end runs one thread that carries its requests out
// in order, so that Python only posts work and polls or waits for it.
#pragma once

#include <ATen/ATen.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "copy_pool.h"
#include "request.h"
#include "shm_ring.h"

namespace megadpp {

using RequestPtr = std::shared_ptr<Request>;

constexpr uint64_t kInlineBytes = 64 << 10;  // a send this small, with a slot free, is copied by the caller

inline void describe(SlotHeader* h, const at::Tensor& t, uint64_t seq, int64_t tag) {
  h->seq = seq;
  h->tag = tag;
  h->dtype = static_cast<int32_t>(t.scalar_type());
  h->ndim = static_cast<int32_t>(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) h->shape[d] = t.size(d);
  h->total_bytes = t.nbytes();
}

inline std::vector<int64_t> shape_of(const SlotHeader* h) { return {h->shape, h->shape + h->ndim}; }

inline void check_sendable(const at::Tensor& t) {
  check(t.dim() <= kMaxDims, "megadpp transport: a tensor of ", t.dim(), " dimensions (at most ", kMaxDims, ")");
  check(!t.is_sparse(), "megadpp transport: sparse tensors are not supported");
}

// The sender's end: creates the segment and fills the ring; a send completes when its last chunk is
// in the ring (the tensor may then be reused).
class SendChannel {
 public:
  SendChannel(const std::string& name, uint32_t slots, uint64_t slot_bytes, CopyPool* pool) : pool_(pool) {
    segment_.create(name, segment_bytes(slots, slot_bytes));
    auto* control = reinterpret_cast<ControlBlock*>(segment_.base());  // zero-filled by the kernel
    control->magic = kMagic;
    control->version = kVersion;
    control->slots = slots;
    control->slot_bytes = slot_bytes;
    ring_.bind(segment_.base());
  }
  ~SendChannel() { stop(); }

  ControlBlock* control() const { return ring_.control; }

  // Unlink the segment once the receiver has mapped it: from then on nothing of it is in /dev/shm
  // and the kernel frees it when both processes are gone, however they end.
  void await_receiver(double timeout_s) {
    int64_t deadline = monotonic_ns() + int64_t(timeout_s * 1e9);
    bool attached = wait_for(&ring_.control->attached, [&] { return ring_.control->attached.load() != 0; },
                             [&] { return monotonic_ns() > deadline; });
    segment_.unlink();
    check(attached, "megadpp transport: the receiving rank did not open its channel within ", timeout_s, " s");
  }

  void start() { thread_ = std::thread([this] { run(); }); }

  RequestPtr post(const at::Tensor& tensor, int64_t tag) {
    check_sendable(tensor);
    auto request = std::make_shared<Request>(tag);
    request->tensor = tensor.contiguous();
    request->nbytes = request->tensor.nbytes();
    std::unique_lock<std::mutex> lock(mutex_);
    check(!stopping_, "megadpp transport: send on a closed transport");
    request->seq = next_seq_++;
    if (queue_.empty() && !busy_ && request->nbytes <= kInlineBytes && ring_has_room(request->nbytes)) {
      // A small message with nothing ahead of it and a free slot: copy it now, on the caller's
      // thread, rather than pay a hand-over to the channel thread (latency of small messages).
      send(*request);
      request->complete();
      return request;
    }
    queue_.push_back(request);
    lock.unlock();
    cv_.notify_one();
    return request;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    futex_wake(&ring_.control->tail_word);
    if (thread_.joinable()) thread_.join();
    for (auto& request : queue_) request->complete("megadpp transport: closed before the send went out");
    queue_.clear();
    ring_.control->closed.store(1, std::memory_order_release);
    futex_wake(&ring_.control->head_word);
  }

 private:
  void run() {
    for (;;) {
      RequestPtr request;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        request = queue_.front();
        busy_ = true;
      }
      if (!send(*request)) return;  // stopped in the middle: stop() fails what is queued
      {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.pop_front();
        busy_ = false;
      }
      request->complete();
    }
  }

  // Whether the slots that a message of `nbytes` takes are free now (so that sending it cannot block).
  bool ring_has_room(uint64_t nbytes) const {
    uint64_t chunks = std::max<uint64_t>(1, (nbytes + ring_.control->slot_bytes - 1) / ring_.control->slot_bytes);
    uint64_t used = ring_.control->head.load() - ring_.control->tail.load(std::memory_order_acquire);
    return used + chunks <= ring_.control->slots;
  }

  bool send(Request& request) {
    const at::Tensor& t = request.tensor;
    const char* src = static_cast<const char*>(t.data_ptr());
    uint64_t total = t.nbytes(), slot_bytes = ring_.control->slot_bytes, offset = 0;
    do {  // an empty tensor still sends one (empty) chunk: the header is the message
      uint64_t index;
      if (!ring_.acquire(&index, [&] { return stopping_.load(); })) return false;
      SlotHeader* h = ring_.header(index);
      describe(h, t, request.seq, request.tag);
      h->offset = offset;
      h->chunk_bytes = std::min(slot_bytes, total - offset);
      pool_->copy(ring_.data(index), src + offset, h->chunk_bytes);
      offset += h->chunk_bytes;
      ring_.publish();
    } while (offset < total);
    return true;
  }

  Segment segment_;
  Ring ring_;
  CopyPool* pool_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<RequestPtr> queue_;
  std::atomic<bool> stopping_{false};
  bool busy_ = false;  // the channel thread is sending the queue's front
  uint64_t next_seq_ = 0;
};

// Receives match by tag: a message that arrives before its irecv waits in `arrived`, an irecv
// posted before its message waits in `posted`; either way one Request joins them.
class TagMatcher {
 public:
  RequestPtr post(int64_t tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& arrived = arrived_[tag];
    if (!arrived.empty()) {
      RequestPtr request = arrived.front();
      arrived.pop_front();
      return request;
    }
    auto request = std::make_shared<Request>(tag);
    posted_[tag].push_back(request);
    return request;
  }

  RequestPtr arrive(int64_t tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& posted = posted_[tag];
    if (!posted.empty()) {
      RequestPtr request = posted.front();
      posted.pop_front();
      return request;
    }
    auto request = std::make_shared<Request>(tag);
    arrived_[tag].push_back(request);
    return request;
  }

  void fail_posted(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [tag, requests] : posted_)
      for (auto& request : requests) request->complete(why);
    posted_.clear();
  }

 private:
  std::mutex mutex_;
  std::map<int64_t, std::deque<RequestPtr>> posted_, arrived_;
};

// The receiving end of a ring, whatever a slot carries: it maps the sender's segment and drains the ring eagerly,
// so a sender never waits on the receiver's program order, only on the ring's capacity. Whoever gets there first
// drains: the channel thread, or a caller that polls or waits. A kind says what one slot means (take_slot); its
// destructor calls stop() first, since the channel thread calls into it.
class DrainingReceiver : public Progress, public std::enable_shared_from_this<DrainingReceiver> {
 public:
  void start() { thread_ = std::thread([this] { run(); }); }

  RequestPtr post(int64_t tag) {
    RequestPtr request = matcher_.post(tag);
    request->progress = weak_from_this();
    return request;
  }

  void poll() override {
    if (stopping_.load()) return;
    std::unique_lock<std::mutex> drain(drain_mutex_, std::try_to_lock);
    if (drain.owns_lock()) drain_published();
  }

  bool wait(Request& request, double timeout_s) override {
    int64_t deadline = timeout_s < 0 ? INT64_MAX : monotonic_ns() + int64_t(timeout_s * 1e9);
    // Wake for a slot nobody drains yet, or for a message the channel thread completed.
    auto wake = [&] { return request.is_completed() || (published() && !draining_.load()); };
    while (!request.is_completed()) {
      poll();
      if (request.is_completed()) break;
      if (!wait_for(&ring_.control->head_word, wake, [&] { return stopping_.load() || monotonic_ns() > deadline; }))
        return stopping_.load() ? request.wait(1.0) : request.is_completed();  // stop() fails what it leaves
    }
    return true;
  }

  void stop() {
    if (stopping_.exchange(true)) return;
    futex_wake(&ring_.control->head_word);
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> drain(drain_mutex_);
    on_stop();
    matcher_.fail_posted("megadpp transport: closed before the message arrived");
  }

 protected:
  explicit DrainingReceiver(const std::string& name) {
    segment_.open(name);
    ring_.bind(segment_.base());
  }

  // Tell the sender that this end has its segment (and whatever the kind wrote into its setup area).
  void attach() {
    ring_.control->attached.store(1, std::memory_order_release);
    futex_wake(&ring_.control->attached);
  }

  // Handle the slot at `index`, the ring's tail, and consume it; returns whether a message completed. Called with
  // the drain lock held.
  virtual bool take_slot(uint64_t index) = 0;
  // After the channel thread has stopped, with the drain lock held: fail what the kind has half received.
  virtual void on_stop() {}

  Segment segment_;
  Ring ring_;
  TagMatcher matcher_;

 private:
  bool published() const {
    return ring_.control->head.load(std::memory_order_acquire) > ring_.control->tail.load(std::memory_order_relaxed);
  }

  void run() {
    auto stop = [&] { return stopping_.load() || ring_.control->closed.load(std::memory_order_acquire) != 0; };
    while (wait_for(&ring_.control->head_word, [&] { return published(); }, stop)) {
      std::lock_guard<std::mutex> drain(drain_mutex_);
      drain_published();
    }
  }

  void drain_published() {
    draining_.store(true);
    bool completed = false;
    while (published()) completed |= take_slot(ring_.control->tail.load(std::memory_order_relaxed));
    draining_.store(false);
    if (completed) {  // a caller sleeping on the ring for a message just completed here: wake it
      ring_.control->head_word.fetch_add(1, std::memory_order_release);
      futex_wake(&ring_.control->head_word);
    }
  }

  std::mutex drain_mutex_;
  std::atomic<bool> draining_{false};
  std::thread thread_;
  std::atomic<bool> stopping_{false};
};

// The shared-memory receiver: copies each chunk out of the ring into the message's fresh CPU tensor.
class RecvChannel : public DrainingReceiver {
 public:
  RecvChannel(const std::string& name, CopyPool* pool) : DrainingReceiver(name), pool_(pool) {
    check(ring_.control->magic == kMagic && ring_.control->version == kVersion,
          "megadpp transport: /dev/shm", name, " is not a channel of this version");
    attach();
  }
  ~RecvChannel() override { stop(); }

 private:
  bool take_slot(uint64_t index) override {
    const SlotHeader* h = ring_.header(index);
    if (h->offset == 0) {
      current_ = matcher_.arrive(h->tag);
      current_->tensor = at::empty(shape_of(h), at::TensorOptions().dtype(static_cast<at::ScalarType>(h->dtype)));
      current_->seq = h->seq;
      current_->nbytes = h->total_bytes;
    }
    pool_->copy(static_cast<char*>(current_->tensor.data_ptr()) + h->offset, ring_.data(index), h->chunk_bytes);
    bool last = h->offset + h->chunk_bytes >= h->total_bytes;
    ring_.consume();  // the header may be overwritten from here on
    if (!last) return false;
    current_->complete();
    current_.reset();
    return true;
  }

  void on_stop() override {
    if (current_) current_->complete("megadpp transport: closed in the middle of a receive");
  }

  CopyPool* pool_;
  RequestPtr current_;  // the message whose chunks are being copied
};

}  // namespace megadpp
