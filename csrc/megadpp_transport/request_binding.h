// The Python view of a Request, shared by the two extension modules (module-local: each module has
// its own registration of the same C++ type).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include "request.h"

namespace megadpp {

inline void bind_request(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<Request, std::shared_ptr<Request>>(m, "Request", py::module_local())
      .def("is_completed", &Request::poll)
      .def("take", &Request::take)
      .def("wait", &Request::wait_progressing, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def_readonly("tensor", &Request::tensor)
      .def_readonly("error", &Request::error)
      .def_readonly("tag", &Request::tag)
      .def_readonly("seq", &Request::seq)
      .def_readonly("nbytes", &Request::nbytes)
      .def_readonly("start_ns", &Request::start_ns)
      .def_readonly("end_ns", &Request::end_ns);
}

}  // namespace megadpp
