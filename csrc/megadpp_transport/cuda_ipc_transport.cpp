// The CUDA IPC transport of one rank (module megadpp.transport._cuda_ipc, built only where CUDA is).
//
// Zero copy: the receiver copies straight out of the sender's tensor, over NVLink where the GPUs have it,
// in one device-to-device copy per message; no byte passes through a staging buffer or the host.
// Per directed pair of ranks, a small shared-memory control ring (the shared-memory transport's ring) carries
// one header per message: the tensor's description, and where its bytes are: the IPC handle of the caching
// allocator's segment that holds them (PyTorch's own sharing of CUDA memory between processes) and their offset.
// Two interprocess events per ring slot order the copy on the GPUs, with no host waiting for a GPU:
//   sender, on the caller's thread: record ready[slot] on the caller's stream (after the work that produced
//           the tensor) -> publish the header. The tensor is held until freed[slot] has run.
//   receiver, on its channel thread or a caller that polls or waits: see the header -> map the segment
//           (once per segment) -> wait ready[slot] on its copy stream -> copy into a new tensor -> record
//           freed[slot] and the message's `copied` event -> consume the header.
// A receive completes when its copy is queued; whoever takes the tensor makes its own stream wait for
// `copied` (NCCL's stream semantics). A send completes when the receiver has consumed its header (its copy
// is queued after freed[slot]'s record); taking it makes the caller's stream wait for freed[slot], so that a
// later in-place write cannot overtake the receiver's copy. freed[slot] may have been recorded again for a
// later message by then: that copy runs after this one on the receiver's stream, so waiting for it is safe.
//
// Memory of received tensors: the receiving side allocates them from the caching allocator's pool of its own
// copy stream, never from the default stream's. A block of the default stream's pool is handed out again as
// soon as the training thread frees it, while kernels queued on that stream may still read or write it; a
// copy into it on this (unordered) stream would then race with them (it did on H100s: wrong gradients every
// few iterations). Taking a received tensor marks it as used on the taker's stream, so that its block returns
// to this pool only once that stream's work on it has run.
#include <c10/cuda/CUDACachingAllocator.h>
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

constexpr uint32_t kMaxCudaSlots = 16;
constexpr size_t kMaxHandleBytes = 4000;  // PyTorch's handle: 66 bytes for cudaMalloc'd segments, more when expandable

// What the setup area of a control segment holds for CUDA IPC: the slots' events.
struct CudaSetup {
  cudaIpcEventHandle_t ready[kMaxCudaSlots];
  cudaIpcEventHandle_t freed[kMaxCudaSlots];
};
static_assert(sizeof(CudaSetup) <= sizeof(ControlBlock::setup), "CUDA IPC setup does not fit the control block");

// Where a message's bytes are: in each slot's payload area of the control ring (not in its header, which the
// shared-memory transport shares).
struct IpcSource {
  uint64_t segment_base;  // the segment's address in the sender: a new handle there means the old segment is gone
  uint64_t offset;        // of the tensor's first byte in the segment
  uint32_t handle_bytes;
  char handle[kMaxHandleBytes];
};

inline CudaSetup* cuda_setup(ControlBlock* control) { return reinterpret_cast<CudaSetup*>(control->setup); }

inline cudaEvent_t new_event(bool interprocess) {
  cudaEvent_t event;
  unsigned flags = cudaEventDisableTiming | (interprocess ? cudaEventInterprocess : 0);
  MEGADPP_CUDA(cudaEventCreateWithFlags(&event, flags));
  return event;
}

// An event owned by whoever holds the last reference (a request's take, a received tensor's copy).
struct OwnedEvent {
  cudaEvent_t event = new_event(false);
  ~OwnedEvent() { cudaEventDestroy(event); }
};

inline cudaStream_t current_stream(int device) { return c10::cuda::getCurrentCUDAStream(device).stream(); }

class CudaSendChannel : public Progress, public std::enable_shared_from_this<CudaSendChannel> {
 public:
  CudaSendChannel(const std::string& name, uint32_t slots, int device) : device_(device) {
    check(slots <= kMaxCudaSlots, "megadpp transport: CUDA IPC channels hold at most ", kMaxCudaSlots, " slots");
    segment_.create(name, segment_bytes(slots, sizeof(IpcSource)));
    auto* control = reinterpret_cast<ControlBlock*>(segment_.base());
    control->magic = kMagic;
    control->version = kVersion;
    control->slots = slots;
    control->slot_bytes = sizeof(IpcSource);
    ring_.bind(segment_.base());
    c10::cuda::CUDAGuard guard(device);
    for (uint32_t s = 0; s < slots; ++s) {
      ready_.push_back(new_event(true));
      MEGADPP_CUDA(cudaIpcGetEventHandle(&cuda_setup(control)->ready[s], ready_[s]));
    }
  }
  ~CudaSendChannel() override {
    stop();
    c10::cuda::CUDAGuard guard(device_);
    for (auto event : ready_) cudaEventDestroy(event);
    for (auto event : freed_) cudaEventDestroy(event);
  }

  void await_receiver(double timeout_s) {
    int64_t deadline = monotonic_ns() + int64_t(timeout_s * 1e9);
    bool attached = wait_for(&ring_.control->attached, [&] { return ring_.control->attached.load() != 0; },
                             [&] { return monotonic_ns() > deadline; });
    segment_.unlink();
    check(attached, "megadpp transport: the receiving rank did not open its channel within ", timeout_s, " s");
    c10::cuda::CUDAGuard guard(device_);
    for (uint32_t s = 0; s < ring_.control->slots; ++s) {
      cudaEvent_t event;
      MEGADPP_CUDA(cudaIpcOpenEventHandle(&event, cuda_setup(ring_.control)->freed[s]));
      freed_.push_back(event);
    }
  }

  // Everything on the caller's thread: a slot (waiting only while the receiver has every slot unconsumed),
  // the source's handle, an event record, the header.
  RequestPtr post(const at::Tensor& tensor, int64_t tag) {
    check_sendable(tensor);
    check(tensor.is_cuda() && tensor.get_device() == device_, "megadpp transport: the CUDA IPC transport of device ",
          device_, " got a tensor on ", tensor.device());
    c10::cuda::CUDAGuard guard(device_);
    auto request = std::make_shared<Request>(tag);
    request->tensor = tensor.contiguous();
    request->nbytes = request->tensor.nbytes();
    request->progress = weak_from_this();
    IpcSource source = locate(request->tensor);
    std::lock_guard<std::mutex> lock(mutex_);
    check(!stopping_, "megadpp transport: send on a closed transport");
    release_copied();
    request->seq = next_seq_++;
    uint64_t index;
    if (!ring_.acquire(&index, [&] { return stopping_.load(); }))
      throw std::runtime_error("megadpp transport: closed while a send waited for a free slot");
    uint32_t slot = index % ring_.control->slots;
    SlotHeader* h = ring_.header(index);
    describe(h, request->tensor, request->seq, tag);
    h->offset = 0;
    h->chunk_bytes = request->nbytes;
    h->slot_of_payload = slot;
    std::memcpy(ring_.data(index), &source, offsetof(IpcSource, handle) + source.handle_bytes);
    MEGADPP_CUDA(cudaEventRecord(ready_[slot], current_stream(device_)));
    request->on_take = [channel = weak_from_this(), slot] {
      if (auto alive = channel.lock()) cudaStreamWaitEvent(current_stream(alive->device_), alive->freed_[slot], 0);
    };
    ring_.publish();
    unconsumed_.emplace_back(index, request);
    held_.push_back({index, slot, request->tensor});
    return request;
  }

  void poll() override {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (lock.owns_lock()) complete_consumed();
  }

  bool wait(Request& request, double timeout_s) override {
    int64_t deadline = timeout_s < 0 ? INT64_MAX : monotonic_ns() + int64_t(timeout_s * 1e9);
    while (!request.is_completed()) {
      poll();
      if (request.is_completed()) break;
      uint64_t tail = ring_.control->tail.load(std::memory_order_acquire);
      if (!wait_for(&ring_.control->tail_word, [&] { return ring_.control->tail.load() != tail; },
                    [&] { return stopping_.load() || monotonic_ns() > deadline; }))
        return request.is_completed();
    }
    return true;
  }

  void stop() {
    if (stopping_.exchange(true)) return;
    futex_wake(&ring_.control->tail_word);  // a send waiting for a slot (holding mutex_) gives up
    {
      std::lock_guard<std::mutex> lock(mutex_);
      complete_consumed();
      for (auto& [index, request] : unconsumed_) request->complete("megadpp transport: closed before the send was received");
      unconsumed_.clear();
      // The receiver may still be copying out of held tensors: give its copies a moment (it may be gone).
      c10::cuda::CUDAGuard guard(device_);
      for (int64_t until = monotonic_ns() + 1000000000; !held_.empty() && monotonic_ns() < until;) release_copied();
      held_.clear();
    }
    ring_.control->closed.store(1, std::memory_order_release);
    futex_wake(&ring_.control->head_word);
  }

 private:
  struct Held {
    uint64_t index;
    uint32_t slot;
    at::Tensor tensor;
  };

  // The segment and offset of the tensor's bytes. A tensor whose memory PyTorch cannot share (not from its
  // caching allocator) is sent from a copy that is.
  static IpcSource locate(at::Tensor& tensor) {
    IpcSource source{};
    if (tensor.nbytes() == 0) return source;
    c10::cuda::CUDACachingAllocator::ShareableHandle shared;
    void* storage = tensor.storage().mutable_data();
    try {
      shared = c10::cuda::CUDACachingAllocator::shareIpcHandle(storage);
    } catch (const c10::Error&) {
      tensor = tensor.clone();
      storage = tensor.storage().mutable_data();
      shared = c10::cuda::CUDACachingAllocator::shareIpcHandle(storage);
    }
    check(shared.handle.size() <= kMaxHandleBytes, "megadpp transport: PyTorch's IPC handle of a tensor takes ",
          shared.handle.size(), " bytes (at most ", kMaxHandleBytes, "); run without expandable_segments in "
          "PYTORCH_CUDA_ALLOC_CONF");
    source.segment_base = reinterpret_cast<uint64_t>(storage) - shared.offset;
    source.offset = shared.offset + (static_cast<char*>(tensor.data_ptr()) - static_cast<char*>(storage));
    source.handle_bytes = shared.handle.size();
    std::memcpy(source.handle, shared.handle.data(), shared.handle.size());
    return source;
  }

  // Complete the sends whose headers the receiver has consumed (its copies are queued); the caller holds mutex_.
  void complete_consumed() {
    uint64_t tail = ring_.control->tail.load(std::memory_order_acquire);
    while (!unconsumed_.empty() && unconsumed_.front().first < tail) {
      unconsumed_.front().second->complete();
      unconsumed_.pop_front();
    }
    release_copied();
  }

  // Let go of the tensors whose receiver's copies have run (or can no longer run: an error of the event means its
  // process is gone); the caller holds mutex_.
  void release_copied() {
    uint64_t tail = ring_.control->tail.load(std::memory_order_acquire);
    while (!held_.empty() && held_.front().index < tail &&
           cudaEventQuery(freed_[held_.front().slot]) != cudaErrorNotReady)
      held_.pop_front();
  }

  Segment segment_;
  Ring ring_;
  int device_;
  std::vector<cudaEvent_t> ready_, freed_;
  std::mutex mutex_;
  std::deque<std::pair<uint64_t, RequestPtr>> unconsumed_;  // sends in ring order, not yet consumed
  std::deque<Held> held_;  // sent tensors the receiver may still be copying from, in ring order
  std::atomic<bool> stopping_{false};
  uint64_t next_seq_ = 0;
};

class CudaRecvChannel : public DrainingReceiver {
 public:
  CudaRecvChannel(const std::string& name, int device) : DrainingReceiver(name), device_(device) {
    check(ring_.control->magic == kMagic && ring_.control->version == kVersion &&
              ring_.control->slot_bytes == sizeof(IpcSource),
          "megadpp transport: /dev/shm", name, " is not a CUDA IPC channel of this version");
    c10::cuda::CUDAGuard guard(device);
    MEGADPP_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CudaSetup* setup = cuda_setup(ring_.control);
    for (uint32_t s = 0; s < ring_.control->slots; ++s) {
      cudaEvent_t ready;
      MEGADPP_CUDA(cudaIpcOpenEventHandle(&ready, setup->ready[s]));
      ready_.push_back(ready);
      freed_.push_back(new_event(true));
      MEGADPP_CUDA(cudaIpcGetEventHandle(&setup->freed[s], freed_[s]));
    }
    attach();  // after the freed handles are written
  }
  ~CudaRecvChannel() override {
    stop();
    c10::cuda::CUDAGuard guard(device_);
    if (stream_) cudaStreamSynchronize(stream_);  // before the segments' mappings and the events go
    segments_.clear();
    for (auto event : ready_) cudaEventDestroy(event);
    for (auto event : freed_) cudaEventDestroy(event);
    if (stream_) cudaStreamDestroy(stream_);
  }

 private:
  // Queue the copy of the message at `index`: each message takes one slot.
  bool take_slot(uint64_t index) override {
    c10::cuda::CUDAGuard device(device_);
    // Received tensors come from the copy stream's pool (see the top of this file).
    c10::cuda::CUDAStreamGuard allocate_on_copy_stream(c10::cuda::getStreamFromExternal(stream_, device_));
    const SlotHeader* h = ring_.header(index);
    RequestPtr request = matcher_.arrive(h->tag);
    request->seq = h->seq;
    request->nbytes = h->total_bytes;
    std::string error;
    try {
      request->tensor = at::empty(shape_of(h), at::TensorOptions()
                                                   .dtype(static_cast<at::ScalarType>(h->dtype))
                                                   .device(at::kCUDA, device_));
      copy(*request, *reinterpret_cast<const IpcSource*>(ring_.data(index)), h->slot_of_payload);
    } catch (const std::exception& failure) {
      error = failure.what();
    }
    ring_.consume();  // the header may be overwritten from here on
    request->complete(error);
    return true;
  }

  // After ready[slot], copy the sender's bytes into the request's tensor on the copy stream; then free the slot.
  void copy(Request& request, const IpcSource& source, uint64_t slot) {
    cudaStreamWaitEvent(stream_, ready_[slot], 0);
    if (request.nbytes) {
      const char* segment = mapped(source);
      MEGADPP_CUDA(cudaMemcpyAsync(request.tensor.data_ptr(), segment + source.offset, request.nbytes,
                                   cudaMemcpyDeviceToDevice, stream_));
    }
    MEGADPP_CUDA(cudaEventRecord(freed_[slot], stream_));
    auto copied = std::make_shared<OwnedEvent>();
    MEGADPP_CUDA(cudaEventRecord(copied->event, stream_));
    at::Tensor tensor = request.tensor;
    int device = device_;
    request.on_take = [copied, tensor, device]() mutable {
      auto stream = c10::cuda::getCurrentCUDAStream(device);
      cudaStreamWaitEvent(stream.stream(), copied->event, 0);
      tensor.record_stream(stream);
    };
  }

  // The sender's segment mapped here, once per segment: PyTorch's IPC mapping stays open while held.
  const char* mapped(const IpcSource& source) {
    std::string handle(source.handle, source.handle_bytes);
    auto found = segments_.find(source.segment_base);
    if (found == segments_.end() || found->second.first != handle) {
      if (found != segments_.end()) {
        // The sender freed that segment (its tensors were released only after our copies out of them had
        // run) and allocated another at its address: let the old mapping go.
        MEGADPP_CUDA(cudaStreamSynchronize(stream_));
        segments_.erase(found);
      }
      found = segments_.emplace(source.segment_base,
                                std::make_pair(handle, c10::cuda::CUDACachingAllocator::getIpcDevPtr(handle)))
                  .first;
    }
    return static_cast<const char*>(found->second.second.get());
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> ready_, freed_;
  std::map<uint64_t, std::pair<std::string, std::shared_ptr<void>>> segments_;  // by the sender's address
};

class CudaIpcTransport {
 public:
  explicit CudaIpcTransport(int device) : device_(device) {}
  ~CudaIpcTransport() { close(); }

  void create_send_channel(int peer, const std::string& name, uint32_t slots) {
    check(slots > 0, "megadpp transport: slots must be positive");
    senders_[peer] = std::make_shared<CudaSendChannel>(name, slots, device_);
  }
  void open_recv_channel(int peer, const std::string& name) {
    receivers_[peer] = std::make_shared<CudaRecvChannel>(name, device_);
  }
  void await_receivers(double timeout_s) {
    for (auto& [peer, sender] : senders_) sender->await_receiver(timeout_s);
  }
  void start() {
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
  // shared: requests hold weak references to the channel that progresses them
  std::map<int, std::shared_ptr<CudaSendChannel>> senders_;
  std::map<int, std::shared_ptr<CudaRecvChannel>> receivers_;
};

}  // namespace megadpp

namespace py = pybind11;

PYBIND11_MODULE(_cuda_ipc, m) {
  m.doc() = "MegaDPP CUDA IPC tensor transport (see megadpp/transport)";
  m.def("segment_bytes", [](uint32_t slots) { return megadpp::segment_bytes(slots, sizeof(megadpp::IpcSource)); },
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
