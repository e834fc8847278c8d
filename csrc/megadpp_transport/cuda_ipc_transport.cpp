// The CUDA IPC transport of one rank (module megadpp.transport._cuda_ipc, built only where CUDA is).
//
// Per directed pair of ranks: the sender cudaMallocs a device ring of slots and one interprocess
// "ready" event per slot; the receiver creates one interprocess "freed" event per slot. Their IPC
// handles are exchanged once through the setup area of a small shared-memory control ring (the same
// ring as the shared-memory transport, with headers only), which then carries one header per chunk.
// Bytes move device to device on each side's own stream, never through host memory:
//   sender:   wait freed[slot] (the receiver's copy out of the slot's last use) -> copy tensor chunk
//             into the slot -> record ready[slot] -> publish the header
//   receiver: see the header -> wait ready[slot] -> copy the slot into the new tensor -> record
//             freed[slot] -> consume the header
// A request completes when its last copy has run on the GPU (an event a completer thread waits for).
//
// Memory of received tensors: the receiving thread allocates them from the caching allocator's pool of
// its own copy stream, never from the default stream's. A block of the default stream's pool is handed
// out again as soon as the training thread frees it, while kernels queued on that stream may still read
// or write it; a copy into it on this (unordered) stream would then race with them (it did on H100s:
// wrong gradients every few iterations). The consumer's side of the same rule is in Python
// (megadpp/transport/native.py): the handle marks a received tensor as used on the stream current where
// it is taken, so its block returns to this pool only once that stream's work on it has run.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <map>
#include <memory>

#include "request_binding.h"
#include "shm_channels.h"

namespace megadpp {

#define MEGADPP_CUDA(call)                                                                              \
  do {                                                                                                  \
    cudaError_t err_ = (call);                                                                          \
    check(err_ == cudaSuccess, "megadpp transport: ", #call, " failed: ", cudaGetErrorString(err_)); \
  } while (0)

constexpr uint32_t kMaxCudaSlots = 15;

// What the setup area of a control segment holds for CUDA IPC.
struct CudaSetup {
  cudaIpcMemHandle_t ring;
  uint64_t slot_bytes;
  cudaIpcEventHandle_t ready[kMaxCudaSlots];
  cudaIpcEventHandle_t freed[kMaxCudaSlots];
};
static_assert(sizeof(CudaSetup) <= sizeof(ControlBlock::setup), "CUDA IPC setup does not fit the control block");

inline CudaSetup* cuda_setup(ControlBlock* control) { return reinterpret_cast<CudaSetup*>(control->setup); }

inline cudaEvent_t new_event(bool interprocess) {
  cudaEvent_t event;
  unsigned flags = cudaEventDisableTiming | cudaEventBlockingSync | (interprocess ? cudaEventInterprocess : 0);
  MEGADPP_CUDA(cudaEventCreateWithFlags(&event, flags));
  return event;
}

// Completes requests once their last GPU copy has run: waits on one event after another, off the channel
// threads so that they keep feeding the rings meanwhile. It polls an event briefly (a small message's
// copy is microseconds away, and waking from a blocking-sync wait costs about as much again), then
// sleeps until the GPU signals it (blocking-sync events): a long copy costs no CPU.
class Completer {
 public:
  explicit Completer(int device) : device_(device), thread_([this] { run(); }) {}
  ~Completer() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void add(RequestPtr request, cudaEvent_t done) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.emplace_back(std::move(request), done);
    }
    cv_.notify_one();
  }

 private:
  void run() {
    cudaSetDevice(device_);
    for (;;) {
      std::pair<RequestPtr, cudaEvent_t> item;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = queue_.front();
        queue_.pop_front();
      }
      cudaEvent_t done = item.second;
      cudaError_t err = cudaErrorNotReady;
      spin_for([&] { return (err = cudaEventQuery(done)) != cudaErrorNotReady; });
      if (err == cudaErrorNotReady) err = cudaEventSynchronize(done);
      cudaEventDestroy(item.second);
      item.first->complete(err == cudaSuccess ? "" : std::string("megadpp transport: ") + cudaGetErrorString(err));
    }
  }

  int device_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<RequestPtr, cudaEvent_t>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

class CudaSendChannel {
 public:
  CudaSendChannel(const std::string& name, uint32_t slots, uint64_t slot_bytes, int device, Completer* completer)
      : device_(device), completer_(completer) {
    check(slots <= kMaxCudaSlots, "megadpp transport: CUDA IPC channels hold at most ", kMaxCudaSlots, " slots");
    segment_.create(name, segment_bytes(slots, 0));
    auto* control = reinterpret_cast<ControlBlock*>(segment_.base());
    control->magic = kMagic;
    control->version = kVersion;
    control->slots = slots;
    control->slot_bytes = 0;  // the host ring carries headers only
    ring_.bind(segment_.base());
    MEGADPP_CUDA(cudaSetDevice(device));
    MEGADPP_CUDA(cudaMalloc(&device_ring_, slots * slot_bytes));
    MEGADPP_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CudaSetup* setup = cuda_setup(control);
    setup->slot_bytes = slot_bytes;
    MEGADPP_CUDA(cudaIpcGetMemHandle(&setup->ring, device_ring_));
    for (uint32_t s = 0; s < slots; ++s) {
      ready_.push_back(new_event(true));
      MEGADPP_CUDA(cudaIpcGetEventHandle(&setup->ready[s], ready_[s]));
    }
  }
  ~CudaSendChannel() {
    stop();
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    for (auto event : ready_) cudaEventDestroy(event);
    for (auto event : freed_) cudaEventDestroy(event);
    if (stream_) cudaStreamDestroy(stream_);
    if (device_ring_) cudaFree(device_ring_);
  }

  void await_receiver(double timeout_s) {
    int64_t deadline = monotonic_ns() + int64_t(timeout_s * 1e9);
    bool attached = wait_for(&ring_.control->attached, [&] { return ring_.control->attached.load() != 0; },
                             [&] { return monotonic_ns() > deadline; });
    segment_.unlink();
    check(attached, "megadpp transport: the receiving rank did not open its channel within ", timeout_s, " s");
    MEGADPP_CUDA(cudaSetDevice(device_));
    for (uint32_t s = 0; s < ring_.control->slots; ++s) {
      cudaEvent_t event;
      MEGADPP_CUDA(cudaIpcOpenEventHandle(&event, cuda_setup(ring_.control)->freed[s]));
      freed_.push_back(event);
    }
  }

  void start() { thread_ = std::thread([this] { run(); }); }

  RequestPtr post(const at::Tensor& tensor, int64_t tag) {
    check_sendable(tensor);
    check(tensor.is_cuda() && tensor.get_device() == device_, "megadpp transport: the CUDA IPC transport of device ",
          device_, " got a tensor on ", tensor.device());
    auto request = std::make_shared<Request>(tag);
    request->tensor = tensor.contiguous();
    request->nbytes = request->tensor.nbytes();
    // The copies run on this channel's stream: they must start after whatever produced the tensor.
    cudaEvent_t produced = new_event(false);
    MEGADPP_CUDA(cudaEventRecord(produced, c10::cuda::getCurrentCUDAStream(device_).stream()));
    std::unique_lock<std::mutex> lock(mutex_);
    check(!stopping_, "megadpp transport: send on a closed transport");
    request->seq = next_seq_++;
    uint64_t one_slot = std::min<uint64_t>(kInlineBytes, cuda_setup(ring_.control)->slot_bytes);
    if (queue_.empty() && !busy_ && request->nbytes <= one_slot && ring_has_room()) {
      // A small message with nothing ahead of it and a free slot: issue its copy now, on the caller's
      // thread, rather than pay a hand-over to the channel thread (latency of small messages). Under
      // the lock, so that the channel thread cannot start a later message meanwhile.
      launch(request, produced);
      return request;
    }
    queue_.emplace_back(request, produced);
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
    for (auto& [request, produced] : queue_) {
      cudaEventDestroy(produced);
      request->complete("megadpp transport: closed before the send went out");
    }
    queue_.clear();
    ring_.control->closed.store(1, std::memory_order_release);
    futex_wake(&ring_.control->head_word);
  }

 private:
  void run() {
    cudaSetDevice(device_);
    for (;;) {
      std::pair<RequestPtr, cudaEvent_t> item;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        item = queue_.front();
        queue_.pop_front();
        busy_ = true;
      }
      launch(item.first, item.second);
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
    }
  }

  // Queue one request's copies on the channel's stream (after ``produced``) and hand its completion over.
  void launch(const RequestPtr& request, cudaEvent_t produced) {
    cudaStreamWaitEvent(stream_, produced, 0);
    cudaEventDestroy(produced);
    std::string error = send(*request);
    if (!error.empty()) {
      request->complete(error);
      return;
    }
    cudaEvent_t done = new_event(false);
    cudaEventRecord(done, stream_);
    completer_->add(request, done);
  }

  // Whether a one-chunk message can take a slot without waiting.
  bool ring_has_room() const {
    return ring_.control->head.load() - ring_.control->tail.load(std::memory_order_acquire) < ring_.control->slots;
  }

  std::string send(Request& request) {
    const at::Tensor& t = request.tensor;
    const char* src = static_cast<const char*>(t.data_ptr());
    uint64_t total = t.nbytes(), slot_bytes = cuda_setup(ring_.control)->slot_bytes, offset = 0;
    do {
      uint64_t index;
      if (!ring_.acquire(&index, [&] { return stopping_.load(); })) return "megadpp transport: closed mid-send";
      uint32_t slot = index % ring_.control->slots;
      SlotHeader* h = ring_.header(index);
      describe(h, t, request.seq, request.tag);
      h->offset = offset;
      h->chunk_bytes = std::min(slot_bytes, total - offset);
      h->slot_of_payload = slot;
      if (index >= ring_.control->slots) cudaStreamWaitEvent(stream_, freed_[slot], 0);  // its last reader is done
      if (h->chunk_bytes) {
        cudaError_t err = cudaMemcpyAsync(device_ring_ + slot * slot_bytes, src + offset, h->chunk_bytes,
                                          cudaMemcpyDeviceToDevice, stream_);
        if (err != cudaSuccess) return std::string("megadpp transport: ") + cudaGetErrorString(err);
      }
      cudaEventRecord(ready_[slot], stream_);
      offset += h->chunk_bytes;
      ring_.publish();
    } while (offset < total);
    return "";
  }

  Segment segment_;
  Ring ring_;
  int device_;
  Completer* completer_;
  char* device_ring_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> ready_, freed_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<RequestPtr, cudaEvent_t>> queue_;
  bool busy_ = false;  // the channel thread is issuing a message (guarded by mutex_)
  std::atomic<bool> stopping_{false};
  uint64_t next_seq_ = 0;
};

class CudaRecvChannel {
 public:
  CudaRecvChannel(const std::string& name, int device, Completer* completer) : device_(device), completer_(completer) {
    segment_.open(name);
    ring_.bind(segment_.base());
    check(ring_.control->magic == kMagic && ring_.control->version == kVersion,
          "megadpp transport: /dev/shm", name, " is not a channel of this version");
    CudaSetup* setup = cuda_setup(ring_.control);
    MEGADPP_CUDA(cudaSetDevice(device));
    void* ring;
    MEGADPP_CUDA(cudaIpcOpenMemHandle(&ring, setup->ring, cudaIpcMemLazyEnablePeerAccess));
    peer_ring_ = static_cast<const char*>(ring);
    MEGADPP_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (uint32_t s = 0; s < ring_.control->slots; ++s) {
      cudaEvent_t ready;
      MEGADPP_CUDA(cudaIpcOpenEventHandle(&ready, setup->ready[s]));
      ready_.push_back(ready);
      freed_.push_back(new_event(true));
      MEGADPP_CUDA(cudaIpcGetEventHandle(&setup->freed[s], freed_[s]));
    }
    ring_.control->attached.store(1, std::memory_order_release);  // after the freed handles are written
    futex_wake(&ring_.control->attached);
  }
  ~CudaRecvChannel() {
    stop();
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    for (auto event : ready_) cudaEventDestroy(event);
    for (auto event : freed_) cudaEventDestroy(event);
    if (stream_) cudaStreamDestroy(stream_);
    if (peer_ring_) cudaIpcCloseMemHandle(const_cast<char*>(peer_ring_));
  }

  void start() { thread_ = std::thread([this] { run(); }); }
  RequestPtr post(int64_t tag) { return matcher_.post(tag); }

  void stop() {
    if (stopping_.exchange(true)) return;
    futex_wake(&ring_.control->head_word);
    if (thread_.joinable()) thread_.join();
    if (current_) current_->complete("megadpp transport: closed in the middle of a receive");
    matcher_.fail_posted("megadpp transport: closed before the message arrived");
  }

 private:
  void run() {
    cudaSetDevice(device_);
    // Received tensors come from this stream's pool (see the top of this file).
    c10::cuda::CUDAStreamGuard allocate_on_copy_stream(c10::cuda::getStreamFromExternal(stream_, device_));
    auto stop = [&] { return stopping_.load() || ring_.control->closed.load(std::memory_order_acquire) != 0; };
    uint64_t slot_bytes = cuda_setup(ring_.control)->slot_bytes;
    uint64_t index;
    while (ring_.next(&index, stop)) {
      const SlotHeader* h = ring_.header(index);
      if (h->offset == 0) {
        current_ = matcher_.arrive(h->tag);
        current_->tensor = at::empty(shape_of(h), at::TensorOptions()
                                                      .dtype(static_cast<at::ScalarType>(h->dtype))
                                                      .device(at::kCUDA, device_));
        current_->seq = h->seq;
        current_->nbytes = h->total_bytes;
      }
      uint64_t slot = h->slot_of_payload;
      cudaStreamWaitEvent(stream_, ready_[slot], 0);
      if (h->chunk_bytes)
        cudaMemcpyAsync(static_cast<char*>(current_->tensor.data_ptr()) + h->offset, peer_ring_ + slot * slot_bytes,
                        h->chunk_bytes, cudaMemcpyDeviceToDevice, stream_);
      cudaEventRecord(freed_[slot], stream_);
      bool last = h->offset + h->chunk_bytes >= h->total_bytes;
      ring_.consume();
      if (last) {
        cudaEvent_t done = new_event(false);
        cudaEventRecord(done, stream_);
        completer_->add(current_, done);
        current_.reset();
      }
    }
  }

  Segment segment_;
  Ring ring_;
  int device_;
  Completer* completer_;
  const char* peer_ring_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> ready_, freed_;
  TagMatcher matcher_;
  RequestPtr current_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
};

class CudaIpcTransport {
 public:
  explicit CudaIpcTransport(int device) : device_(device), completer_(device) {}
  ~CudaIpcTransport() { close(); }

  void create_send_channel(int peer, const std::string& name, uint32_t slots, uint64_t slot_bytes) {
    check(slots > 0 && slot_bytes > 0, "megadpp transport: slots and slot bytes must be positive");
    senders_[peer] = std::make_unique<CudaSendChannel>(name, slots, slot_bytes, device_, &completer_);
  }
  void open_recv_channel(int peer, const std::string& name) {
    receivers_[peer] = std::make_unique<CudaRecvChannel>(name, device_, &completer_);
  }
  void await_receivers(double timeout_s) {
    for (auto& [peer, sender] : senders_) sender->await_receiver(timeout_s);
  }
  void start() {
    for (auto& [peer, sender] : senders_) sender->start();
    for (auto& [peer, receiver] : receivers_) receiver->start();
  }
  RequestPtr isend(const at::Tensor& tensor, int peer, int64_t tag) { return channel(senders_, peer)->post(tensor, tag); }
  RequestPtr irecv(int peer, int64_t tag) { return channel(receivers_, peer)->post(tag); }
  void close() {
    for (auto& [peer, sender] : senders_) sender->stop();
    for (auto& [peer, receiver] : receivers_) receiver->stop();
    senders_.clear();
    receivers_.clear();
  }

 private:
  template <typename Map>
  static typename Map::mapped_type::element_type* channel(Map& channels, int peer) {
    auto it = channels.find(peer);
    check(it != channels.end(), "megadpp transport: rank ", peer, " is not a peer of this transport");
    return it->second.get();
  }

  int device_;
  Completer completer_;  // declared before the channels: destroyed after them
  std::map<int, std::unique_ptr<CudaSendChannel>> senders_;
  std::map<int, std::unique_ptr<CudaRecvChannel>> receivers_;
};

}  // namespace megadpp

namespace py = pybind11;

PYBIND11_MODULE(_cuda_ipc, m) {
  m.doc() = "MegaDPP CUDA IPC tensor transport (see megadpp/transport)";
  m.def("segment_bytes", [](uint32_t slots) { return megadpp::segment_bytes(slots, 0); },
        "bytes of /dev/shm one channel's control ring takes");
  megadpp::bind_request(m);
  using megadpp::CudaIpcTransport;
  py::class_<CudaIpcTransport>(m, "CudaIpcTransport")
      .def(py::init<int>(), py::arg("device"))
      .def("create_send_channel", &CudaIpcTransport::create_send_channel)
      .def("open_recv_channel", &CudaIpcTransport::open_recv_channel)
      .def("await_receivers", &CudaIpcTransport::await_receivers, py::call_guard<py::gil_scoped_release>())
      .def("start", &CudaIpcTransport::start)
      .def("isend", &CudaIpcTransport::isend)
      .def("irecv", &CudaIpcTransport::irecv)
      .def("close", &CudaIpcTransport::close, py::call_guard<py::gil_scoped_release>());
}
