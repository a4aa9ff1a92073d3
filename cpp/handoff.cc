// The only pybind11 translation unit: Python Backend objects <-> c10::intrusive_ptr<c10d::Backend>.
#include <torch/csrc/utils/pybind.h>

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

}  // namespace

std::size_t create_backend(const Shape& shape, std::size_t intra, std::size_t inter, std::size_t flat) {
  auto to_opt = [](std::size_t p, const char* what) {
    return p == 0 ? c10::intrusive_ptr<c10d::Backend>() : to_backend(p, what);
  };
  auto backend = c10::make_intrusive<ParoBackend>(shape, to_opt(intra, "intra-group"), to_opt(inter, "inter-group"),
                                                  to_backend(flat, "flat"));
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
