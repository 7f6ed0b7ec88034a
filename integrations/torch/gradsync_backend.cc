// gradsync as a torch.distributed (c10d) backend: ProcessGroupGradsync over one
// gradsync::Communicator, joined through the gradsync daemon and coordinator that
// gradsyncrun's environment names (RANK, WORLD_SIZE, GRADSYNC_JOB_ID, ...), not through
// torch's store. gradsync_torch/__init__.py registers it as "gradsync".
//
// Host tensors: each collective is queued on the communicator (the _async forms, which run in
// call order) and a completion thread waits for the gradsync Work in the same order, copies
// results where the call needed a flat buffer, then completes the c10d Work and its Future.
// CUDA tensors (built with GRADSYNC_TORCH_CUDA): the collective and its copies are queued on
// the current CUDA stream and the completion thread waits for an event recorded after them.
// torch 1.13 / 2.x differences: torch_compat.h.
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "gradsync/gradsync.h"
#include "torch_compat.h"
#ifdef GRADSYNC_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#endif

namespace gradsync_torch {
namespace {

namespace py = pybind11;
using gradsync::DataType;
using gradsync::Status;

DataType to_gradsync(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    default: TORCH_CHECK(false, "gradsync backend: tensors of type ", t, " are not supported");
  }
}

gradsync::ReduceOp to_gradsync(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return gradsync::ReduceOp::kSum;
    case c10d::ReduceOp::AVG: return gradsync::ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT: return gradsync::ReduceOp::kProd;
    case c10d::ReduceOp::MIN: return gradsync::ReduceOp::kMin;
    case c10d::ReduceOp::MAX: return gradsync::ReduceOp::kMax;
    default: TORCH_CHECK(false, "gradsync backend: reduce op ", int(op.op_), " is not supported (sum, avg, product, min, max)");
  }
}

void check_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous(), "gradsync backend: ", what,
              " must be a dense contiguous tensor");
#ifdef GRADSYNC_TORCH_CUDA
  TORCH_CHECK(t.is_cpu() || t.is_cuda(), "gradsync backend: ", what, " must be on the CPU or a CUDA device");
#else
  TORCH_CHECK(t.is_cpu(), "gradsync backend: ", what, " must be a CPU tensor (this build has no CUDA)");
#endif
}
const at::Tensor& single(const std::vector<at::Tensor>& ts, const char* what) {
  TORCH_CHECK(ts.size() == 1, "gradsync backend: ", what, ": one tensor per process, got ", ts.size());
  check_tensor(ts[0], what);
  return ts[0];
}

// A c10d Work completed by the backend's completion thread.
class GradsyncWork : public c10d::Work {
 public:
  GradsyncWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  void complete(const Status& s) {
    if (s.ok()) {
      finish();
      future_->markCompleted(c10::IValue(outputs_));
    } else {
      auto e = std::make_exception_ptr(std::runtime_error("gradsync backend: " + s.to_string()));
      finish(e);
      future_->setError(e);
    }
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace

class ProcessGroupGradsync : public BackendBase {
 public:
  ProcessGroupGradsync(int rank, int size, std::chrono::milliseconds timeout)
      : BackendBase(rank, size), comm_(join(rank, size, timeout)) {
    completer_ = std::thread([this] { complete_in_order(); });
  }
  ~ProcessGroupGradsync() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    completer_.join();
    (void)comm_.leave();
  }

  const std::string getBackendName() const override { return "gradsync"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const at::Tensor& t = single(tensors, "allreduce");
    const auto type = to_gradsync(t.scalar_type());
    const auto op = to_gradsync(opts.reduceOp);
    return launch(c10d::OpType::ALLREDUCE, tensors, t, {}, [=](Comm c) {
      return c.host() ? c.comm.allreduce_async(t.data_ptr(), t.data_ptr(), t.numel(), type, op)
                    : c.gpu(c.comm.allreduce(t.data_ptr(), t.data_ptr(), t.numel(), type, op, c.stream));
    });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const at::Tensor& t = single(tensors, "broadcast");
    TORCH_CHECK(opts.rootTensor == 0, "gradsync backend: broadcast: rootTensor must be 0");
    const auto type = to_gradsync(t.scalar_type());
    const int root = int(opts.rootRank);
    return launch(c10d::OpType::BROADCAST, tensors, t, {}, [=](Comm c) {
      return c.host() ? c.comm.broadcast_async(t.data_ptr(), t.numel(), type, root)
                    : c.gpu(c.comm.broadcast(t.data_ptr(), t.numel(), type, root, c.stream));
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    const at::Tensor& in = single(inputs, "allgather input");
    TORCH_CHECK(outputs.size() == 1 && outputs[0].size() == size_t(getSize()),
                "gradsync backend: allgather: one list of world-size output tensors");
    for (auto& o : outputs[0]) {
      TORCH_CHECK(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(),
                  "gradsync backend: allgather: every output must match the input's size and type");
    }
    at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
    std::vector<at::Tensor> outs = outputs[0];
    return launch(c10d::OpType::ALLGATHER, outs, in, {in, flat}, gather_into(in, flat), [outs, flat, n = in.numel()] {
      for (size_t r = 0; r < outs.size(); ++r) outs[r].view({-1}).copy_(flat.narrow(0, int64_t(r) * n, n));
    });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    check_tensor(input, "_allgather_base input");
    check_tensor(output, "_allgather_base output");
    TORCH_CHECK(output.numel() == getSize() * input.numel() && output.scalar_type() == input.scalar_type(),
                "gradsync backend: _allgather_base: the output must hold world size x the input");
    std::vector<at::Tensor> outs = {output};
    return launch(c10d::OpType::_ALLGATHER_BASE, outs, input, {input}, gather_into(input, output));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const at::Tensor& out = single(outputs, "reduce_scatter output");
    TORCH_CHECK(inputs.size() == 1 && inputs[0].size() == size_t(getSize()),
                "gradsync backend: reduce_scatter: one list of world-size input tensors");
    std::vector<at::Tensor> flat_parts;
    for (auto& i : inputs[0]) {
      TORCH_CHECK(i.numel() == out.numel() && i.scalar_type() == out.scalar_type(),
                  "gradsync backend: reduce_scatter: every input must match the output's size and type");
      flat_parts.push_back(i.reshape({-1}));
    }
    at::Tensor flat = at::cat(flat_parts);
    return launch(c10d::OpType::REDUCE_SCATTER, outputs, out, {flat}, scatter_from(flat, out, opts.reduceOp));
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    check_tensor(input, "_reduce_scatter_base input");
    check_tensor(output, "_reduce_scatter_base output");
    TORCH_CHECK(input.numel() == getSize() * output.numel() && output.scalar_type() == input.scalar_type(),
                "gradsync backend: _reduce_scatter_base: the input must hold world size x the output");
    std::vector<at::Tensor> outs = {output};
    return launch(c10d::OpType::_REDUCE_SCATTER_BASE, outs, output, {input},
                  scatter_from(input, output, opts.reduceOp));
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    // On the caller's thread: collectives queued before it run first, and none after it can
    // overtake it on any rank.
    auto work = c10::make_intrusive<GradsyncWork>(getRank(), c10d::OpType::BARRIER, std::vector<at::Tensor>{});
    work->complete(comm_.barrier());
    return work;
  }

  // The store-based barrier at the end of torch's init_process_group / new_group, answered by
  // an allreduce (gradsync_torch/__init__.py, _GradsyncStore).
  int64_t store_add(int64_t amount) {
    Status s = comm_.allreduce(&amount, 1, DataType::kInt64, gradsync::ReduceOp::kSum);
    TORCH_CHECK(s.ok(), "gradsync backend: ", s.to_string());
    return amount;
  }
  std::string describe() const {
    return "gradsync job " + comm_.job() + " rank " + std::to_string(comm_.rank()) + " of " +
           std::to_string(comm_.world_size()) + ", GPU path " + comm_.gpu_path();
  }

 private:
  // What a collective's launcher gets: the communicator and, for tensors on a GPU, the stream
  // to queue on and where the GPU form's Status goes. Host: an _async call's gradsync Work.
  struct Comm {
    gradsync::Communicator& comm;
    CUstream_st* stream;
    Status* queued;  // null for host tensors
    bool host() const { return queued == nullptr; }
    gradsync::Work gpu(Status s) const {
      *queued = std::move(s);
      return {};
    }
  };
  using Launcher = std::function<gradsync::Work(Comm)>;

  static gradsync::Communicator join(int rank, int size, std::chrono::milliseconds timeout) {
    auto session = gradsync::Session::connect();
    TORCH_CHECK(session.ok(), "gradsync backend: ", session.status().to_string(),
                " (run under gradsyncrun, or set GRADSYNC_DAEMON)");
    gradsync::JoinOptions o = gradsync::JoinOptions::from_env();
    TORCH_CHECK(o.rank == rank && o.world_size == size, "gradsync backend: torch asked for rank ", rank, " of ", size,
                " but the gradsync environment says RANK=", o.rank, " WORLD_SIZE=", o.world_size,
                " (init_process_group's rank and world_size must be gradsyncrun's)");
    if (timeout.count() > 0) o.op_timeout = timeout;
    auto comm = session->join(o);
    TORCH_CHECK(comm.ok(), "gradsync backend: ", comm.status().to_string());
    return std::move(comm).value();
  }

  Launcher gather_into(const at::Tensor& in, const at::Tensor& out) {
    const auto type = to_gradsync(in.scalar_type());
    return [=](Comm c) {
      return c.host() ? c.comm.all_gather_async(in.data_ptr(), out.data_ptr(), in.numel(), type)
                    : c.gpu(c.comm.all_gather(in.data_ptr(), out.data_ptr(), in.numel(), type, c.stream));
    };
  }
  Launcher scatter_from(const at::Tensor& in, const at::Tensor& out, const c10d::ReduceOp& reduce) {
    const auto type = to_gradsync(out.scalar_type());
    const auto op = to_gradsync(reduce);
    return [=](Comm c) {
      return c.host() ? c.comm.reduce_scatter_async(in.data_ptr(), out.data_ptr(), out.numel(), type, op)
                    : c.gpu(c.comm.reduce_scatter(in.data_ptr(), out.data_ptr(), out.numel(), type, op, c.stream));
    };
  }

  // Starts a collective and hands it to the completion thread. The Work holds `outputs`, the
  // completion thread `inputs` (both stay alive until the call completed). `after` (copies out
  // of a flat buffer) runs once the data is there: on the host after the gradsync Work, on a
  // GPU queued on the stream right behind the collective.
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, const std::vector<at::Tensor>& outputs,
                                        const at::Tensor& like, std::vector<at::Tensor> inputs,
                                        const Launcher& start, std::function<void()> after = nullptr) {
    auto work = c10::make_intrusive<GradsyncWork>(getRank(), type, outputs);
    Pending p;
    p.work = work;
    p.inputs = std::move(inputs);
    if (like.is_cpu()) {
      gradsync::Work w = start(Comm{comm_, nullptr, nullptr});
      p.wait = [w, after]() mutable {
        Status s = w.wait();
        if (s.ok() && after) after();
        return s;
      };
    } else {
#ifdef GRADSYNC_TORCH_CUDA
      auto stream = at::cuda::getCurrentCUDAStream(like.device().index());
      Status queued;
      (void)start(Comm{comm_, stream.stream(), &queued});
      if (queued.ok() && after) after();
      auto event = std::make_shared<at::cuda::CUDAEvent>();
      event->record(stream);
      p.wait = [this, queued, event] {
        if (!queued.ok()) return queued;
        event->synchronize();
        return comm_.async_error();
      };
#else
      TORCH_CHECK(false, "gradsync backend: built without CUDA");
#endif
    }
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(p));
    cv_.notify_all();
    return work;
  }

  void complete_in_order() {
    for (;;) {
      Pending p;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        p = std::move(queue_.front());
        queue_.pop_front();
      }
      Status s;
      try {
        s = p.wait();
      } catch (const std::exception& e) {
        s = Status(gradsync::Code::kInternal, e.what());
      }
      p.work->complete(s);
    }
  }

  struct Pending {
    c10::intrusive_ptr<GradsyncWork> work;
    std::vector<at::Tensor> inputs;
    std::function<Status()> wait;
  };

  gradsync::Communicator comm_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool stop_ = false;
  std::thread completer_;
};

}  // namespace gradsync_torch

PYBIND11_MODULE(_gradsync_torch, m) {
  namespace py = pybind11;
  using gradsync_torch::ProcessGroupGradsync;
  py::module::import("torch.distributed");  // registers the base class with pybind11
  m.attr("TORCH_BASE_CLASS") = gradsync_torch::kBaseClassName;
  py::class_<ProcessGroupGradsync, gradsync_torch::BackendBase, c10::intrusive_ptr<ProcessGroupGradsync>>(
      m, "ProcessGroupGradsync")
      .def(py::init([](int rank, int size, double timeout_s) {
             return c10::make_intrusive<ProcessGroupGradsync>(
                 rank, size, std::chrono::milliseconds(int64_t(timeout_s * 1000)));
           }),
           py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("_store_add", &ProcessGroupGradsync::store_add, py::call_guard<py::gil_scoped_release>())
      .def("describe", &ProcessGroupGradsync::describe);
}
