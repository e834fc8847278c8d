// The shared-memory transport of one rank: a SendChannel to every peer, a RecvChannel from every
// peer, one copy pool; and its Python binding (module megadpp.transport._shm).
#include <map>
#include <memory>

#include "request_binding.h"
#include "shm_channels.h"

namespace megadpp {

class ShmTransport {
 public:
  ShmTransport(size_t workload, int copy_threads) : pool_(workload, copy_threads) {}
  ~ShmTransport() { close(); }

  void create_send_channel(int peer, const std::string& name, uint32_t slots, uint64_t slot_bytes) {
    check(slots > 0 && slot_bytes > 0, "megadpp transport: slots and slot bytes must be positive");
    senders_[peer] = std::make_unique<SendChannel>(name, slots, slot_bytes, &pool_);
  }
  void open_recv_channel(int peer, const std::string& name) {
    receivers_[peer] = std::make_shared<RecvChannel>(name, &pool_);
  }
  void await_receivers(double timeout_s) {
    for (auto& [peer, sender] : senders_) sender->await_receiver(timeout_s);
  }
  void start() {
    for (auto& [peer, sender] : senders_) sender->start();
    for (auto& [peer, receiver] : receivers_) receiver->start();
  }

  RequestPtr isend(const at::Tensor& tensor, int peer, int64_t tag) {
    check(tensor.device().is_cpu(), "megadpp transport: the shared-memory transport moves CPU tensors (got ",
                tensor.device(), "); use the CUDA IPC transport for GPU tensors");
    return channel(senders_, peer)->post(tensor, tag);
  }
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

  CopyPool pool_;  // declared first: destroyed after the channels that use it
  std::map<int, std::unique_ptr<SendChannel>> senders_;
  std::map<int, std::shared_ptr<RecvChannel>> receivers_;  // shared: requests hold weak references
};

}  // namespace megadpp

namespace py = pybind11;

PYBIND11_MODULE(_shm, m) {
  m.doc() = "MegaDPP shared-memory tensor transport (see megadpp/transport)";
  m.attr("SEGMENT_HEADER_BYTES") = megadpp::segment_bytes(0, 0);
  m.def("segment_bytes", &megadpp::segment_bytes, "bytes of /dev/shm one channel takes");

  megadpp::bind_request(m);

  using megadpp::ShmTransport;
  py::class_<ShmTransport>(m, "ShmTransport")
      .def(py::init<size_t, int>(), py::arg("workload"), py::arg("copy_threads"))
      .def("create_send_channel", &ShmTransport::create_send_channel)
      .def("open_recv_channel", &ShmTransport::open_recv_channel)
      .def("await_receivers", &ShmTransport::await_receivers, py::call_guard<py::gil_scoped_release>())
      .def("start", &ShmTransport::start)
      .def("isend", &ShmTransport::isend)
      .def("irecv", &ShmTransport::irecv)
      .def("close", &ShmTransport::close, py::call_guard<py::gil_scoped_release>());
}
