#include "gpu/device_comm.h"

#include <cstring>

#include "common/log.h"
#include "gpu/device_comm_impl.h"
#include "kernels/cuda_reduce.cuh"
#include "kernels/cuda_step.cuh"

namespace gradsync {

using namespace device_comm_detail;

DeviceComm::DeviceComm(DeviceCommConfig cfg, HostOps ops)
    : cfg_(std::move(cfg)), ops_(std::move(ops)), impl_(std::make_unique<Impl>()) {}

std::string DeviceComm::who() const {
  return "job=" + cfg_.job + " rank " + std::to_string(cfg_.rank) + " (host " + cfg_.host +
         ", GPU " + std::to_string(cfg_.device) + ")";
}

Result<std::unique_ptr<DeviceComm>> DeviceComm::create(const DeviceCommConfig& cfg, HostOps ops) {
  std::unique_ptr<DeviceComm> d(new DeviceComm(cfg, std::move(ops)));
  Impl& m = *d->impl_;
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return Status(Code::kFailedPrecondition,
                  d->who() + ": no CUDA device is visible (cudaGetDeviceCount: " +
                      (e == cudaSuccess ? std::string("0 devices") : cudaGetErrorString(e)) +
                      "); join without JoinOptions::device for host tensors");
  }
  if (cfg.device == JoinOptions::kDeviceLocalRank) d->cfg_.device = cfg.local_rank % devices;
  if (d->cfg_.device < 0 || d->cfg_.device >= devices) {
    return Status(Code::kInvalidArgument, d->who() + ": device " + std::to_string(cfg.device) +
                                              " does not exist (" + std::to_string(devices) + " visible)");
  }
  if (cudaError_t e = cudaSetDevice(d->cfg_.device); e != cudaSuccess) {
    return Status(Code::kFailedPrecondition, d->who() + ": cudaSetDevice: " + cudaGetErrorString(e));
  }
  {
    void* w = nullptr;
    if (cudaError_t e = cudaHostAlloc(&w, sizeof(HostWords), cudaHostAllocMapped); e != cudaSuccess) {
      return Status(Code::kInternal, d->who() + ": cudaHostAlloc (mapped): " + cudaGetErrorString(e));
    }
    std::memset(w, 0, sizeof(HostWords));
    m.words = static_cast<HostWords*>(w);
    m.held.pinned_host_bytes += sizeof(HostWords);
    void* dev = nullptr;
    if (cudaError_t e = cudaHostGetDevicePointer(&dev, w, 0); e != cudaSuccess) {
      return Status(Code::kInternal, d->who() + ": cudaHostGetDevicePointer: " + cudaGetErrorString(e));
    }
    m.words_dev = static_cast<HostWords*>(dev);
  }
  m.log_timing = std::getenv("GRADSYNC_STAGED_TIMING") != nullptr;
  {
    const char* tl = std::getenv("GRADSYNC_GPU_TIMELINE");
    m.timeline_asked = tl != nullptr && *tl != '\0' && std::strcmp(tl, "0") != 0;
  }

  if (cfg.world_size == 1) {
    m.path = Impl::Path::kSingle;
  } else {
    // Before any wait kernel of this rank exists (kernels/cuda_reduce.cuh says why).
    if (cudaError_t e = kernels::load_host_sync_kernels(); e != cudaSuccess) {
      return Status(Code::kInternal, d->who() + ": loading the GPU kernels: " + cudaGetErrorString(e));
    }
    if (cudaError_t e = kernels::load_step_kernels(); e != cudaSuccess) {
      return Status(Code::kInternal, d->who() + ": loading the GPU kernels: " + cudaGetErrorString(e));
    }
    if (cudaError_t e = kernels::load_reduce_kernels(); e != cudaSuccess) {
      return Status(Code::kInternal, d->who() + ": loading the GPU kernels: " + cudaGetErrorString(e));
    }
    GS_RETURN_IF_ERROR(d->agree_algorithm());
    GS_RETURN_IF_ERROR(d->count_gpu_shares());
    bool ipc = false;
    if (cfg.local_world_size == cfg.world_size && cfg.world_size <= kernels::kMaxNodeRanks &&
        std::getenv("GRADSYNC_GPU_STAGED") == nullptr) {
      GS_RETURN_IF_ERROR(d->setup_ipc(&ipc));
    }
    if (ipc) {
      m.path = Impl::Path::kIpc;
      m.why = "every rank on this node: kernels write peers' GPU memory through CUDA IPC; "
              "a region of " + std::to_string(m.layout.blocks) + " blocks x " +
              std::to_string(m.layout.nranks) + " sources x " + std::to_string(m.layout.slots) +
              " slots of " + std::to_string(m.layout.chunk_bytes >> 10) +
              " KiB, low-latency lines to " + std::to_string(m.layout.ll_max_bytes >> 10) +
              " KiB (GRADSYNC_GPU_MEMORY_MAX); two-shot from " +
              (m.layout.nranks >= 3 && m.layout.two_shot_min_bytes
                   ? std::to_string(m.layout.two_shot_min_bytes) + " bytes"
                   : std::string("never (") + (m.layout.nranks < 3 ? "2 ranks" : "off") + ")");
      if (m.timeline_asked) GS_RETURN_IF_ERROR(d->setup_timeline());
      GS_RETURN_IF_ERROR(d->setup_node_steps());
    } else {
      GS_RETURN_IF_ERROR(d->setup_staged());
      m.path = Impl::Path::kStaged;
      m.why = cfg.local_world_size != cfg.world_size ? "ranks on several nodes"
              : std::getenv("GRADSYNC_GPU_STAGED") != nullptr ? "GRADSYNC_GPU_STAGED is set"
              : cfg.world_size > kernels::kMaxNodeRanks
                  ? "more ranks on this node than the one-node kernels take (" +
                        std::to_string(kernels::kMaxNodeRanks) + ")"
                  : "CUDA IPC between this node's GPUs is not possible";
      GS_RETURN_IF_ERROR(d->setup_gdr());
    }
  }
  log::get("gpu")->info("{}: GPU collectives by {}", d->who(), d->path());
  if (m.timeline_asked && m.path != Impl::Path::kIpc) {
    log::get("gpu")->warn("{}: GRADSYNC_GPU_TIMELINE is set, but only the cuda-ipc path records "
                          "a timeline ({} here)", d->who(), d->path());
  }

  // The abort word: waits in kernels stop when the job is aborted or the daemon is lost.
  d->watcher_ = std::thread([p = d.get()] {
    int timed_out_polls = 0;
    while (!p->stop_.load(std::memory_order_acquire)) {
      if (!p->ops_.abort_reason().empty()) {
        __atomic_store_n(&p->impl_->words->abort, 1u, __ATOMIC_RELEASE);
      }
      // A kernel's wait that timed out is told now, not at this rank's next call: a rank
      // that synchronizes and stops calling would otherwise leave its peers to their own
      // timeouts, each naming its neighbour. The kernel claims the word by its code, then
      // writes the peer and the wait: read on the second poll that sees the code.
      if (!p->timeout_reported_.load(std::memory_order_relaxed) &&
          __atomic_load_n(&p->impl_->words->error.code, __ATOMIC_ACQUIRE) == 1 && ++timed_out_polls == 2) {
        p->report_timeout(p->error_word_status());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  return d;
}

// Collective over the whole world: how many ranks share this rank's GPU. A GPU is its
// machine's name and its PCI address (ranks of several nodes declared on one machine, as the
// tests do, share it too).
Status DeviceComm::count_gpu_shares() {
  char bus[32] = {};
  (void)cudaDeviceGetPCIBusId(bus, sizeof(bus) - 1, cfg_.device);
  (void)cudaGetLastError();
  char host[256] = {};
  (void)::gethostname(host, sizeof(host) - 1);
  const int64_t key = int64_t(std::hash<std::string>{}(std::string(host) + "/" + bus) >> 2) | 1;
  std::vector<int64_t> keys(size_t(cfg_.world_size), 0);
  keys[size_t(cfg_.rank)] = key;
  GS_RETURN_IF_ERROR(
      ops_.allreduce_now(keys.data(), keys.data(), keys.size(), DataType::kInt64, ReduceOp::kSum));
  impl_->gpu_shares = int(std::count(keys.begin(), keys.end(), key));
  int32_t most = impl_->gpu_shares;  // the same on every rank
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&most, &most, 1, DataType::kInt32, ReduceOp::kMax));
  impl_->most_gpu_shares = most;
  return Status::Ok();
}

// GRADSYNC_ALGO for GPU calls (ring, tree, oneshot, twoshot, hierarchical, auto), read by
// every rank and agreed: ranks that run different protocols would wait for each other until
// the op timeout, so a difference fails the join, naming it.
Status DeviceComm::agree_algorithm() {
  Impl& m = *impl_;
  std::string error;
  const char* v = std::getenv("GRADSYNC_ALGO");
  m.env_algo = plan::algo_from_env(v, &error);
  if (!error.empty()) {
    log::get("gpu")->warn("{}: {}; GPU calls choose for themselves", who(), error);
  }
  int64_t code[2] = {m.env_algo ? int64_t(*m.env_algo) + 1 : 0, 0};
  code[1] = -code[0];
  GS_RETURN_IF_ERROR(ops_.allreduce_now(code, code, 2, DataType::kInt64, ReduceOp::kMin));
  if (code[0] != -code[1]) {
    return {Code::kInvalidArgument, who() + ": GRADSYNC_ALGO differs between ranks (here " +
                                        (v && *v ? std::string(v) : std::string("unset")) +
                                        "): every rank of a job must run the same GPU algorithm"};
  }
  return Status::Ok();
}

void DeviceComm::quiesce() {
#if GRADSYNC_HAVE_GDR
  if (impl_->gdr) impl_->gdr->quiesce();
#endif
}

DeviceComm::~DeviceComm() {
  stop_.store(true, std::memory_order_release);
  if (watcher_.joinable()) watcher_.join();
  Impl& m = *impl_;
#if GRADSYNC_HAVE_GDR
  m.gdr.reset();
#endif
  (void)cudaSetDevice(cfg_.device);
  release_ipc();
  if (m.staging) (void)cudaFreeHost(m.staging);
  if (m.words) (void)cudaFreeHost(m.words);
  if (m.timeline) (void)cudaFree(m.timeline);
  if (m.timeline_event) (void)cudaEventDestroy(m.timeline_event);
  if (m.timeline_stream) (void)cudaStreamDestroy(m.timeline_stream);
}

const std::string& DeviceComm::path_why() const { return impl_->why; }

DeviceComm::MemoryUse DeviceComm::memory() const {
  MemoryUse u = impl_->held;
#if GRADSYNC_HAVE_GDR
  if (impl_->gdr) u += impl_->gdr->memory();
#endif
  return u;
}

Result<Communicator::GpuBytesSent> DeviceComm::bytes_sent() {
  Impl& m = *impl_;
  Communicator::GpuBytesSent b;
#if GRADSYNC_HAVE_GDR
  if (m.gdr) m.gdr->add_bytes_sent(b);
#endif
  // The node kernels' device counter only where one was queued: reading it takes a stream and
  // a copy, which may wait behind kernels of ranks sharing this GPU that wait for this rank's
  // next call (a suspected cause of the rare hangs of tests that read the bytes between step
  // calls without a sync: docs/status.md, "Rare hangs").
  if (m.path != Impl::Path::kIpc || !m.node_kernel_queued) return b;
  DeviceScope scope;
  if (Status e = scope.enter(cfg_.device); !e.ok()) return e;
  // A private non-blocking stream: no legacy-stream call (ranks may share the GPU).
  cudaStream_t s = nullptr;
  GS_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  uint64_t v = 0;
  cudaError_t e = cudaMemcpyAsync(&v, m.args.sent, sizeof v, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  (void)cudaStreamDestroy(s);
  GS_CUDA(e, "reading the bytes-sent counter");
  b.cuda_ipc += v;  // beside the one-node step channels' own (added above)
  return b;
}

const char* DeviceComm::path() const {
  switch (impl_->path) {
    case Impl::Path::kSingle: return "single-rank";
    case Impl::Path::kIpc: return "cuda-ipc";
    case Impl::Path::kStaged:
#if GRADSYNC_HAVE_GDR
      // One node of more ranks than the kernels take: the step channels over CUDA IPC alone.
      if (impl_->gdr && impl_->gdr->one_node()) return "cuda-ipc-steps";
      if (impl_->gdr && impl_->gdr->tcp()) return "tcp-steps";
      if (impl_->gdr) return impl_->gdr->gpu_slots() ? "gpudirect-rdma" : "rdma-host-memory";
#endif
      return "host-staged";
  }
  return "?";
}

DeviceComm::StagedTiming DeviceComm::last_staged_timing() const {
  std::lock_guard lock(impl_->mu);
  return impl_->timing;
}

Status DeviceComm::check_device_buffer(const char* name, const void* p) const {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return {Code::kInvalidArgument, std::string(name) + " buffer is not memory CUDA knows"};
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
    return {Code::kInvalidArgument,
            std::string(name) +
                " buffer is host memory; the stream forms of the collectives take "
                "device memory (use the forms without a stream for host buffers)"};
  }
  if (a.device != cfg_.device) {
    return {Code::kInvalidArgument, std::string(name) + " buffer is on GPU " +
                                        std::to_string(a.device) + ", the communicator on GPU " +
                                        std::to_string(cfg_.device)};
  }
  return Status::Ok();
}

// The host path's checks (validate: type, op, root, null and misaligned buffers, overflowing
// counts, reduce_scatter/all_gather overlap), then what only the GPU path needs.
Status DeviceComm::check_call(const CollectiveCall& c) const {
  GS_RETURN_IF_ERROR(validate(c, cfg_.world_size, cfg_.rank));
  const size_t es = element_size(c.type);
  // The larger buffer stays below 2^62 bytes: every offset the kernels compute fits.
  if (c.count > (size_t(1) << 62) / es / (strided(c.kind) ? size_t(cfg_.world_size) : 1)) {
    return {Code::kInvalidArgument,
            "count " + std::to_string(c.count) + " too large (" +
                (strided(c.kind) ? "world_size * count" : std::string("count")) +
                " elements must stay below 2^62 bytes)"};
  }
  if (c.count == 0) return Status::Ok();
  const bool bcast = c.kind == CollectiveKind::kBroadcast;
  if (!bcast) GS_RETURN_IF_ERROR(check_device_buffer("send", c.send));
  GS_RETURN_IF_ERROR(check_device_buffer(bcast ? "broadcast" : "recv", c.recv));
  if (c.kind == CollectiveKind::kAllreduce) {
    const size_t bytes = c.count * es;
    const auto s = reinterpret_cast<uintptr_t>(c.send), r = reinterpret_cast<uintptr_t>(c.recv);
    if (s != r && s < r + bytes && r < s + bytes) {
      return {Code::kInvalidArgument, "send and recv overlap without being the same buffer"};
    }
  }
  return Status::Ok();
}

Status DeviceComm::run(const CollectiveCall& call, cudaStream_t stream) {
  CollectiveCall c = call;
  c.algorithm = Algorithm::kAuto;  // the host collective of a staged call chooses, unless forced below
  const uint64_t number = ++calls_;
  auto refused = [&](const Status& s) {
    return Status(s.code(),
                  who() + ": GPU " + describe_gpu(c, number) + " refused: " + s.message());
  };
  if (c.kind != CollectiveKind::kAllreduce && c.kind != CollectiveKind::kReduceScatter &&
      c.kind != CollectiveKind::kAllGather && c.kind != CollectiveKind::kBroadcast) {
    return refused({Code::kInvalidArgument, "not a GPU collective"});
  }
  if (Status s = async_error(); !s.ok()) {
    return {Code::kFailedPrecondition, "communicator failed earlier: " + s.to_string()};
  }
  if (Status s = check_call(c); !s.ok()) return refused(s);
  if (c.count == 0) return Status::Ok();

  DeviceScope scope;
  if (Status e = scope.enter(cfg_.device); !e.ok()) return Status(e.code(), who() + ": " + e.message());

  Impl& m = *impl_;
  // CallOptions::algorithm, else GRADSYNC_ALGO (agreed at set-up), where the path has it:
  // one node: oneshot and twoshot pick the kernels' protocol (with GRADSYNC_GPU_NODE_STEPS=1 the
  // planner's one-shot and two-shot steps), ring and tree run the planner's steps over CUDA IPC
  // (setup_node_steps; the kernels when those channels were left out);
  // several nodes: ring, tree and hierarchical (allreduce) on the step channels (GPUDirect RDMA
  // or TCP peers) above their threshold, else the host-staged ring and tree; unforced, the
  // step channels' cost model chooses among those it has.
  const std::optional<plan::Algo> forced = plan::forced_algo(call.algorithm, m.env_algo);
  switch (m.path) {
    case Impl::Path::kSingle:
      // One rank: every collective is a copy of its one segment, or nothing.
      if (c.kind != CollectiveKind::kBroadcast && c.send != c.recv) {
        GS_CUDA(cudaMemcpyAsync(c.recv, c.send, c.count * element_size(c.type),
                                cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync");
      }
      return Status::Ok();
    case Impl::Path::kIpc: {
#if GRADSYNC_HAVE_GDR
      // GRADSYNC_GPU_NODE_STEPS=1 (agreed at set-up): every call on the step channels, oneshot
      // and twoshot too, and an unforced call as their cost model chooses (no node kernel).
      const bool pair_steps = m.node_pair_steps && (!forced || forced == plan::Algo::kOneShot ||
                                                    forced == plan::Algo::kTwoShot);
      if (m.gdr && (forced == plan::Algo::kRing || forced == plan::Algo::kTree || pair_steps)) {
        // The steps' message counts are relative to bases in device memory where every hop is
        // by CUDA IPC, so the call replays from a CUDA graph; through the NIC
        // (GRADSYNC_GDR_DIRECT=0) the worker numbers them at the call.
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        GS_CUDA(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
        if (capture != cudaStreamCaptureStatusNone && !m.gdr->capturable()) {
          // Every rank must take the same path, so no quiet fall-back to the kernels here.
          return refused({Code::kFailedPrecondition,
                          std::string("the ") + plan::to_string(*forced) +
                              " on one node runs the planner's steps, here through the NIC (no CUDA IPC "
                              "between this node's ranks, or GRADSYNC_GDR_DIRECT=0), whose worker numbers "
                              "the messages when the call is made, so it cannot be captured in a CUDA graph; "
                              "captured calls take auto, oneshot or twoshot"});
        }
        Status s = Status::Ok();
        if (pair_steps) {
          s = m.gdr->enqueue(c, stream, forced);  // unforced: the channels' cost model
        } else {
          c.algorithm = forced == plan::Algo::kTree ? Algorithm::kTree : Algorithm::kRing;
          s = m.gdr->enqueue(c, stream);
        }
        if (!s.ok()) return failed_to_queue(c, number, s);
        return Status::Ok();
      }
#endif
      const kernels::NodeCall nc{node_kind(c.kind), c.type, c.op, c.root, c.send, c.recv, c.count};
      m.node_kernel_queued = true;
      if (forced == plan::Algo::kOneShot || forced == plan::Algo::kTwoShot) {
        kernels::NodeLayout layout = m.layout;  // the same on every rank: the call's protocol
        layout.two_shot_min_bytes = forced == plan::Algo::kTwoShot ? 1 : 0;
        GS_CUDA(kernels::launch_node_collective(layout, m.args, nc, stream),
                std::string("launching the node ") + to_string(c.kind) + " kernel");
        return Status::Ok();
      }
      if (m.timeline == nullptr) {
        GS_CUDA(kernels::launch_node_collective(m.layout, m.args, nc, stream),
                std::string("launching the node ") + to_string(c.kind) + " kernel");
        return Status::Ok();
      }
      // Timeline: the chunked protocol, outside graph capture (a replay would overwrite the
      // records behind the host's back, and the event below cannot be waited for).
      const uint64_t bytes = uint64_t(c.count) * element_size(c.type);
      Impl::LastCall last;
      last.kind = c.kind;
      last.bytes = bytes;
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      GS_CUDA(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
      const kernels::NodeTimeline tl{m.timeline, gpu::kMaxChunksPerBlock};
      const kernels::NodeTimeline* use = nullptr;
      const kernels::NodeProtocol protocol = kernels::node_protocol(m.layout, nc.kind, bytes);
      if (protocol != kernels::NodeProtocol::kOneShot) {
        last.why_not = "the last call (" + describe_gpu(c, number) + ") took the " +
                       kernels::to_string(protocol) +
                       " protocol, which records nothing (the timeline is the chunked one-shot "
                       "protocol's; GRADSYNC_GPU_LL_MAX = " + std::to_string(m.layout.ll_max_bytes) +
                       ", GRADSYNC_GPU_TWOSHOT_MIN = " + std::to_string(m.layout.two_shot_min_bytes) + ")";
      } else if (capture != cudaStreamCaptureStatusNone) {
        last.why_not = "the last call (" + describe_gpu(c, number) +
                       ") was captured in a CUDA graph, which records nothing";
      } else {
        use = &tl;
      }
      GS_CUDA(kernels::launch_node_collective(m.layout, m.args, nc, stream, use),
              std::string("launching the node ") + to_string(c.kind) + " kernel");
      if (use != nullptr) {
        GS_CUDA(cudaEventRecord(m.timeline_event, stream), "cudaEventRecord (timeline)");
        last.recorded = true;
        last.why_not.clear();
      }
      m.last = last;
      return Status::Ok();
    }
    case Impl::Path::kStaged:
      break;
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  GS_CUDA(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    return refused({Code::kFailedPrecondition,
                    "the host-staged path (ranks on several nodes) cannot be captured in a CUDA "
                    "graph: its host half is started by the call, not by the graph's launch"});
  }
  if (forced == plan::Algo::kTree) c.algorithm = Algorithm::kTree;
  if (forced == plan::Algo::kRing) c.algorithm = Algorithm::kRing;
#if GRADSYNC_HAVE_GDR
  const bool rdma = c.count * element_size(c.type) >= m.gdr_min_bytes;
  // Hierarchical forced (an allreduce; the other collectives take the ring): refused before
  // anything is queued where the channels have no hierarchical set, on every rank alike.
  const bool hier = forced == plan::Algo::kHierarchical && c.kind == CollectiveKind::kAllreduce;
  if (hier && (m.gdr == nullptr || !m.gdr->hierarchical())) {
    return refused({Code::kInvalidArgument, "hierarchical needs the step channels' pairs of every node and a ring per "
                                            "local index, and this communicator has none (" + path_why() + ")"});
  }
  if (m.gdr && rdma) {
    const std::optional<plan::Algo> algo = hier ? forced : std::nullopt;
    if (Status s = m.gdr->enqueue(c, stream, algo); !s.ok()) return failed_to_queue(c, number, s);
    return Status::Ok();
  }
#endif
  return run_staged(c, stream, number);
}

}  // namespace gradsync
