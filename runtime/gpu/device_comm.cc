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
  return Status::Ok();
}

// Collective over the whole world, every rank on one node (every rank calls it at the same
// point): the CUDA IPC kernels among them. *usable is agreed.
Status DeviceComm::setup_ipc(bool* usable) {
  Impl& m = *impl_;
  *usable = false;
  const int n = cfg_.world_size, me = cfg_.rank;
  cudaDeviceProp prop{};
  GS_CUDA(cudaGetDeviceProperties(&prop, cfg_.device), "cudaGetDeviceProperties");
  // Every rank's kernel must be resident at once (the blocks wait on each other): ranks that
  // share a GPU share its SMs (count_gpu_shares).
  const int shares = m.gpu_shares;
  // Defaults measured on 2 H200s over NVLink (docs/benchmarks.md): 128 blocks of 256 KiB
  // chunks reach NCCL's bus bandwidth; the chunk shrinks with more ranks so that the region
  // stays 256 MiB. The low-latency protocol below GRADSYNC_GPU_LL_MAX bytes.
  int32_t blocks = int32_t(env_positive("GRADSYNC_GPU_BLOCKS", 128));
  blocks = std::clamp(blocks, 1, std::max(1, prop.multiProcessorCount / shares));
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&blocks, &blocks, 1, DataType::kInt32, ReduceOp::kMin));
  m.layout.nranks = n;
  m.layout.blocks = uint32_t(blocks);
  m.layout.slots = uint32_t(std::max(2L, env_positive("GRADSYNC_GPU_SLOTS", 4)));
  const long chunk = std::max(4096L, (512L << 10) / std::max(2, n));
  m.layout.chunk_bytes = uint64_t(env_positive("GRADSYNC_GPU_CHUNK", chunk)) / 256 * 256;
  const char* ll = std::getenv("GRADSYNC_GPU_LL_MAX");
  m.layout.ll_max_bytes = ll && *ll ? uint64_t(std::strtoull(ll, nullptr, 10)) : uint64_t(1 << 20);
  // From 3 ranks, allreduce and broadcast from this size go two-shot (kernels/
  // cuda_node_two_shot.cuh): 2 (n-1)/n of the buffer sent per rank instead of n - 1 buffers.
  // GRADSYNC_GPU_TWOSHOT_MIN=0: never.
  const char* two_shot = std::getenv("GRADSYNC_GPU_TWOSHOT_MIN");
  m.layout.two_shot_min_bytes = two_shot != nullptr && std::strcmp(two_shot, "0") == 0
                                    ? 0
                                    : uint64_t(env_positive("GRADSYNC_GPU_TWOSHOT_MIN", kTwoShotMinBytes));
  // The region is most of the communicator's GPU memory, which stays within
  // GRADSYNC_GPU_MEMORY_MAX MiB (default 320, above the defaults at every rank count: 264 MiB
  // at 2 ranks, 288 at 8); a smaller budget shrinks the chunk, then the low-latency lines.
  const uint64_t limit = gpu_memory_budget(), used = memory().gpu_bytes;
  const uint64_t budget = limit > used ? limit - used : 0;
  while (m.layout.region_bytes() > budget && m.layout.chunk_bytes > 4096)
    m.layout.chunk_bytes = std::max<uint64_t>(4096, m.layout.chunk_bytes / 2 / 256 * 256);
  while (m.layout.region_bytes() > budget && m.layout.ll_max_bytes > (64u << 10)) m.layout.ll_max_bytes /= 2;
  // Every rank must cut chunks, slots and protocols alike (each computes where it writes in
  // its peers' regions): the smallest of every rank's settings.
  {
    int64_t agreed[4] = {int64_t(m.layout.slots), int64_t(m.layout.chunk_bytes),
                         int64_t(m.layout.ll_max_bytes), int64_t(m.layout.two_shot_min_bytes)};
    GS_RETURN_IF_ERROR(ops_.allreduce_now(agreed, agreed, 4, DataType::kInt64, ReduceOp::kMin));
    m.layout.slots = uint32_t(agreed[0]);
    m.layout.chunk_bytes = uint64_t(agreed[1]);
    m.layout.ll_max_bytes = uint64_t(agreed[2]);
    m.layout.two_shot_min_bytes = uint64_t(agreed[3]);
  }
  // Agreed: a rank whose region does not fit fails the set-up on every rank, not only its own.
  int32_t fits = m.layout.region_bytes() <= budget ? 1 : 0;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&fits, &fits, 1, DataType::kInt32, ReduceOp::kMin));
  if (fits == 0) {
    const std::string over = "the CUDA IPC region needs " + std::to_string(m.layout.region_bytes() >> 20) +
                             " MiB with " + std::to_string(blocks) + " blocks and " + std::to_string(n) +
                             " ranks, over the " + std::to_string(budget >> 20) + " MiB left on some rank of " +
                             "GRADSYNC_GPU_MEMORY_MAX = " + std::to_string(limit >> 20) + " MiB";
    return {Code::kInvalidArgument, who() + ": " + over + ": raise it, or lower GRADSYNC_GPU_BLOCKS"};
  }
  if (!m.layout.valid()) {
    return {Code::kInvalidArgument, who() + ": GPU layout blocks=" + std::to_string(blocks) +
                                         " slots=" + std::to_string(m.layout.slots) + " chunk=" +
                                         std::to_string(m.layout.chunk_bytes) + " is invalid"};
  }
  GS_CUDA(cudaMalloc(&m.region, m.layout.region_bytes()), "cudaMalloc of the IPC region (" +
                                                              std::to_string(m.layout.region_bytes()) + " bytes)");
  GS_CUDA(cudaMemset(m.region, 0, m.layout.flags_bytes()), "cudaMemset");
  GS_CUDA(cudaMemset(static_cast<uint8_t*>(m.region) + m.layout.ll_offset(), 0,
                     m.layout.region_bytes() - m.layout.ll_offset()), "cudaMemset");
  // The blocks' counts, then the bytes-sent counter (NodeArgs::sent).
  const size_t progress_bytes = (2 * m.layout.blocks + 1) * sizeof(uint64_t);
  GS_CUDA(cudaMalloc(reinterpret_cast<void**>(&m.progress), progress_bytes), "cudaMalloc");
  GS_CUDA(cudaMemset(m.progress, 0, progress_bytes), "cudaMemset");
  m.held.gpu_bytes += m.layout.region_bytes() + progress_bytes;
  GS_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  std::vector<IpcEntry> table(static_cast<size_t>(n));
  std::memset(table.data(), 0, table.size() * sizeof(IpcEntry));
  IpcEntry& mine = table[size_t(cfg_.rank)];
  auto exported = ipc_export(m.region, cfg_.device);
  if (!exported.ok()) return Status(exported.status().code(), who() + ": " + exported.status().message());
  mine.ipc = *exported;
  (void)cudaDeviceGetPCIBusId(mine.bus_id, sizeof(mine.bus_id) - 1, cfg_.device);
  GS_RETURN_IF_ERROR(ops_.allreduce_now(table.data(), table.data(), table.size() * sizeof(IpcEntry),
                                        DataType::kUInt8, ReduceOp::kSum));

  std::string why;
  m.args.me = me;
  for (int p = 0; p < n; ++p) {
    if (p == me) {
      m.args.region[p] = static_cast<uint8_t*>(m.region);
      continue;
    }
    const IpcEntry& e = table[size_t(p)];
    bool opened = false;
    auto ptr = ipc_open(e.ipc, cfg_.device, &opened);
    if (!ptr.ok()) {
      why = "the region of rank " + std::to_string(p) + " (GPU " + e.bus_id + "): " +
            ptr.status().message();
      break;
    }
    if (opened) m.opened.push_back(*ptr);
    m.args.region[p] = static_cast<uint8_t*>(*ptr);
  }
  int32_t ok = why.empty() ? 1 : 0;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&ok, &ok, 1, DataType::kInt32, ReduceOp::kMin));
  if (ok == 0) {
    auto log = log::get("gpu");
    if (!why.empty()) log->warn("{}: no CUDA IPC path: {}", who(), why);
    else log->warn("{}: a peer could not open CUDA IPC", who());
    release_ipc();
    return Status::Ok();
  }
  m.args.progress = m.progress;
  m.args.sent = m.progress + 2 * m.layout.blocks;
  m.args.error = &m.words_dev->error;
  m.args.abort = &m.words_dev->abort;
  m.args.timeout_ns = uint64_t(cfg_.op_timeout.count()) * 1'000'000ull;
  *usable = true;
  return Status::Ok();
}


void DeviceComm::release_ipc() {
  Impl& m = *impl_;
  for (void* p : m.opened) ipc_close(p, cfg_.device);
  m.opened.clear();
  if (m.region) (void)cudaFree(m.region);
  if (m.progress) (void)cudaFree(m.progress);
  if (m.progress) m.held.gpu_bytes -= m.layout.region_bytes() + (2 * m.layout.blocks + 1) * sizeof(uint64_t);
  m.region = nullptr;
  m.progress = nullptr;
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

// GRADSYNC_GPU_TIMELINE: one record per block of the layout, kMaxChunksPerBlock chunks each.
Status DeviceComm::setup_timeline() {
  Impl& m = *impl_;
  const uint64_t words = uint64_t(m.layout.blocks) *
                         kernels::node_timeline_stride(gpu::kMaxChunksPerBlock);
  GS_CUDA(cudaMalloc(reinterpret_cast<void**>(&m.timeline), words * sizeof(uint64_t)),
          "cudaMalloc of the timeline");
  GS_CUDA(cudaMemset(m.timeline, 0, words * sizeof(uint64_t)), "cudaMemset");
  m.held.gpu_bytes += words * sizeof(uint64_t);
  GS_CUDA(cudaEventCreateWithFlags(&m.timeline_event, cudaEventDisableTiming), "cudaEventCreate");
  GS_CUDA(cudaStreamCreateWithFlags(&m.timeline_stream, cudaStreamNonBlocking), "cudaStreamCreate");
  GS_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  log::get("gpu")->info("{}: GPU timeline on (GRADSYNC_GPU_TIMELINE): {} blocks x {} chunks, {} KiB",
                        who(), m.layout.blocks, gpu::kMaxChunksPerBlock, words * 8 / 1024);
  return Status::Ok();
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
  if (m.path != Impl::Path::kIpc) return b;
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

Status DeviceComm::fail_from_error_word() {
  Impl& m = *impl_;
#if GRADSYNC_HAVE_GDR
  if (m.gdr) {
    if (Status s = m.gdr->error(); !s.ok()) {
      failed_ = {s.code(), who() + ": " + s.message()};
      return failed_;
    }
  }
#endif
  {
    std::lock_guard lock(m.mu);
    if (!m.staged_error.ok()) {
      failed_ = m.staged_error;
      return failed_;
    }
  }
  Status e = error_word_status();
  if (e.ok()) return e;
  failed_ = e;
  if (e.code() == Code::kDeadlineExceeded) report_timeout(e);
  return failed_;
}

// What the kernels' error word holds, as a status (Ok while it holds nothing); read by the
// caller's thread and by the watcher.
Status DeviceComm::error_word_status() const {
  const Impl& m = *impl_;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  const volatile kernels::NodeError& w = m.words->error;
  const kernels::NodeError e{w.code, w.peer, w.block, w.what};
  if (e.code == 0) return Status::Ok();
  const double ms = double(cfg_.op_timeout.count());
  std::string what;
  if (e.what == 2) {
    what = "the stream waited for host-staged results";
  } else if (e.what == 5) {
    what = "block " + std::to_string(e.block) + " of a step kernel waited for the kernel's other blocks";
  } else if (e.what == 3 || e.what == 4) {
    const std::string peer = "rank " + std::to_string(e.peer) +
                             (size_t(e.peer) < cfg_.hosts.size() ? " (host " + cfg_.hosts[e.peer] + ")" : "");
    // The step channels: the GPUDirect RDMA channels across nodes, CUDA IPC alone on one.
    const char* channel = m.path == Impl::Path::kIpc ? "CUDA IPC step" : "GPUDirect RDMA";
    what = e.what == 3 ? std::string("the stream waited for a ") + channel + " message from " + peer
                       : std::string("the stream waited for a free ") + channel + " send slot (" + peer +
                             " frees them)";
  } else {
    // The node kernels name a peer by its place among the node's ranks: its rank (one node).
    what = std::string("block ") + std::to_string(e.block) + " waited for rank " +
           std::to_string(e.peer) + (e.what == 0 ? " to free a slot" : " to push its chunk");
  }
  if (e.code == 1) {
    return {Code::kDeadlineExceeded, who() + ": a GPU collective did not finish: " + what +
                                         " for more than " + std::to_string(int64_t(ms)) +
                                         " ms (op timeout); that rank is slow, hung, or "
                                         "never called the same collective"};
  }
  std::string reason = ops_.abort_reason();
  return {Code::kAborted, who() + ": a GPU collective stopped: " + what + " when the job was aborted" +
                              (reason.empty() ? "" : ": " + reason)};
}

// A wait of this rank's kernels that timed out fails the job, once: the other ranks stop
// waiting for this one (and their links log what they still waited for). From the caller's
// next call, or at once from the watcher, whichever sees it first.
void DeviceComm::report_timeout(const Status& s) {
  if (timeout_reported_.exchange(true)) return;
  log::get("gpu")->error("{}; the job is aborted", s.message());
  if (ops_.abort_job) ops_.abort_job(s.message());
}

Status DeviceComm::async_error() {
  if (!failed_.ok()) return failed_;
  return fail_from_error_word();
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

Status DeviceComm::failed_to_queue(const CollectiveCall& c, uint64_t number, const Status& s) {
  __atomic_store_n(&impl_->words->abort, 1u, __ATOMIC_RELEASE);
  failed_ = {s.code(), who() + ": GPU " + describe_gpu(c, number) + " could not be queued completely: " + s.message()};
  if (ops_.abort_job) ops_.abort_job(failed_.message());
  return failed_;
}


Result<gpu::Timeline> DeviceComm::last_timeline() {
  Impl& m = *impl_;
  if (m.path != Impl::Path::kIpc) {
    return Status(Code::kFailedPrecondition,
                  who() + ": the GPU timeline is only recorded on the cuda-ipc path (this "
                          "communicator's is " + path() + ")");
  }
  if (m.timeline == nullptr) {
    return Status(Code::kFailedPrecondition,
                  who() + ": the GPU timeline is off (set GRADSYNC_GPU_TIMELINE=1 before the "
                          "communicator is created)");
  }
  if (!m.last.recorded) return Status(Code::kFailedPrecondition, who() + ": " + m.last.why_not);
  DeviceScope scope;
  if (Status e = scope.enter(cfg_.device); !e.ok()) return Status(e.code(), who() + ": " + e.message());
  GS_CUDA(cudaEventSynchronize(m.timeline_event), "cudaEventSynchronize (timeline)");
  if (Status s = async_error(); !s.ok()) {
    return Status(s.code(), "no GPU timeline: the last call failed: " + s.message());
  }

  gpu::Timeline t;
  t.rank = cfg_.rank;
  t.world = cfg_.world_size;
  t.collective = to_string(m.last.kind);
  t.bytes = m.last.bytes;
  t.chunk_bytes = kernels::node_chunk_bytes(m.layout, t.bytes);
  t.slots = m.layout.slots;
  t.nchunks = (t.bytes + t.chunk_bytes - 1) / t.chunk_bytes;
  t.blocks = m.layout.blocks;
  t.blocks_used = kernels::node_blocks_used(m.layout, t.bytes);
  const uint64_t stride = kernels::node_timeline_stride(gpu::kMaxChunksPerBlock);
  std::vector<uint64_t> words(size_t(t.blocks_used) * stride);
  GS_CUDA(cudaMemcpyAsync(words.data(), m.timeline, words.size() * sizeof(uint64_t),
                          cudaMemcpyDeviceToHost, m.timeline_stream),
          "cudaMemcpyAsync (timeline)");
  GS_CUDA(cudaStreamSynchronize(m.timeline_stream), "cudaStreamSynchronize (timeline)");
  for (uint32_t b = 0; b < t.blocks_used; ++b) {
    const uint64_t* r = words.data() + b * stride;
    gpu::BlockTimeline bt;
    bt.block = b;
    bt.start_ns = r[0];
    bt.end_ns = r[1];
    bt.chunks = uint32_t(r[2]);
    bt.first_seq = r[3];
    const uint32_t want = gpu::chunks_of_block(t.nchunks, t.blocks_used, b);
    if (bt.chunks != want) {
      return Status(Code::kInternal, who() + ": GPU timeline: block " + std::to_string(b) +
                                         " recorded " + std::to_string(bt.chunks) +
                                         " chunks, the call has " + std::to_string(want));
    }
    const uint32_t kept = std::min(bt.chunks, gpu::kMaxChunksPerBlock);
    for (uint32_t i = 0; i < kept; ++i) {
      const uint64_t* c = r + kernels::kTimelineHeader + size_t(i) * kernels::kTimelineSteps;
      bt.steps.push_back({c[kernels::kCreditWait], c[kernels::kPushStart], c[kernels::kPushEnd],
                          c[kernels::kReadyWait], c[kernels::kFoldStart], c[kernels::kFoldEnd]});
    }
    t.block.push_back(std::move(bt));
  }
  t.summary = gpu::summarize(t);
  return t;
}

}  // namespace gradsync
