// The C++ half of the cxx bridge (rust/paro-ext/src/bridge.rs). Only rust/cxx.h here: every
// bridge translation unit includes this header, so torch headers stay out of it.
#pragma once
#include <cstddef>
#include <cstdint>

#include "rust/cxx.h"

namespace paro {

struct Shape;

// Builds a ParoBackend over three c10d::Backend Python objects (PyObject* as integers; GIL held). Its sub-backends
// for device (CUDA) tensors come from the device factory, called with `device_key` (negative: none).
// Returns a new reference to the Python Backend object.
std::size_t create_backend(const Shape& shape, std::size_t intra, std::size_t inter, std::size_t global,
                           std::int64_t device_key);

// Sets the device factory: a Python callable (key, device: str) -> (intra, inter, global) Backend objects or None.
void set_device_factory(std::size_t callable);

// [intra bytes, inter bytes, global bytes, intra ops, inter ops, global ops] of a paro Backend object.
rust::Vec<std::uint64_t> backend_stats(std::size_t backend);

// Zeroes those counters.
void reset_backend_stats(std::size_t backend);

}  // namespace paro
