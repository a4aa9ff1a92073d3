// ParoBackend: a c10d::Backend that runs every collective as a plan of the Rust planner
// (rust/paro-core/src/planner.rs) over intra-group, inter-group and global (all-ranks) sub-backends.
#pragma once
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/Backend.hpp>

// torch 2.15 names the single-tensor collectives after torchcomms (all_gather_single, reduce_scatter_single,
// all_to_all_single and the _coalesced forms) and keeps the older names (_allgather_base, _reduce_scatter_base,
// alltoall_base, allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced) as forwarding aliases; torch 2.11
// has only the older names. ParoBackend implements the new names and, on an older torch, overrides the older ones
// to reach them; calls into sub-backends go through paro::sub_all_gather_single and paro::sub_all_to_all_single.
#ifdef C10D_BACKEND_FORWARDING_GUARD
#define PARO_C10D_SINGLE_NAMES 1
#define PARO_SINGLE_OVERRIDE override
#else
#define PARO_SINGLE_OVERRIDE
#endif

#include "paro-ext/src/bridge.rs.h"

namespace paro {

constexpr const char* kParoBackendName = "paro";

class ParoBackend : public c10d::Backend {
  struct Task;
  struct Queue;

 public:
  // Work that completes when the backend's worker has run the whole plan. While torch.profiler records, it is an
  // async event named `title` ("paro:all_reduce") with the input tensors as inputs and the keyword input "seq".
  class ParoWork : public c10d::Work {
   public:
    ParoWork(int rank, c10d::OpType type, const char* title, const std::vector<at::Tensor>& inputs,
             std::vector<at::Tensor> outputs, uint64_t seq, std::weak_ptr<Queue> queue);
    bool isCompleted() override;
    bool isSuccess() const override;
    bool wait(std::chrono::milliseconds timeout) override;
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
    uint64_t getSequencenumber() const override { return seq_; }
    void complete(std::exception_ptr error);

   private:
    std::vector<at::Tensor> outputs_;
    c10::intrusive_ptr<c10::ivalue::Future> future_;
    uint64_t seq_;
    std::weak_ptr<Queue> queue_;  // wait() drops the requests the worker has retired (see Queue::retired)
  };

  // Sub-backends for tensors on a device, [intra, inter, global] as for the CPU (intra or inter may be empty, or
  // the global one), made on the first collective with a tensor on that device.
  using SubBackends = std::array<c10::intrusive_ptr<c10d::Backend>, 3>;
  using DeviceFactory = std::function<SubBackends(const c10::Device&)>;
  // A device's sub-backends and streams (defined in paro_backend.cc).
  struct Device;

  ParoBackend(const Shape& shape, c10::intrusive_ptr<c10d::Backend> intra,
              c10::intrusive_ptr<c10d::Backend> inter, c10::intrusive_ptr<c10d::Backend> global,
              DeviceFactory device_factory);
  ~ParoBackend() override;

  const std::string getBackendName() const override { return kParoBackendName; }
  // Collectives issued so far, which is the last one's number (they count from 1); equal on every rank in step.
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }
  // The count starts at 0 on every rank: nothing to agree on. torch 2.11's ProcessGroupWrapper
  // (TORCH_DISTRIBUTED_DEBUG=DETAIL) calls it when it wraps the backend, and the base class throws there; torch 2.15's
  // base class is a deprecated no-op.
  void setSequenceNumberForGroup() override {}

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> all_gather_single(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) PARO_SINGLE_OVERRIDE;
  c10::intrusive_ptr<c10d::Work> all_gather_single_coalesced(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) PARO_SINGLE_OVERRIDE;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_single(at::Tensor& output, at::Tensor& input,
                                                       const c10d::ReduceScatterOptions& opts) PARO_SINGLE_OVERRIDE;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_single_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) PARO_SINGLE_OVERRIDE;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Passed on to the device sub-backends (NCCL frees its communicators here); the CPU ones end with the backend.
  void shutdown() override;
  void abort() override;
  // Gloo's monitored barrier on the global sub-backend: names the ranks that did not arrive within the timeout.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  // Run by the global sub-backend, in call order.
  c10::intrusive_ptr<c10d::Work> all_to_all_single(at::Tensor& output, at::Tensor& input,
                                                   std::vector<int64_t>& outputSplits,
                                                   std::vector<int64_t>& inputSplits,
                                                   const c10d::AllToAllOptions& opts) PARO_SINGLE_OVERRIDE;
#ifndef PARO_C10D_SINGLE_NAMES
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    return all_gather_single(output, input, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    return all_gather_single_coalesced(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    return reduce_scatter_single(output, input, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    return reduce_scatter_single_coalesced(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits, std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override {
    return all_to_all_single(output, input, outputSplits, inputSplits, opts);
  }
#endif
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  rust::Vec<std::uint64_t> stats() const;
  void reset_stats();

 private:
  // Gathers input i into outputs[i][0..size) (allgather's layout), for allgather and allgather_coalesced.
  c10::intrusive_ptr<c10d::Work> allgather_lists(const char* title, const std::vector<std::vector<at::Tensor>>& outputs,
                                                 const std::vector<at::Tensor>& inputs);
  // Runs `fn`, which issues the collective through run() or level(). For CPU tensors: on the worker thread after
  // every earlier request; the Work completes when it returns. For tensors on a device (CUDA): on the caller's
  // thread, on the device's streams (see run_on_device); the Work's wait() makes the current stream wait. `title`
  // names the collective in profiler traces and error messages; `inputs` are recorded with it.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title, const std::vector<at::Tensor>& inputs,
                                         std::vector<at::Tensor> outputs, std::function<void()> fn);
  // Plans one collective with the Rust planner and executes it: on the worker thread with the CPU sub-backends, or,
  // inside run_on_device, on the device's streams (paro_core::streams, [Note: stream schedule]).
  void run(CollectiveOp op, const at::Tensor& input, const at::Tensor& output, int64_t numel, int64_t root,
           const c10d::ReduceOp& reduce_op);
  // The sub-backend of a level: the device's inside run_on_device, else the CPU's.
  c10d::Backend& level(Level l) const;
  void each_device_backend(const std::function<void(c10d::Backend&)>& fn);
  // The sub-backend for a point-to-point operation on `tensors`.
  c10d::Backend& p2p(const std::vector<at::Tensor>& tensors, const char* op);
  // The device's sub-backends and streams, made on first use; a group's device tensors must share one device.
  Device& device(const c10::Device& d);
  c10::intrusive_ptr<c10d::Work> run_on_device(Device& dev, c10d::OpType type, const char* title, uint64_t seq,
                                               const std::vector<at::Tensor>& inputs,
                                               std::vector<at::Tensor> outputs, const std::function<void()>& fn,
                                               const std::string& what);
  // The worker thread's loop. It owns the queue (a shared_ptr), not the backend, so that a backend destroyed
  // from a completion callback on the worker itself leaves the loop nothing freed to touch.
  static void worker_loop(const std::shared_ptr<Queue>& queue);

  Shape shape_;
  c10::intrusive_ptr<c10d::Backend> intra_, inter_, global_;
  std::array<std::atomic<std::uint64_t>, 3> bytes_{};
  std::array<std::atomic<std::uint64_t>, 3> ops_{};
  std::atomic<std::uint64_t> seq_{0};

  std::shared_ptr<Queue> queue_;
  std::thread worker_;

  DeviceFactory device_factory_;
  std::mutex device_mutex_;
  std::unique_ptr<Device> device_;
};

// A sub-backend's all_gather_single / all_to_all_single under the name this torch has (see the top of this file).
inline c10::intrusive_ptr<c10d::Work> sub_all_gather_single(c10d::Backend& b, at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
#ifdef PARO_C10D_SINGLE_NAMES
  return b.all_gather_single(output, input, opts);
#else
  return b._allgather_base(output, input, opts);
#endif
}
inline c10::intrusive_ptr<c10d::Work> sub_all_to_all_single(c10d::Backend& b, at::Tensor& output, at::Tensor& input,
                                                            std::vector<int64_t>& outputSplits,
                                                            std::vector<int64_t>& inputSplits,
                                                            const c10d::AllToAllOptions& opts) {
#ifdef PARO_C10D_SINGLE_NAMES
  return b.all_to_all_single(output, input, outputSplits, inputSplits, opts);
#else
  return b.alltoall_base(output, input, outputSplits, inputSplits, opts);
#endif
}

}  // namespace paro
