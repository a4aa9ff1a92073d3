// The only pybind11 translation unit: Python Backend objects <-> c10::intrusive_ptr<c10d::Backend>.
#include <torch/csrc/utils/pybind.h>

#include <utility>

#include "cpp/bridge.h"
#include "cpp/paro_backend.h"

namespace py = pybind11;

namespace paro {
namespace {

c10::intrusive_ptr<c10d::Backend> to_backend(std::size_t ptr, const char* what) {
  TORCH_CHECK(ptr != 0, "paro: the ", what, " backend is missing");
  py::handle h(reinterpret_cast<PyObject*>(ptr));
  try {
    return h.cast<c10::intrusive_ptr<c10d::Backend>>();
  } catch (const py::cast_error&) {
    TORCH_CHECK(false, "paro: the ", what, " backend is a ", py::str(h.get_type()).cast<std::string>(),
                ", not a torch.distributed Backend; pass pg._get_backend(device)");
  }
}

ParoBackend& as_paro(std::size_t ptr, c10::intrusive_ptr<c10d::Backend>& holder) {
  holder = to_backend(ptr, "given");
  auto* paro = dynamic_cast<ParoBackend*>(holder.get());
  TORCH_CHECK(paro, "paro: this process group's backend is \"", holder->getBackendName(),
              "\", not \"paro\"; create the group with backend=\"paro\" to get paro's counters");
  return *paro;
}

c10::intrusive_ptr<c10d::Backend> to_optional_backend(std::size_t ptr, const char* what) {
  return ptr == 0 ? c10::intrusive_ptr<c10d::Backend>() : to_backend(ptr, what);
}

// paro_torch._backend._device_sub_backends(key, device) -> (intra, inter, global); set once at import and never
// released, so that no backend ever holds a Python object (its destructor may run where Python cannot be entered).
PyObject* g_device_factory = nullptr;

// Makes a backend's device sub-backends through the Python factory, on the first collective on that device.
ParoBackend::DeviceFactory device_factory(std::int64_t key) {
  return [key](const c10::Device& device) {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(g_device_factory, "paro: no factory for device sub-backends is set (import paro_torch)");
    py::tuple subs;
    try {
      subs = py::reinterpret_borrow<py::object>(g_device_factory)(key, device.str()).cast<py::tuple>();
    } catch (py::error_already_set& e) {
      TORCH_CHECK(false, "paro: could not create the sub-backends for ", device, " tensors: ", e.what());
    }
    TORCH_CHECK(subs.size() == 3, "paro: the device factory must return (intra, inter, global)");
    auto ptr = [&](std::size_t i) { return subs[i].is_none() ? 0 : reinterpret_cast<std::size_t>(subs[i].ptr()); };
    return ParoBackend::SubBackends{to_optional_backend(ptr(0), "intra-group"),
                                    to_optional_backend(ptr(1), "inter-group"), to_backend(ptr(2), "global")};
  };
}

}  // namespace

void set_device_factory(std::size_t callable) {
  PyObject* f = reinterpret_cast<PyObject*>(callable);
  Py_XINCREF(f);
  Py_XDECREF(std::exchange(g_device_factory, f));
}

std::size_t create_backend(const Shape& shape, std::size_t intra, std::size_t inter, std::size_t global,
                           std::int64_t device_key) {
  auto backend = c10::make_intrusive<ParoBackend>(
      shape, to_optional_backend(intra, "intra-group"), to_optional_backend(inter, "inter-group"),
      to_backend(global, "global"), device_key < 0 ? ParoBackend::DeviceFactory() : device_factory(device_key));
  py::object obj = py::cast(c10::intrusive_ptr<c10d::Backend>(backend));
  return reinterpret_cast<std::size_t>(obj.release().ptr());
}

rust::Vec<std::uint64_t> backend_stats(std::size_t backend) {
  c10::intrusive_ptr<c10d::Backend> holder;
  return as_paro(backend, holder).stats();
}

void reset_backend_stats(std::size_t backend) {
  c10::intrusive_ptr<c10d::Backend> holder;
  as_paro(backend, holder).reset_stats();
}

}  // namespace paro
