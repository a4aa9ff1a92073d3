// ParoBackend: executes Rust plans (see [Note: stage semantics] in rust/paro-core/src/planner.rs).
#include "cpp/paro_backend.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <stdexcept>
#include <utility>

namespace paro {
namespace {

int level_index(Level l) {
  switch (l) {
    case Level::Intra: return 0;
    case Level::Inter: return 1;
    default: return 2;
  }
}

// Profiler titles of plan steps: [level][kind] for the communicating kinds (AllGather .. Barrier). The global
// level's read "flat", as traces have named it from the start.
constexpr const char* kStepTitles[3][6] = {
    {"paro:intra:all_gather", "paro:intra:all_to_all", "paro:intra:all_reduce", "paro:intra:broadcast",
     "paro:intra:reduce", "paro:intra:barrier"},
    {"paro:inter:all_gather", "paro:inter:all_to_all", "paro:inter:all_reduce", "paro:inter:broadcast",
     "paro:inter:reduce", "paro:inter:barrier"},
    {"paro:flat:all_gather", "paro:flat:all_to_all", "paro:flat:all_reduce", "paro:flat:broadcast",
     "paro:flat:reduce", "paro:flat:barrier"}};

const char* step_title(Level l, Kind k) { return kStepTitles[level_index(l)][static_cast<int>(k)]; }

// Rethrows the exception being handled with `context` added; one that is not a c10::Error becomes a
// DistBackendError (torch.distributed.DistBackendError in Python), as torch's own backends raise.
[[noreturn]] void rethrow_with(const std::string& context) {
  try {
    throw;
  } catch (c10::Error& e) {
    e.add_context(context);
    throw;
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, c10::str(e.what(), "\n  ", context));
  }
}

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "paro: ", op, " got an undefined tensor");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "paro: ", op, " got a tensor on ", t.device(),
              "; the paro backend takes CPU tensors (on Gloo) and CUDA tensors (on NCCL). Move the tensor to one of "
              "those devices.");
  TORCH_CHECK(t.layout() == at::kStrided, "paro: ", op, " takes dense tensors (got ", t.layout(), ")");
  TORCH_CHECK(t.is_contiguous(), "paro: ", op, " takes contiguous tensors; call .contiguous() first");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.device() == b.device(), "paro: ", op, " got tensors on different devices (", a.device(), " and ",
              b.device(), "); put the input and the output on one device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "paro: ", op, " got tensors of different dtypes (",
              a.scalar_type(), " and ", b.scalar_type(), ")");
}

c10d::ReduceOp plain_sum_if_scaled(const c10d::ReduceOp& op) {
  if (op.op_ == c10d::ReduceOp::AVG || op.op_ == c10d::ReduceOp::PREMUL_SUM) {
    return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
  return op;
}

void check_reduce_op(const c10d::ReduceOp& op, const at::Tensor& t) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      return;
    case c10d::ReduceOp::AVG:
    case c10d::ReduceOp::PREMUL_SUM:
      TORCH_CHECK(at::isFloatingType(t.scalar_type()), "paro: ReduceOp.", (op.op_ == c10d::ReduceOp::AVG ? "AVG" : "PREMUL_SUM"),
                  " needs a floating-point tensor (got ", t.scalar_type(), "); use SUM and divide yourself");
      return;
    default:
      TORCH_CHECK(false, "paro: reduce op ", static_cast<int>(op.op_),
                  " is not supported; use SUM, AVG, PRODUCT, MIN, MAX or PREMUL_SUM");
  }
}

// The same memory as `t`, without owning it. Sub-backends release the tensors of a finished collective on
// their own threads, after wait() has returned here. Had they been given the caller's tensors, the last
// reference to a tensor owned by a Python object could drop on such a thread while the interpreter exits;
// taking the GIL there ends the thread inside a noexcept destructor, and the process aborts with
// "terminate called without an active exception" (docs/checkpoints.md, "Clean exits"). A borrowed tensor frees
// nothing when dropped; the request that borrowed it keeps the real tensors alive until its plan has finished,
// and is dropped on a caller's thread (see ParoBackend::Queue).
at::Tensor borrowed(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu()) return t;  // device collectives run on the caller's thread
  if (t.numel() == 0) return at::empty(t.sizes(), t.options());
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
}

std::vector<at::Tensor> borrowed(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(borrowed(t));
  return out;
}

std::vector<std::vector<at::Tensor>> borrowed(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(lists.size());
  for (const auto& ts : lists) out.push_back(borrowed(ts));
  return out;
}

// dst[0, b, c] = reduce over a of src[a, b, c]
void combine(const at::Tensor& src, at::Tensor dst, c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::MIN: dst.copy_(at::amin(src, {0}, true)); break;
    case c10d::ReduceOp::MAX: dst.copy_(at::amax(src, {0}, true)); break;
    case c10d::ReduceOp::PRODUCT: dst.copy_(src.prod(0, true)); break;
    default: dst.copy_(src.sum(0, true)); break;
  }
}

// While torch.profiler records: starts an async event `title` with the input tensors as inputs (as torch's own
// backends record them) and the sequence number as the keyword input "seq"; returns what ends it.
std::function<void()> start_record(const char* title, const std::vector<at::Tensor>& inputs, uint64_t seq) {
  auto record = std::make_shared<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!record->isActive()) return nullptr;
  record->_setAsync();
  const std::vector<c10::IValue> args(inputs.begin(), inputs.end());
  const std::unordered_map<std::string, c10::IValue> kwargs{{"seq", static_cast<int64_t>(seq)}};
  record->before(title, c10::ArrayRef<const c10::IValue>(args.data(), args.size()), &kwargs);
  return [record] { record->end(); };
}

// The Work of a collective on a device: issued on the device's streams from the caller's thread. Its Future is
// completed at issue, on the stream that joins the collective's streams, so that its wait() and then() order
// their streams after the collective (the device contract of c10d Work, which DDP's comm hooks rely on); wait()
// makes the current stream wait and never blocks the CPU.
class DeviceWork : public c10d::Work {
 public:
  DeviceWork(int rank, c10d::OpType type, uint64_t seq, const c10::Stream& joined, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        done_(joined.device_type()),
        future_(c10::make_intrusive<at::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                        std::vector<c10::Device>{joined.device()})),
        seq_(seq) {
    done_.record(joined);
    c10::StreamGuard guard(joined);
    future_->markCompleted(c10::IValue(std::move(outputs)));
  }
  bool isCompleted() override { return done_.query(); }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    future_->wait();  // the current stream waits on the collective
    return true;
  }
  void synchronize() override { future_->wait(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  uint64_t getSequencenumber() const override { return seq_; }

 private:
  c10::Event done_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  uint64_t seq_;
};

}  // namespace

// A device's sub-backends and its streams (lanes): [intra, inter, global, local] (paro_core::streams::Lane).
struct ParoBackend::Device {
  c10::Device device;
  SubBackends subs;
  std::array<c10::Stream, 4> lanes;
};

namespace {
// The device whose streams run() uses, while run_on_device runs a collective on this thread.
thread_local ParoBackend::Device* tl_device = nullptr;
constexpr int kLocalLane = 3;
}  // namespace

// ---------------------------------------------------------------------------------------- Work
ParoBackend::ParoWork::ParoWork(int rank, c10d::OpType type, const char* title, const std::vector<at::Tensor>& inputs,
                                std::vector<at::Tensor> outputs, uint64_t seq, std::weak_ptr<Queue> queue)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<at::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
      seq_(seq),
      queue_(std::move(queue)) {
  recordFunctionEndCallback_ = start_record(title, inputs, seq);  // ends on the worker, when the plan has run
}

bool ParoBackend::ParoWork::isCompleted() { return future_->completed(); }

bool ParoBackend::ParoWork::isSuccess() const { return future_->completed() && !future_->hasError(); }

c10::intrusive_ptr<c10::ivalue::Future> ParoBackend::ParoWork::getFuture() { return future_; }

void ParoBackend::ParoWork::complete(std::exception_ptr error) {
  finish(error);
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

// ------------------------------------------------------------------------------------- Backend
ParoBackend::ParoBackend(const Shape& shape, c10::intrusive_ptr<c10d::Backend> intra,
                         c10::intrusive_ptr<c10d::Backend> inter, c10::intrusive_ptr<c10d::Backend> global,
                         DeviceFactory device_factory)
    : c10d::Backend(shape.rank, shape.world),
      shape_(shape),
      intra_(std::move(intra)),
      inter_(std::move(inter)),
      global_(std::move(global)),
      queue_(std::make_shared<Queue>()),
      device_factory_(std::move(device_factory)) {
  TORCH_CHECK(global_, "paro: a global sub-backend is required");
  worker_ = std::thread([queue = queue_] { worker_loop(queue); });
}

// One request for the worker thread.
struct ParoBackend::Task {
  c10::intrusive_ptr<ParoWork> work;
  std::function<void()> fn;
  std::string what;  // "all_reduce #7 (1000 elements of Float) on rank 0 of 4", for error messages
  // The caller's profiler state, so that the plan's steps appear in the caller's torch.profiler trace.
  at::RecordFunctionTLS profiler_callbacks;
  std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info;
};

// Requests for the worker thread, shared by the backend and the thread (see worker_loop).
//
// The worker never drops a reference to a caller's tensor: a tensor whose Python object has died while the
// request still held it is freed by taking the GIL, and a thread that takes the GIL while the interpreter exits
// ends inside a noexcept destructor: the process aborts with "terminate called without an active exception"
// (clean exits; measured: 17 % of the outputs of `all_gather_into_tensor(async_op=True)` followed by wait() were
// freed on the worker). A finished request is retired instead, and the retired ones are dropped on a caller's
// thread: the next request's (enqueue), a waiter's (ParoWork::wait) or the destructor's.
struct ParoBackend::Queue {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Task> tasks;
  std::vector<Task> retired;
  bool stop = false;

  void drop_retired() {
    std::vector<Task> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex);
      dropped.swap(retired);
    }
  }  // `dropped` is destroyed here, outside the lock
};

bool ParoBackend::ParoWork::wait(std::chrono::milliseconds timeout) {
  const bool done = c10d::Work::wait(timeout);
  if (auto queue = queue_.lock()) queue->drop_retired();  // on the caller's thread, which holds this Work
  return done;
}

ParoBackend::~ParoBackend() {
  const bool on_worker = worker_.joinable() && worker_.get_id() == std::this_thread::get_id();
  std::deque<Task> orphaned;
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->stop = true;
    // destroyed by a completion callback on the worker itself: later requests would run on a freed backend
    if (on_worker) orphaned.swap(queue_->tasks);
  }
  queue_->cv.notify_all();
  for (auto& task : orphaned) {
    task.work->complete(std::make_exception_ptr(std::runtime_error(
        "paro: the process group was destroyed before " + task.what + " ran")));
  }
  if (!worker_.joinable()) return;
  if (on_worker) {
    worker_.detach();  // the loop ends after the current request; it holds the queue itself
    return;
  }
  try {
    worker_.join();  // runs every request queued before the destruction first
  } catch (const std::exception&) {
    worker_.detach();
  }
  queue_->drop_retired();
}

void ParoBackend::worker_loop(const std::shared_ptr<Queue>& queue) {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(queue->mutex);
      queue->cv.wait(lock, [&queue] { return queue->stop || !queue->tasks.empty(); });
      if (queue->tasks.empty()) return;  // stopped, nothing left
      task = std::move(queue->tasks.front());
      queue->tasks.pop_front();
    }
    std::exception_ptr error;
    const at::RecordFunctionTLS own_callbacks = at::get_record_function_tls_();
    at::set_record_function_tls_(task.profiler_callbacks);
    {
      c10::DebugInfoGuard debug_info(task.debug_info);
      try {
        try {
          task.fn();
        } catch (...) {
          rethrow_with("paro: " + task.what + " failed");
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    at::set_record_function_tls_(own_callbacks);
    task.work->complete(error);
    std::lock_guard<std::mutex> lock(queue->mutex);
    queue->retired.push_back(std::move(task));  // dropped on a caller's thread (see Queue)
  }
}

c10::intrusive_ptr<c10d::Work> ParoBackend::enqueue(c10d::OpType type, const char* title,
                                                    const std::vector<at::Tensor>& inputs,
                                                    std::vector<at::Tensor> outputs, std::function<void()> fn) {
  const at::Tensor* first = nullptr;  // the tensors' device decides where the collective runs
  for (const std::vector<at::Tensor>* ts : {&inputs, static_cast<const std::vector<at::Tensor>*>(&outputs)}) {
    for (const auto& t : *ts) {
      if (!t.defined()) continue;
      if (!first) first = &t;
      TORCH_CHECK(t.device() == first->device(), "paro: ", title + 5, " got tensors on different devices (",
                  first->device(), " and ", t.device(), "); put all its tensors on one device");
    }
  }
  const uint64_t seq = ++seq_;
  int64_t numel = 0;
  for (const auto& t : inputs) numel += t.defined() ? t.numel() : 0;
  std::string what = c10::str(title + 5, " #", seq);  // title without "paro:"
  if (!inputs.empty() && inputs[0].defined()) what += c10::str(" (", numel, " elements of ", inputs[0].scalar_type(), ")");
  what += c10::str(" on rank ", getRank(), " of ", getSize());
  if (first && !first->device().is_cpu()) {
    return run_on_device(device(first->device()), type, title, seq, inputs, std::move(outputs), fn, what);
  }
  auto work = c10::make_intrusive<ParoWork>(getRank(), type, title, inputs, std::move(outputs), seq, queue_);
  Task task{work, std::move(fn), std::move(what), at::get_record_function_tls_(), c10::ThreadLocalDebugInfo::current()};
  std::vector<Task> retired;  // dropped on this thread, after the lock (see Queue)
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->tasks.push_back(std::move(task));
    retired.swap(queue_->retired);
  }
  queue_->cv.notify_one();
  return work;
}

c10d::Backend& ParoBackend::level(Level l) const {
  const c10::intrusive_ptr<c10d::Backend>* subs[3] = {&intra_, &inter_, &global_};
  if (tl_device) {
    for (int i = 0; i < 3; ++i) subs[i] = &tl_device->subs[i];
  }
  const auto& b = *subs[level_index(l)];
  TORCH_CHECK(b, "paro: plan uses the ", (l == Level::Intra ? "intra" : "inter"),
              "-group sub-backend, which this group does not have");
  return *b;
}

ParoBackend::Device& ParoBackend::device(const c10::Device& d) {
  std::lock_guard<std::mutex> lock(device_mutex_);
  if (device_) {
    TORCH_CHECK(device_->device == d, "paro: this process group runs its device collectives on ", device_->device,
                " and got a tensor on ", d, "; a process group serves one device per process (call "
                "torch.cuda.set_device(local_rank) and keep the tensors on it)");
    return *device_;
  }
  TORCH_CHECK(device_factory_, "paro: this process group has no sub-backends for ", d, " tensors");
  SubBackends subs = device_factory_(d);
  TORCH_CHECK(subs[2], "paro: no global sub-backend for ", d);
  c10::impl::VirtualGuardImpl impl(d.type());
  // one stream per distinct sub-backend (a level that is the global one shares its stream), one for local steps
  const c10::Stream global_lane = impl.getStreamFromGlobalPool(d, /*isHighPriority=*/true);
  auto lane_of = [&](const c10::intrusive_ptr<c10d::Backend>& b) {
    return !b || b == subs[2] ? global_lane : impl.getStreamFromGlobalPool(d, /*isHighPriority=*/true);
  };
  const c10::Stream intra_lane = lane_of(subs[0]);
  const c10::Stream inter_lane = lane_of(subs[1]);
  const c10::Stream local_lane = impl.getStreamFromGlobalPool(d, /*isHighPriority=*/true);
  device_.reset(new Device{d, std::move(subs), {intra_lane, inter_lane, global_lane, local_lane}});
  return *device_;
}

// Runs a collective on a device from the caller's thread: the local lane waits on the caller's stream, `fn` runs
// with the local lane as the current stream (run() fans each plan out to the level lanes and joins it back), and
// the Work's wait() makes the then-current stream wait on the local lane. Tensors used on a lane are recorded on
// it, so the caching allocator keeps their memory until the lane is done with them even if the caller drops them.
c10::intrusive_ptr<c10d::Work> ParoBackend::run_on_device(Device& dev, c10d::OpType type, const char* title,
                                                          uint64_t seq, const std::vector<at::Tensor>& inputs,
                                                          std::vector<at::Tensor> outputs,
                                                          const std::function<void()>& fn, const std::string& what) {
  std::function<void()> end_record = start_record(title, inputs, seq);
  c10::impl::VirtualGuardImpl impl(dev.device.type());
  const c10::Stream& local = dev.lanes[kLocalLane];
  c10::Event ready(dev.device.type());
  ready.record(impl.getStream(dev.device));
  ready.block(local);
  for (const std::vector<at::Tensor>* ts : {&inputs, static_cast<const std::vector<at::Tensor>*>(&outputs)}) {
    for (const auto& t : *ts) {
      if (t.defined() && t.has_storage()) impl.recordDataPtrOnStream(t.storage().data_ptr(), local);
    }
  }
  {
    c10::StreamGuard guard(local);
    struct Scope {
      explicit Scope(Device* d) { tl_device = d; }
      ~Scope() { tl_device = nullptr; }
    } scope(&dev);
    try {
      fn();
    } catch (...) {
      rethrow_with("paro: " + what + " failed");
    }
  }
  auto work = c10::make_intrusive<DeviceWork>(getRank(), type, seq, local, std::move(outputs));
  if (end_record) end_record();
  return work;
}

void ParoBackend::run(CollectiveOp op, const at::Tensor& input, const at::Tensor& output, int64_t numel, int64_t root,
                      const c10d::ReduceOp& reduce_op) {
  Device* const dev = tl_device;  // null: the CPU path, on the worker thread
  at::Tensor in = borrowed(input).view({-1});
  at::Tensor out = borrowed(output).view({-1});
  if (reduce_op.op_ == c10d::ReduceOp::PREMUL_SUM) {
    // NCCLPreMulSumSupplement: torch 2.11's name; torch 2.15 keeps it as an alias of PreMulSumSupplement
    auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(reduce_op.supplement_.get());
    TORCH_CHECK(sup, "paro: PREMUL_SUM without a factor");
    bool in_place = in.data_ptr() == out.data_ptr();
    if (sup->tensor_factor.defined()) {
      in = in_place ? out.mul_(sup->tensor_factor) : in.mul(sup->tensor_factor);
    } else {
      in = in_place ? out.mul_(sup->double_factor) : in.mul(sup->double_factor);
    }
  }
  const c10d::ReduceOp sub_op = plain_sum_if_scaled(reduce_op);
  PlanOut plan = make_plan(op, shape_, static_cast<uint64_t>(numel), static_cast<uint64_t>(in.element_size()),
                           static_cast<int32_t>(root));
  std::vector<at::Tensor> tmp;
  tmp.reserve(plan.tmp.size());
  for (int64_t n : plan.tmp) tmp.push_back(at::empty({n}, in.options()));  // see Buf::Tmp in planner.rs
  auto view = [&](const Region& r) {
    const at::Tensor& base = r.buf == 0 ? in : (r.buf == 1 ? out : tmp.at(r.buf - 2));
    return base.as_strided({r.d0, r.d1, r.d2}, {r.s0, r.s1, r.s2}, base.storage_offset() + r.offset);
  };
  // On a device (paro_core::streams, [Note: stream schedule]): `ends` holds the end events of the last stage that
  // used a lane, at first `ready` on the current stream; `lane` switches the current stream to a step's lane.
  std::vector<c10::Event> ends;
  c10::OptionalStreamGuard lane;
  uint8_t used = 0;  // lanes used by the whole plan
  if (dev) {
    c10::impl::VirtualGuardImpl impl(dev->device.type());
    ends.emplace_back(dev->device.type());
    ends.back().record(impl.getStream(dev->device));
  }
  // Issues a communication step: counts it, opens its profiler event (in `record`, ended by its owner) and
  // returns its Work; the step's buffers go to `keep`, which must outlive the Work.
  auto issue = [&](const Step& s, std::vector<at::Tensor>& keep, std::unique_ptr<at::RecordFunction>& record_out,
                   const char*& title) -> c10::intrusive_ptr<c10d::Work> {
    at::Tensor src = view(s.src).view({-1});
    at::Tensor dst = view(s.dst).view({-1});
    keep.push_back(src);
    keep.push_back(dst);
    c10d::Backend& b = level(s.level);
    const int li = level_index(s.level);
    bytes_[li] += s.bytes;
    ops_[li] += 1;
    title = step_title(s.level, s.kind);
    auto record = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (record->isActive()) {
      const std::array<c10::IValue, 2> args{src, dst};
      record->before(title, c10::ArrayRef<const c10::IValue>(args.data(), args.size()));
      record_out = std::move(record);
    }
    const bool async = dev == nullptr;  // on a device: enqueued on the lane (the current stream)
    switch (s.kind) {
      case Kind::AllGather: {
        c10d::AllgatherOptions o;
        o.asyncOp = async;
        return (sub_all_gather_single(b, dst, src, o));
      }
      case Kind::AllToAll: {
        std::vector<int64_t> even;
        c10d::AllToAllOptions o;
        o.asyncOp = async;
        return (sub_all_to_all_single(b, dst, src, even, even, o));
      }
      case Kind::AllReduce: {
        std::vector<at::Tensor> v{dst};
        c10d::AllreduceOptions o;
        o.reduceOp = sub_op;
        o.asyncOp = async;
        return (b.allreduce(v, o));
      }
      case Kind::Broadcast: {
        std::vector<at::Tensor> v{dst};
        c10d::BroadcastOptions o;
        o.rootRank = s.root;
        o.asyncOp = async;
        return (b.broadcast(v, o));
      }
      case Kind::Reduce: {
        std::vector<at::Tensor> v{dst};
        c10d::ReduceOptions o;
        o.rootRank = s.root;
        o.reduceOp = sub_op;
        o.asyncOp = async;
        return (b.reduce(v, o));
      }
      case Kind::Barrier: {
        c10d::BarrierOptions o;
        o.asyncOp = async;
        return (b.barrier(o));
      }
      default:
        TORCH_CHECK(false, "paro: unknown plan step");
    }
    return {};
  };
  const auto& steps = plan.steps;
  // The CPU path (paro_core::host, [Note: host schedule]): steps in plan order, each after the communication
  // steps its `waits` name; every issued step ends before an error propagates (they write through borrowed tensors).
  if (!dev) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works(steps.size());
    std::vector<std::vector<at::Tensor>> keep(steps.size());
    std::vector<std::unique_ptr<at::RecordFunction>> records(steps.size());
    std::vector<const char*> titles(steps.size(), nullptr);
    std::exception_ptr first_error;
    size_t failed = 0;
    auto finish = [&](size_t j) {
      if (!works[j]) return;
      try {
        works[j]->wait();
      } catch (...) {
        if (!first_error) {
          first_error = std::current_exception();
          failed = j;
        }
      }
      works[j].reset();
      records[j].reset();  // ends the step's profiler event
      keep[j].clear();
    };
    for (size_t j = 0; j < steps.size() && !first_error; ++j) {
      const Step& s = steps[j];
      for (uint32_t w : s.waits) finish(w);
      if (first_error) break;
      try {
        if (s.kind == Kind::Copy) {
          view(s.dst).copy_(view(s.src));
        } else if (s.kind == Kind::Combine) {
          combine(view(s.src), view(s.dst), sub_op.op_);
        } else {
          works[j] = issue(s, keep[j], records[j], titles[j]);
        }
      } catch (...) {
        first_error = std::current_exception();
        failed = j;
      }
    }
    for (size_t j = 0; j < steps.size(); ++j) finish(j);
    if (first_error) {
      const char* title = titles[failed] ? titles[failed] : step_title(steps[failed].level, steps[failed].kind);
      try {
        std::rethrow_exception(first_error);
      } catch (...) {
        rethrow_with(c10::str("in step ", title, " of stage ", steps[failed].stage));
      }
    }
  }
  size_t i = 0;
  while (dev && i < steps.size()) {
    const uint32_t stage = steps[i].stage;
    uint8_t entered = 0;  // lanes of this stage that have waited on `ends`
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<const char*> titles;  // of works
    std::vector<at::Tensor> keep;     // sub-collective buffers stay alive until the stage ends
    std::vector<std::unique_ptr<at::RecordFunction>> records;  // profiler events of the stage's steps
    for (; i < steps.size() && steps[i].stage == stage; ++i) {
      const Step& s = steps[i];
      const bool local = s.kind == Kind::Copy || s.kind == Kind::Combine;
      if (dev) {
        const int l = local ? kLocalLane : level_index(s.level);
        const auto bit = static_cast<uint8_t>(1u << l);
        TORCH_INTERNAL_ASSERT(plan.stage_lanes.at(stage) & bit, "paro: a step outside its stage's lanes");
        if (!(entered & bit)) {
          for (const auto& e : ends) e.block(dev->lanes[l]);
          entered |= bit;
        }
        if (s.wait_local) {  // it may read what the local steps before it in this stage wrote
          c10::Event e(dev->device.type());
          e.record(dev->lanes[kLocalLane]);
          e.block(dev->lanes[l]);
        }
        lane.reset_stream(dev->lanes[l]);
      }
      if (s.kind == Kind::Copy) {
        view(s.dst).copy_(view(s.src));
        continue;
      }
      if (s.kind == Kind::Combine) {
        combine(view(s.src), view(s.dst), sub_op.op_);
        continue;
      }
      std::unique_ptr<at::RecordFunction> record;
      titles.emplace_back();
      works.push_back(issue(s, keep, record, titles.back()));
      if (record) records.push_back(std::move(record));
      // On a device the lane waits for the step (no CPU wait on NCCL; a null Work was enqueued on the lane).
      if (dev && works.back()) works.back()->wait();
    }
    if (dev) {
      lane.reset();
      if (entered) {
        ends.clear();
        for (int l = 0; l < 4; ++l) {
          if (entered & (1u << l)) {
            ends.emplace_back(dev->device.type());
            ends.back().record(dev->lanes[l]);
          }
        }
        used |= entered;
      }
      records.clear();
      continue;
    }
  }
  if (dev) {  // join: the current stream waits on the last stage; the lanes keep what they used
    c10::impl::VirtualGuardImpl impl(dev->device.type());
    const c10::Stream current = impl.getStream(dev->device);
    for (const auto& e : ends) e.block(current);
    for (int l = 0; l < 4; ++l) {
      if (!(used & (1u << l)) || dev->lanes[l] == current) continue;
      for (const at::Tensor* t : {&in, &out}) impl.recordDataPtrOnStream(t->storage().data_ptr(), dev->lanes[l]);
      for (const auto& t : tmp) impl.recordDataPtrOnStream(t.storage().data_ptr(), dev->lanes[l]);
    }
  }
  if (reduce_op.op_ == c10d::ReduceOp::AVG && (op != CollectiveOp::Reduce || getRank() == root)) {
    out.div_(getSize());
  }
}

// ---------------------------------------------------------------------------------- collectives
c10::intrusive_ptr<c10d::Work> ParoBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "paro: broadcast takes one tensor per rank (got ", tensors.size(), ")");
  check_tensor(tensors[0], "broadcast");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < getSize(), "paro: broadcast root ", opts.rootRank,
              " is out of range for ", getSize(), " ranks");
  at::Tensor t = tensors[0];
  int64_t root = opts.rootRank;
  return enqueue(c10d::OpType::BROADCAST, "paro:broadcast", tensors, tensors, [this, t, root] {
    run(CollectiveOp::Broadcast, t, t, t.numel(), root, c10d::ReduceOp(c10d::ReduceOp::SUM));
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "paro: allreduce takes one tensor per rank (got ", tensors.size(), ")");
  if (tensors[0].defined() && tensors[0].is_sparse()) {
    TORCH_CHECK(tensors[0].device().is_cpu(), "paro: sparse all_reduce takes CPU tensors (got ", tensors[0].device(),
                "); reduce the dense tensor or move it to the CPU");
    // Gloo's sparse all_reduce, in order with the rest, on a copy that only C++ owns (see borrowed())
    at::Tensor t = tensors[0];
    return enqueue(c10d::OpType::ALLREDUCE, "paro:all_reduce", tensors, tensors, [this, t, opts] {
      ops_[2] += 1;
      std::vector<at::Tensor> local{t.clone()};
      global_->allreduce(local, opts)->wait();
      t.copy_(local[0]);
    });
  }
  check_tensor(tensors[0], "allreduce");
  check_reduce_op(opts.reduceOp, tensors[0]);
  at::Tensor t = tensors[0];
  c10d::ReduceOp op = opts.reduceOp;
  return enqueue(c10d::OpType::ALLREDUCE, "paro:all_reduce", tensors, tensors,
                 [this, t, op] { run(CollectiveOp::AllReduce, t, t, t.numel(), 0, op); });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  for (const auto& t : tensors) {
    check_tensor(t, "allreduce_coalesced");
    check_reduce_op(opts.reduceOp, t);
  }
  std::vector<at::Tensor> ts = tensors;
  c10d::ReduceOp op = opts.reduceOp;
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "paro:all_reduce_coalesced", tensors, tensors, [this, ts, op] {
    for (const auto& t : ts) run(CollectiveOp::AllReduce, t, t, t.numel(), 0, op);
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "paro: reduce takes one tensor per rank (got ", tensors.size(), ")");
  check_tensor(tensors[0], "reduce");
  check_reduce_op(opts.reduceOp, tensors[0]);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < getSize(), "paro: reduce root ", opts.rootRank,
              " is out of range for ", getSize(), " ranks");
  at::Tensor t = tensors[0];
  int64_t root = opts.rootRank;
  c10d::ReduceOp op = opts.reduceOp;
  return enqueue(c10d::OpType::REDUCE, "paro:reduce", tensors, tensors,
                 [this, t, root, op] { run(CollectiveOp::Reduce, t, t, t.numel(), root, op); });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::all_gather_single(at::Tensor& output, at::Tensor& input,
                                                              const c10d::AllgatherOptions& /*opts*/) {
  check_tensor(input, "all_gather_into_tensor");
  check_tensor(output, "all_gather_into_tensor");
  check_same(input, output, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * getSize(), "paro: all_gather_into_tensor needs an output of ",
              getSize(), " x ", input.numel(), " elements (got ", output.numel(), ")");
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "paro:all_gather_into_tensor", {input}, {output}, [this, in, out] {
    run(CollectiveOp::AllGather, in, out, in.numel(), 0, c10d::ReduceOp(c10d::ReduceOp::SUM));
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::all_gather_single_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::AllgatherOptions& /*opts*/) {
  TORCH_CHECK(outputs.size() == inputs.size(), "paro: coalesced all-gather needs as many outputs as inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], "all_gather_into_tensor_coalesced");
    check_tensor(outputs[i], "all_gather_into_tensor_coalesced");
    check_same(inputs[i], outputs[i], "all_gather_into_tensor_coalesced");
    TORCH_CHECK(outputs[i].numel() == inputs[i].numel() * getSize(),
                "paro: all_gather_into_tensor_coalesced output ", i, " has the wrong size");
  }
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  return enqueue(c10d::OpType::COALESCED, "paro:all_gather_into_tensor_coalesced", inputs, outputs,
                 [this, ins, outs] {
    for (size_t i = 0; i < ins.size(); ++i) {
      run(CollectiveOp::AllGather, ins[i], outs[i], ins[i].numel(), 0, c10d::ReduceOp(c10d::ReduceOp::SUM));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& /*opts*/) {
  TORCH_CHECK(outputs.size() == inputs.size(), "paro: allgather needs one output list per input tensor");
  return allgather_lists("paro:all_gather", outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> ParoBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& /*opts*/) {
  // all_gather_coalesced's layout: outputs[rank][i] is input i of that rank (allgather's is outputs[i][rank])
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "paro: all_gather_coalesced needs one output list per ",
              "rank (", getSize(), "), got ", outputs.size());
  std::vector<std::vector<at::Tensor>> per_input(inputs.size());
  for (const auto& of_rank : outputs) {
    TORCH_CHECK(of_rank.size() == inputs.size(), "paro: all_gather_coalesced needs ", inputs.size(),
                " output tensors per rank (one per input), got ", of_rank.size());
    for (size_t i = 0; i < inputs.size(); ++i) per_input[i].push_back(of_rank[i]);
  }
  return allgather_lists("paro:all_gather_coalesced", per_input, inputs);
}

c10::intrusive_ptr<c10d::Work> ParoBackend::allgather_lists(const char* title,
                                                            const std::vector<std::vector<at::Tensor>>& outputs,
                                                            const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> flat_outputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], "all_gather");
    TORCH_CHECK(static_cast<int>(outputs[i].size()) == getSize(), "paro: all_gather needs a list of ", getSize(),
                " output tensors (got ", outputs[i].size(), ")");
    for (const auto& t : outputs[i]) {
      TORCH_CHECK(t.numel() == inputs[i].numel(), "paro: all_gather output tensors must match the input's size");
      check_same(inputs[i], t, "all_gather");
      flat_outputs.push_back(t);
    }
  }
  std::vector<at::Tensor> ins = inputs;
  std::vector<std::vector<at::Tensor>> outs = outputs;
  return enqueue(c10d::OpType::ALLGATHER, title, inputs, flat_outputs, [this, ins, outs] {
    for (size_t i = 0; i < ins.size(); ++i) {
      at::Tensor in = ins[i].contiguous();
      at::Tensor gathered = at::empty({in.numel() * getSize()}, in.options());
      run(CollectiveOp::AllGather, in, gathered, in.numel(), 0, c10d::ReduceOp(c10d::ReduceOp::SUM));
      for (int r = 0; r < getSize(); ++r) {
        outs[i][r].copy_(gathered.narrow(0, r * in.numel(), in.numel()).view(outs[i][r].sizes()));
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::reduce_scatter_single(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  check_tensor(input, "reduce_scatter_tensor");
  check_tensor(output, "reduce_scatter_tensor");
  check_same(input, output, "reduce_scatter_tensor");
  check_reduce_op(opts.reduceOp, input);
  TORCH_CHECK(input.numel() == output.numel() * getSize(), "paro: reduce_scatter_tensor needs an input of ",
              getSize(), " x ", output.numel(), " elements (got ", input.numel(), ")");
  at::Tensor in = input, out = output;
  c10d::ReduceOp op = opts.reduceOp;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "paro:reduce_scatter_tensor", {input}, {output},
                 [this, in, out, op] { run(CollectiveOp::ReduceScatter, in, out, out.numel(), 0, op); });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::reduce_scatter_single_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "paro: coalesced reduce-scatter needs as many outputs as inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], "reduce_scatter_tensor_coalesced");
    check_tensor(outputs[i], "reduce_scatter_tensor_coalesced");
    check_reduce_op(opts.reduceOp, inputs[i]);
    TORCH_CHECK(inputs[i].numel() == outputs[i].numel() * getSize(),
                "paro: reduce_scatter_tensor_coalesced input ", i, " has the wrong size");
  }
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  c10d::ReduceOp op = opts.reduceOp;
  return enqueue(c10d::OpType::COALESCED, "paro:reduce_scatter_tensor_coalesced", inputs, outputs,
                 [this, ins, outs, op] {
    for (size_t i = 0; i < ins.size(); ++i) {
      run(CollectiveOp::ReduceScatter, ins[i], outs[i], outs[i].numel(), 0, op);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1, "paro: reduce_scatter takes one output tensor per rank");
  check_tensor(outputs[0], "reduce_scatter");
  check_reduce_op(opts.reduceOp, outputs[0]);
  TORCH_CHECK(static_cast<int>(inputs[0].size()) == getSize(), "paro: reduce_scatter needs a list of ", getSize(),
              " input tensors (got ", inputs[0].size(), ")");
  for (const auto& t : inputs[0]) {
    TORCH_CHECK(t.numel() == outputs[0].numel(), "paro: reduce_scatter inputs must match the output's size");
    check_same(outputs[0], t, "reduce_scatter");
  }
  std::vector<at::Tensor> ins = inputs[0];
  at::Tensor out = outputs[0];
  c10d::ReduceOp op = opts.reduceOp;
  return enqueue(c10d::OpType::REDUCE_SCATTER, "paro:reduce_scatter", inputs[0], outputs, [this, ins, out, op] {
    std::vector<at::Tensor> flat;
    for (const auto& t : ins) flat.push_back(t.reshape({-1}));
    at::Tensor in = at::cat(flat);
    run(CollectiveOp::ReduceScatter, in, out, out.numel(), 0, op);
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::barrier(const c10d::BarrierOptions& /*opts*/) {
  return enqueue(c10d::OpType::BARRIER, "paro:barrier", {}, {}, [this] {
    at::Tensor none = at::empty({0});
    run(CollectiveOp::Barrier, none, none, 0, 0, c10d::ReduceOp(c10d::ReduceOp::SUM));
  });
}

// ------------------------------------------------------------------------------- pass-through
c10::intrusive_ptr<c10d::Work> ParoBackend::all_to_all_single(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& outputSplits,
                                                              std::vector<int64_t>& inputSplits,
                                                              const c10d::AllToAllOptions& opts) {
  at::Tensor o = output, i = input;
  std::vector<int64_t> os = outputSplits, is = inputSplits;
  return enqueue(c10d::OpType::ALLTOALL_BASE, "paro:all_to_all_single", {input}, {output}, [this, o, i, os, is, opts]() mutable {
    ops_[2] += 1;
    at::Tensor bo = borrowed(o), bi = borrowed(i);
    sub_all_to_all_single(level(Level::Global), bo, bi, os, is, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  std::vector<at::Tensor> o = outputs, i = inputs;
  return enqueue(c10d::OpType::ALLTOALL, "paro:all_to_all", inputs, outputs, [this, o, i, opts]() mutable {
    ops_[2] += 1;
    std::vector<at::Tensor> bo = borrowed(o), bi = borrowed(i);
    level(Level::Global).alltoall(bo, bi, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::GatherOptions& opts) {
  std::vector<std::vector<at::Tensor>> o = outputs;
  std::vector<at::Tensor> i = inputs;
  return enqueue(c10d::OpType::GATHER, "paro:gather", inputs, inputs, [this, o, i, opts]() mutable {
    ops_[2] += 1;
    std::vector<std::vector<at::Tensor>> bo = borrowed(o);
    std::vector<at::Tensor> bi = borrowed(i);
    level(Level::Global).gather(bo, bi, opts)->wait();
  });
}

c10::intrusive_ptr<c10d::Work> ParoBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  std::vector<at::Tensor> o = outputs;
  std::vector<std::vector<at::Tensor>> i = inputs;
  return enqueue(c10d::OpType::SCATTER, "paro:scatter", inputs.empty() ? std::vector<at::Tensor>{} : inputs[0], outputs, [this, o, i, opts]() mutable {
    ops_[2] += 1;
    std::vector<at::Tensor> bo = borrowed(o);
    std::vector<std::vector<at::Tensor>> bi = borrowed(i);
    level(Level::Global).scatter(bo, bi, opts)->wait();
  });
}

void ParoBackend::each_device_backend(const std::function<void(c10d::Backend&)>& fn) {
  std::lock_guard<std::mutex> lock(device_mutex_);
  if (!device_) return;
  for (int i = 0; i < 3; ++i) {  // each distinct sub-backend once (intra or inter may be the global one)
    const auto& b = device_->subs[i];
    if (b && (i == 2 || b != device_->subs[2])) fn(*b);
  }
}

void ParoBackend::shutdown() {
  each_device_backend([](c10d::Backend& b) { b.shutdown(); });
}

void ParoBackend::abort() {
  each_device_backend([](c10d::Backend& b) { b.abort(); });
}

void ParoBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  // Gloo's, on the worker after every earlier request: it tags its messages in call order, as collectives do
  enqueue(c10d::OpType::BARRIER, "paro:monitored_barrier", {}, {}, [this, opts, waitAllRanks] {
    ops_[2] += 1;
    global_->monitoredBarrier(opts, waitAllRanks);
  })->wait();
}

namespace {

// A point-to-point Work of the global sub-backend, recorded in torch.profiler as `title` ("paro:send") with its
// tensors, as torch's own backends record theirs; the event ends when the Work is waited on.
class P2PWork : public c10d::Work {
 public:
  P2PWork(int rank, c10d::OpType type, const char* title, const std::vector<at::Tensor>& tensors,
          c10::intrusive_ptr<c10d::Work> inner)
      : c10d::Work(rank, type, title, tensors), inner_(std::move(inner)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void abort() override { inner_->abort(); }
  void synchronize() override { inner_->synchronize(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  bool wait(std::chrono::milliseconds timeout) override {
    try {
      const bool done = inner_->wait(timeout);
      finish();
      return done;
    } catch (...) {
      finish(std::current_exception());
      throw;
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
};

}  // namespace

// Point-to-point passes straight to the global sub-backend of the tensors' device, from the caller's thread: its
// messages carry the caller's tags, so they need no place in the worker's order.
c10d::Backend& ParoBackend::p2p(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "paro: ", op, " takes one tensor (got ", tensors.size(), ")");
  check_tensor(tensors[0], op);
  return tensors[0].device().is_cpu() ? *global_ : *device(tensors[0].device()).subs[2];
}

c10::intrusive_ptr<c10d::Work> ParoBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  c10d::Backend& b = p2p(tensors, "send");
  return c10::make_intrusive<P2PWork>(getRank(), c10d::OpType::SEND, "paro:send", tensors,
                                      b.send(tensors, dstRank, tag));
}

c10::intrusive_ptr<c10d::Work> ParoBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  c10d::Backend& b = p2p(tensors, "recv");
  return c10::make_intrusive<P2PWork>(getRank(), c10d::OpType::RECV, "paro:recv", tensors,
                                      b.recv(tensors, srcRank, tag));
}

c10::intrusive_ptr<c10d::Work> ParoBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  c10d::Backend& b = p2p(tensors, "recv");
  return c10::make_intrusive<P2PWork>(getRank(), c10d::OpType::RECVANYSOURCE, "paro:recvAnySource", tensors,
                                      b.recvAnysource(tensors, tag));
}

// ---------------------------------------------------------------------------------- accounting
rust::Vec<std::uint64_t> ParoBackend::stats() const {
  rust::Vec<std::uint64_t> v;
  for (const auto& b : bytes_) v.push_back(b.load());
  for (const auto& o : ops_) v.push_back(o.load());
  return v;
}

void ParoBackend::reset_stats() {
  for (auto& b : bytes_) b = 0;
  for (auto& o : ops_) o = 0;
}

}  // namespace paro
