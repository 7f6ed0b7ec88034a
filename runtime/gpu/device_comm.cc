#include "gpu/device_comm.h"

#include <cuda_runtime_api.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/log.h"
#include "kernels/cuda_node.cuh"
#include "kernels/cuda_reduce.cuh"
#if GRADSYNC_HAVE_GDR
#include "gpu/gdr_ring.h"
#include "topology/gpudirect.h"
#endif

namespace gradsync {
namespace {

using Clock = std::chrono::steady_clock;

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (end && *end == '\0' && x > 0) ? x : fallback;
}

// Words the kernels and the host share, in mapped pinned host memory.
struct HostWords {
  kernels::NodeError error;
  uint32_t abort;
  uint32_t pad;
  // host-staged, counted in pieces since set-up (monotonic):
  uint64_t landed;   // the stream copied this many pieces to the staging slots
  uint64_t reduced;  // the worker ran the host collective on this many pieces, in place
  uint64_t done;     // calls whose results the stream copied back
  // GPU clock per call (for the overlap figure), in a ring indexed by the call's sequence
  // number, so that a call's stamps survive while the stream runs the next ones.
  static constexpr size_t kStampRing = 64;
  struct Stamps {
    uint64_t start_ns, done_ns, waited_ns;  // the call's span on the stream and its waits
  } stamps[kStampRing];
};

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceScope {
 public:
  Status enter(int device) {
    (void)cudaGetDevice(&prev_);
    mine_ = device;
    if (prev_ != device) {
      if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
        return {Code::kInternal, std::string("cudaSetDevice: ") + cudaGetErrorString(e)};
      }
    }
    return Status::Ok();
  }
  ~DeviceScope() {
    if (prev_ >= 0 && prev_ != mine_) (void)cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
  int mine_ = -1;
};

// One row of the set-up exchange: summed (uint8) over ranks, every other row is zero.
struct IpcEntry {
  int32_t pid;
  int32_t device;
  int32_t ok;
  int32_t pad;
  uint64_t addr;
  cudaIpcMemHandle_t handle;
  char bus_id[32];
};

// Polls until `done()` or the deadline (every wait has one): spins for 50 us (a small
// piece's copy to pinned memory lands within that), polls with sched_yield until
// GRADSYNC_YIELD_US (default 1 ms) has passed, then sleeps 20 us between looks. A 20 us sleep
// lasts about 70 us with the kernel's default timer slack: with a sleep after 100 looks, as
// before, a small staged call took 94-99 us (8 B) on the H200 host; with this, 42-45 us
// (StagedRdmaBench.DISABLED_SmallCallsInOneProcess, docs/benchmarks.md).
template <class F>
bool poll_until(F done, Clock::time_point deadline) {
  static const auto yield = std::chrono::microseconds(std::max(0L, env_long("GRADSYNC_YIELD_US", 1000)));
  const auto spin_until = Clock::now() + std::chrono::microseconds(50), yield_until = spin_until + yield;
  for (;;) {
    if (done()) return true;
    const auto now = Clock::now();
    if (now > deadline) return false;
    if (now < spin_until) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else if (now < yield_until) {
      sched_yield();
    } else {
      ::usleep(20);
    }
  }
}

// From this many bytes, allreduce and broadcast among 3 or more ranks of a node go two-shot:
// measured with 8 ranks as threads on one H200, two-shot took 0.65x the one-shot path's speed
// at 256 KiB and 1.56x at 1 MiB (docs/benchmarks.md).
constexpr long kTwoShotMinBytes = 1 << 20;

// The host-staged path cuts a call into pieces: the stream copies one while the worker runs
// the host collective of another. A quarter of the call, from 4 to 8 MiB: smaller pieces
// were slower (below, when ring threads started at 4 MiB; 2 MiB pieces with threads from
// 1 MiB: no better at 8 MiB), and at most 8 MiB so that a large call still pipelines.
// Measured on the H200 host (2 nodes x 1 rank, 16 rings, 8 ring threads, GB/s at 8 / 32 /
// 128 / 512 MiB): pieces of 2 MiB 1.8/2.0/2.1/2.4, 4 MiB 3.1/3.6/5.1/5.2, 8 MiB
// 1.9/6.4/7.7/7.5, 16 MiB 1.8/5.9/6.7/6.6; a one-piece call is the slow case.
constexpr size_t kMinPiece = size_t(4) << 20;
constexpr size_t kMaxPiece = size_t(8) << 20;

size_t piece_for(size_t call_bytes) { return std::clamp(call_bytes / 4 / 64 * 64, kMinPiece, kMaxPiece); }

}  // namespace

struct DeviceComm::Impl {
  enum class Path { kSingle, kIpc, kStaged } path = Path::kSingle;
  std::string why = "one rank";  // why this path (path_why())
  kernels::NodeLayout layout;
  kernels::NodeArgs args;
  void* region = nullptr;
  std::vector<void*> opened;  // peers' regions opened through IPC
  uint64_t* progress = nullptr;
  HostWords* words = nullptr;      // host view
  HostWords* words_dev = nullptr;  // device view of the same memory

  // host-staged
  static constexpr size_t kStagingSlots = 4;
  uint8_t* staging = nullptr;  // kStagingSlots slots of pinned host memory
  // A piece's bytes (all ranks' rows of it: reduce_scatter, all_gather): GRADSYNC_STAGE_PIECE,
  // or 0: a quarter of the call, from kMinPiece to kMaxPiece (piece_for).
  size_t piece_bytes = 0;
  size_t slot_bytes = 4u << 20;  // one staging slot: >= piece_bytes and >= one element per rank
  size_t max_pitch = 0;          // cudaDevAttrMaxPitch: the largest pitch of a 2D copy
  uint64_t staged_seq = 0;
  uint64_t pieces_queued = 0;  // pieces of every staged call so far (the stream's count)
  std::mutex mu;             // staged_error and timing: the worker writes, the caller reads
  Status staged_error;
  StagedTiming timing;
  bool log_timing = false;

#if GRADSYNC_HAVE_GDR
  // GPUDirect RDMA (gpu/gdr_ring.h): calls of at least gdr_min_bytes per segment; smaller
  // ones stay host-staged.
  std::unique_ptr<GdrRing> gdr;
  size_t gdr_min_bytes = 0;
#endif

  // GRADSYNC_GPU_TIMELINE (gpu/timeline.h), cuda-ipc only.
  bool timeline_asked = false;
  uint64_t* timeline = nullptr;  // layout.blocks records (kernels/cuda_node.cuh), device memory
  cudaEvent_t timeline_event = nullptr;    // recorded after the last recorded launch
  cudaStream_t timeline_stream = nullptr;  // the copies back
  struct LastCall {
    bool recorded = false;
    std::string why_not = "no GPU collective was called yet";
    CollectiveKind kind = CollectiveKind::kAllreduce;
    uint64_t bytes = 0;  // of one segment
  } last;
};

DeviceComm::DeviceComm(DeviceCommConfig cfg, HostOps ops)
    : cfg_(std::move(cfg)), ops_(std::move(ops)), impl_(std::make_unique<Impl>()) {}

std::string DeviceComm::who() const {
  return "job=" + cfg_.job + " rank " + std::to_string(cfg_.rank) + " (host " + cfg_.host +
         ", GPU " + std::to_string(cfg_.device) + ")";
}

#define GS_CUDA(expr, what)                                                                  \
  do {                                                                                       \
    if (cudaError_t e_ = (expr); e_ != cudaSuccess) {                                        \
      return Status(Code::kInternal, who() + ": " + (what) + ": " + cudaGetErrorName(e_) +  \
                                         " (" + cudaGetErrorString(e_) + ")");              \
    }                                                                                        \
  } while (0)

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
    if (cudaError_t e = kernels::load_reduce_kernels(); e != cudaSuccess) {
      return Status(Code::kInternal, d->who() + ": loading the GPU kernels: " + cudaGetErrorString(e));
    }
    bool ipc = false;
    if (cfg.local_world_size == cfg.world_size && cfg.world_size <= kernels::kMaxNodeRanks &&
        std::getenv("GRADSYNC_GPU_STAGED") == nullptr) {
      GS_RETURN_IF_ERROR(d->setup_ipc(&ipc));
    }
    if (ipc) {
      m.path = Impl::Path::kIpc;
      m.why = "every rank on this node: kernels write peers' GPU memory through CUDA IPC; "
              "GPU memory " + std::to_string((m.layout.region_bytes() + (1 << 20) - 1) >> 20) +
              " MiB (" + std::to_string(m.layout.blocks) + " blocks x " +
              std::to_string(m.layout.nranks) + " sources x " + std::to_string(m.layout.slots) +
              " slots of " + std::to_string(m.layout.chunk_bytes >> 10) +
              " KiB, low-latency lines to " + std::to_string(m.layout.ll_max_bytes >> 10) +
              " KiB; GRADSYNC_GPU_MEMORY_MAX); two-shot from " +
              (m.layout.nranks >= 3 && m.layout.two_shot_min_bytes
                   ? std::to_string(m.layout.two_shot_min_bytes) + " bytes"
                   : std::string("never (") + (m.layout.nranks < 3 ? "2 ranks" : "off") + ")");
      if (m.timeline_asked) GS_RETURN_IF_ERROR(d->setup_timeline());
    } else {
      GS_RETURN_IF_ERROR(d->setup_staged());
      m.path = Impl::Path::kStaged;
      m.why = cfg.local_world_size != cfg.world_size ? "ranks on several nodes"
              : std::getenv("GRADSYNC_GPU_STAGED") != nullptr ? "GRADSYNC_GPU_STAGED is set"
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
    while (!p->stop_.load(std::memory_order_acquire)) {
      if (!p->ops_.abort_reason().empty()) {
        __atomic_store_n(&p->impl_->words->abort, 1u, __ATOMIC_RELEASE);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  return d;
}

Status DeviceComm::setup_ipc(bool* usable) {
  Impl& m = *impl_;
  *usable = false;
  const int n = cfg_.world_size;
  cudaDeviceProp prop{};
  GS_CUDA(cudaGetDeviceProperties(&prop, cfg_.device), "cudaGetDeviceProperties");
  // Every rank's kernel must be resident at once (the blocks wait on each other): ranks that
  // share a GPU share its SMs.
  int shares = 1;
  {
    std::vector<int32_t> dev(n, 0);
    dev[cfg_.rank] = cfg_.device + 1;
    GS_RETURN_IF_ERROR(ops_.allreduce_now(dev.data(), dev.data(), n, DataType::kInt32, ReduceOp::kSum));
    shares = int(std::count(dev.begin(), dev.end(), cfg_.device + 1));
  }
  // Defaults measured on 2 H200s over NVLink (docs/benchmarks.md): 128 blocks of 256 KiB
  // chunks reach NCCL's bus bandwidth; the chunk shrinks with more ranks so that the region
  // stays 256 MiB. The low-latency protocol below GRADSYNC_GPU_LL_MAX bytes.
  int32_t blocks = int32_t(env_long("GRADSYNC_GPU_BLOCKS", 128));
  blocks = std::clamp(blocks, 1, std::max(1, prop.multiProcessorCount / shares));
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&blocks, &blocks, 1, DataType::kInt32, ReduceOp::kMin));
  m.layout.nranks = n;
  m.layout.blocks = uint32_t(blocks);
  m.layout.slots = uint32_t(std::max(2L, env_long("GRADSYNC_GPU_SLOTS", 4)));
  const long chunk = std::max(4096L, (512L << 10) / std::max(2, n));
  m.layout.chunk_bytes = uint64_t(env_long("GRADSYNC_GPU_CHUNK", chunk)) / 256 * 256;
  const char* ll = std::getenv("GRADSYNC_GPU_LL_MAX");
  m.layout.ll_max_bytes = ll && *ll ? uint64_t(std::strtoull(ll, nullptr, 10)) : uint64_t(1 << 20);
  // From 3 ranks, allreduce and broadcast from this size go two-shot (kernels/
  // cuda_node_two_shot.cuh): 2 (n-1)/n of the buffer sent per rank instead of n - 1 buffers.
  // GRADSYNC_GPU_TWOSHOT_MIN=0: never.
  const char* two_shot = std::getenv("GRADSYNC_GPU_TWOSHOT_MIN");
  m.layout.two_shot_min_bytes = two_shot != nullptr && std::strcmp(two_shot, "0") == 0
                                    ? 0
                                    : uint64_t(env_long("GRADSYNC_GPU_TWOSHOT_MIN", kTwoShotMinBytes));
  // The region is this path's GPU memory: at most GRADSYNC_GPU_MEMORY_MAX MiB (default 320,
  // above the defaults at every rank count: 264 MiB at 2 ranks, 288 at 8); a smaller budget
  // shrinks the chunk, then the low-latency lines.
  const uint64_t budget = uint64_t(std::max(1L, env_long("GRADSYNC_GPU_MEMORY_MAX", 320))) << 20;
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
  if (m.layout.region_bytes() > budget) {
    return {Code::kInvalidArgument,
            who() + ": the CUDA IPC region needs " + std::to_string(m.layout.region_bytes() >> 20) +
                " MiB with " + std::to_string(blocks) + " blocks and " + std::to_string(n) +
                " ranks, over GRADSYNC_GPU_MEMORY_MAX = " + std::to_string(budget >> 20) +
                " MiB: raise it, or lower GRADSYNC_GPU_BLOCKS"};
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
  GS_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  std::vector<IpcEntry> table(n);
  std::memset(table.data(), 0, n * sizeof(IpcEntry));
  IpcEntry& mine = table[cfg_.rank];
  mine.pid = int32_t(::getpid());
  mine.device = cfg_.device;
  mine.addr = reinterpret_cast<uint64_t>(m.region);
  GS_CUDA(cudaIpcGetMemHandle(&mine.handle, m.region), "cudaIpcGetMemHandle");
  (void)cudaDeviceGetPCIBusId(mine.bus_id, sizeof(mine.bus_id) - 1, cfg_.device);
  GS_RETURN_IF_ERROR(ops_.allreduce_now(table.data(), table.data(), n * sizeof(IpcEntry),
                                        DataType::kUInt8, ReduceOp::kSum));

  std::string why;
  m.args.me = cfg_.rank;
  for (int p = 0; p < n; ++p) {
    if (p == cfg_.rank) {
      m.args.region[p] = static_cast<uint8_t*>(m.region);
      continue;
    }
    const IpcEntry& e = table[p];
    if (e.pid == mine.pid) {
      // A rank of this process (ranks as threads): its pointer is valid here; another GPU
      // needs peer access.
      if (e.device != cfg_.device) {
        cudaError_t r = cudaDeviceEnablePeerAccess(e.device, 0);
        if (r != cudaSuccess && r != cudaErrorPeerAccessAlreadyEnabled) {
          why = "peer access to GPU " + std::to_string(e.device) + ": " + cudaGetErrorString(r);
          (void)cudaGetLastError();
          break;
        }
        (void)cudaGetLastError();
      }
      m.args.region[p] = reinterpret_cast<uint8_t*>(e.addr);
      continue;
    }
    void* ptr = nullptr;
    cudaError_t r = cudaIpcOpenMemHandle(&ptr, e.handle, cudaIpcMemLazyEnablePeerAccess);
    if (r != cudaSuccess) {
      why = "cudaIpcOpenMemHandle of rank " + std::to_string(p) + " (GPU " + e.bus_id + "): " +
            cudaGetErrorString(r);
      (void)cudaGetLastError();
      break;
    }
    m.opened.push_back(ptr);
    m.args.region[p] = static_cast<uint8_t*>(ptr);
  }
  int32_t ok = why.empty() ? 1 : 0;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&ok, &ok, 1, DataType::kInt32, ReduceOp::kMin));
  if (ok == 0) {
    auto log = log::get("gpu");
    if (!why.empty()) log->warn("{}: no CUDA IPC path: {}; using host staging", who(), why);
    else log->warn("{}: a peer could not open CUDA IPC; using host staging", who());
    for (void* p : m.opened) (void)cudaIpcCloseMemHandle(p);
    m.opened.clear();
    (void)cudaFree(m.region);
    (void)cudaFree(m.progress);
    m.region = nullptr;
    m.progress = nullptr;
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

Status DeviceComm::setup_staged() {
  Impl& m = *impl_;
  const long fixed = env_long("GRADSYNC_STAGE_PIECE", 0);
  m.piece_bytes = fixed > 0 ? std::max<size_t>(4096, size_t(fixed) / 64 * 64) : 0;
  // A reduce_scatter or all_gather piece holds at least one element (8 bytes at most) of every
  // rank's segment.
  m.slot_bytes =
      std::max(m.piece_bytes ? m.piece_bytes : kMaxPiece, (size_t(cfg_.world_size) * 8 + 63) / 64 * 64);
  int pitch = 0;
  GS_CUDA(cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, cfg_.device),
          "cudaDeviceGetAttribute");
  m.max_pitch = size_t(std::max(pitch, 0));
  void* p = nullptr;
  GS_CUDA(cudaHostAlloc(&p, Impl::kStagingSlots * m.slot_bytes, cudaHostAllocDefault),
          "cudaHostAlloc of the staging slots");
  m.staging = static_cast<uint8_t*>(p);
  return Status::Ok();
}

// GPUDirect RDMA between the nodes, where every rank's daemon has an RDMA device and every
// rank can register GPU memory with it (gpu/gdr_ring.h); else the host-staged path alone.
// Collective: every rank of a multi-node communicator calls it.
Status DeviceComm::setup_gdr() {
  Impl& m = *impl_;
#if GRADSYNC_HAVE_GDR
  auto log = log::get("gpu");
  // GRADSYNC_GDR_MIN_BYTES checked now (a typo fails the join); measured below when unset.
  const char* min_env = std::getenv("GRADSYNC_GDR_MIN_BYTES");
  const bool measure = min_env == nullptr || *min_env == '\0';
  auto min_bytes = topology::gdr_min_bytes_from_env(0);
  if (!min_bytes.ok()) return Status(min_bytes.status().code(), who() + ": " + min_bytes.status().message());
  m.gdr_min_bytes = *min_bytes;
  // On unless GRADSYNC_GDR=0 (or GRADSYNC_GPU_STAGED) says otherwise.
  const char* on = std::getenv("GRADSYNC_GDR");
  const bool asked = on == nullptr || std::strcmp(on, "0") != 0;
  const bool staged = std::getenv("GRADSYNC_GPU_STAGED") != nullptr;
  const std::string off = !asked ? "GRADSYNC_GDR=0 is set" : staged ? "GRADSYNC_GPU_STAGED is set" : "";
  // Still collective when this rank does not want it: the others may. It takes part and
  // fails locally, and then every rank keeps the host-staged path.
  GdrConfig g;
  g.device = cfg_.device;
  GdrLinkConfig& l = g.link;
  l.who = who();
  l.rank = cfg_.rank;
  l.world_size = cfg_.world_size;
  l.hosts = cfg_.hosts;
  l.verbs_device = asked && !staged ? cfg_.verbs_device : std::string();
  l.verbs_port = cfg_.verbs_port;
  l.gid_index = cfg_.gid_index;
  l.verbs_api = cfg_.verbs_api;
  l.slot_bytes = size_t(env_long("GRADSYNC_GDR_SLOT_BYTES", 1 << 20)) / 256 * 256;
  l.slots = uint32_t(std::max(2L, env_long("GRADSYNC_GDR_SLOTS", 4)));
  l.op_timeout = cfg_.op_timeout;
  g.abort_dev = &m.words_dev->abort;
  g.error_dev = &m.words_dev->error;
  g.abort_host = &m.words->abort;
  if (l.slot_bytes == 0) return {Code::kInvalidArgument, who() + ": GRADSYNC_GDR_SLOT_BYTES below 256"};
  std::string why;
  auto ring = GdrRing::create(g, ops_, &why);
  if (!ring.ok()) return Status(ring.status().code(), who() + ": " + ring.status().message());
  m.gdr = std::move(ring).value();
  if (m.gdr) {
    if (measure) GS_RETURN_IF_ERROR(measure_gdr_min_bytes());
    m.why = m.gdr->describe() + "; calls of " + std::to_string(m.gdr_min_bytes) +
            " bytes and more per segment take it, smaller ones host-staged (GRADSYNC_GDR_MIN_BYTES)";
    log->info("{}: {}", who(), m.why);
  } else {
    const std::string& no = off.empty() ? why : off;
    m.why += "; no GPUDirect RDMA: " + no;
    log->info("{}: no GPUDirect RDMA: {}; GPU collectives are host-staged", who(), no);
  }
#else
  (void)m;  // built without the verbs headers: host-staged only
#endif
  return Status::Ok();
}

#if GRADSYNC_HAVE_GDR
// The small-message threshold (design §3 rule 4), measured once at set-up on every rank in
// the same order: per size, the best of three float32 sum allreduces on the GPUDirect ring
// against the host-staged path's work for a one-piece call (copy to pinned memory, the host
// allreduce, copy back). Every rank takes the slowest rank's times, so all pick one threshold
// (topology::gdr_min_bytes_from_times).
Status DeviceComm::measure_gdr_min_bytes() {
  Impl& m = *impl_;
  std::vector<size_t> sizes;
  for (size_t b = 16 << 10; b <= (size_t(1) << 20) && b <= m.slot_bytes; b *= 4) sizes.push_back(b);
  if (sizes.empty()) return Status::Ok();
  const size_t n = sizes.size(), biggest = sizes.back();
  void* dev = nullptr;
  cudaStream_t st = nullptr;
  GS_CUDA(cudaMalloc(&dev, biggest), "cudaMalloc (GPUDirect threshold)");
  Status s = Status::Ok();
  auto fail = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess && s.ok()) s = {Code::kInternal, who() + ": " + what + ": " + cudaGetErrorString(e)};
  };
  fail(cudaMemset(dev, 0, biggest), "cudaMemset");
  fail(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<double> us(2 * n, 1e30);  // GPUDirect, then host-staged
  for (size_t i = 0; i < n && s.ok(); ++i) {
    const size_t bytes = sizes[i], count = bytes / 4;
    const CollectiveCall c{CollectiveKind::kAllreduce, dev, dev, count, DataType::kFloat32, ReduceOp::kSum, 0,
                           Algorithm::kRing, 0};
    for (int rep = 0; rep < 3 && s.ok(); ++rep) {
      auto t0 = Clock::now();
      s = m.gdr->enqueue(c, st);
      fail(cudaStreamSynchronize(st), "cudaStreamSynchronize");
      us[i] = std::min(us[i], std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (s.ok()) s = async_error();
      if (!s.ok()) break;
      t0 = Clock::now();
      fail(cudaMemcpyAsync(m.staging, dev, bytes, cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync");
      fail(cudaStreamSynchronize(st), "cudaStreamSynchronize");
      if (s.ok()) s = ops_.allreduce_now(m.staging, m.staging, count, DataType::kFloat32, ReduceOp::kSum);
      fail(cudaMemcpyAsync(dev, m.staging, bytes, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync");
      fail(cudaStreamSynchronize(st), "cudaStreamSynchronize");
      us[n + i] = std::min(us[n + i], std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  if (st) (void)cudaStreamDestroy(st);
  (void)cudaFree(dev);
  if (!s.ok()) return Status(s.code(), who() + ": measuring GRADSYNC_GDR_MIN_BYTES: " + s.message());
  GS_RETURN_IF_ERROR(ops_.allreduce_now(us.data(), us.data(), us.size(), DataType::kFloat64, ReduceOp::kMax));
  m.gdr_min_bytes = topology::gdr_min_bytes_from_times(sizes, std::vector<double>(us.begin(), us.begin() + n),
                                                       std::vector<double>(us.begin() + n, us.end()));
  std::string table;
  for (size_t i = 0; i < n; ++i) {
    table += (i ? ", " : "") + std::to_string(sizes[i] >> 10) + " KiB " + std::to_string(int(us[i])) + "/" +
             std::to_string(int(us[n + i])) + " us";
  }
  log::get("gpu")->info("{}: GRADSYNC_GDR_MIN_BYTES measured: {} bytes (GPUDirect/host-staged, slowest rank: {})",
                        who(), m.gdr_min_bytes, table);
  return Status::Ok();
}
#endif

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
  for (void* p : m.opened) (void)cudaIpcCloseMemHandle(p);
  if (m.region) (void)cudaFree(m.region);
  if (m.progress) (void)cudaFree(m.progress);
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
  GS_CUDA(cudaEventCreateWithFlags(&m.timeline_event, cudaEventDisableTiming), "cudaEventCreate");
  GS_CUDA(cudaStreamCreateWithFlags(&m.timeline_stream, cudaStreamNonBlocking), "cudaStreamCreate");
  GS_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  log::get("gpu")->info("{}: GPU timeline on (GRADSYNC_GPU_TIMELINE): {} blocks x {} chunks, {} KiB",
                        who(), m.layout.blocks, gpu::kMaxChunksPerBlock, words * 8 / 1024);
  return Status::Ok();
}

const std::string& DeviceComm::path_why() const { return impl_->why; }

Result<uint64_t> DeviceComm::bytes_sent() {
  Impl& m = *impl_;
  if (m.path != Impl::Path::kIpc) return uint64_t{0};
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
  return v;
}

const char* DeviceComm::path() const {
  switch (impl_->path) {
    case Impl::Path::kSingle: return "single-rank";
    case Impl::Path::kIpc: return "cuda-ipc";
    case Impl::Path::kStaged:
#if GRADSYNC_HAVE_GDR
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
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  const volatile kernels::NodeError& w = m.words->error;
  const kernels::NodeError e{w.code, w.peer, w.block, w.what};
  if (e.code == 0) return Status::Ok();
  const double ms = double(cfg_.op_timeout.count());
  std::string what;
  if (e.what == 2) {
    what = "the stream waited for host-staged results";
  } else if (e.what == 3 || e.what == 4) {
    const std::string peer = "rank " + std::to_string(e.peer) +
                             (size_t(e.peer) < cfg_.hosts.size() ? " (host " + cfg_.hosts[e.peer] + ")" : "");
    what = e.what == 3 ? "the stream waited for a GPUDirect RDMA message from " + peer
                       : "the stream waited for a free GPUDirect RDMA send slot (" + peer +
                             " frees them)";
  } else {
    what = std::string("block ") + std::to_string(e.block) + " waited for rank " +
           std::to_string(e.peer) + (e.what == 0 ? " to free a slot" : " to push its chunk");
  }
  if (e.code == 1) {
    failed_ = {Code::kDeadlineExceeded, who() + ": a GPU collective did not finish: " + what +
                                            " for more than " + std::to_string(int64_t(ms)) +
                                            " ms (op timeout); that rank is slow, hung, or "
                                            "never called the same collective"};
  } else {
    std::string reason = ops_.abort_reason();
    failed_ = {Code::kAborted, who() + ": a GPU collective stopped: " + what +
                                   " when the job was aborted" +
                                   (reason.empty() ? "" : ": " + reason)};
  }
  return failed_;
}

Status DeviceComm::async_error() {
  if (!failed_.ok()) return failed_;
  return fail_from_error_word();
}

namespace {

// "reduce_scatter #3 (count=10 type=float32 op=sum)", for messages.
std::string describe_gpu(const CollectiveCall& c, uint64_t number) {
  std::string s = std::string(to_string(c.kind)) + " #" + std::to_string(number) +
                  " (count=" + std::to_string(c.count) + " type=" + to_string(c.type);
  if (c.kind == CollectiveKind::kAllreduce || c.kind == CollectiveKind::kReduceScatter) {
    s += std::string(" op=") + to_string(c.op);
  }
  if (c.kind == CollectiveKind::kBroadcast) s += " root=" + std::to_string(c.root);
  return s + ")";
}

kernels::NodeCollective node_kind(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kReduceScatter:
      return kernels::NodeCollective::kReduceScatter;
    case CollectiveKind::kAllGather:
      return kernels::NodeCollective::kAllGather;
    case CollectiveKind::kBroadcast:
      return kernels::NodeCollective::kBroadcast;
    default:
      return kernels::NodeCollective::kAllreduce;
  }
}

// Buffers made of world_size segments: reduce_scatter's send, all_gather's recv.
bool strided(CollectiveKind k) {
  return k == CollectiveKind::kReduceScatter || k == CollectiveKind::kAllGather;
}

}  // namespace

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
  c.algorithm = Algorithm::kAuto;  // one GPU path per communicator: the option has no say
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
      const kernels::NodeCall nc{node_kind(c.kind), c.type, c.op, c.root, c.send, c.recv, c.count};
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
#if GRADSYNC_HAVE_GDR
  if (m.gdr && c.count * element_size(c.type) >= m.gdr_min_bytes) {
    if (Status s = m.gdr->enqueue(c, stream); !s.ok()) {
      // Part of the call may be on the stream: its waits end through the abort word, and
      // the communicator is failed from here on.
      __atomic_store_n(&m.words->abort, 1u, __ATOMIC_RELEASE);
      failed_ = {s.code(), who() + ": GPU " + describe_gpu(c, number) +
                               " could not be queued completely: " + s.message()};
      if (ops_.abort_job) ops_.abort_job(failed_.message());  // the peers wait for its messages
      return failed_;
    }
    return Status::Ok();
  }
#endif
  return run_staged(c, stream, number);
}

// Host-staged. Everything the GPU does is queued now, on the caller's stream; the worker
// makes no CUDA call (one could wait behind a synchronous copy the caller makes while the
// stream waits for the worker). Pieces cycle through kStagingSlots pinned slots:
//   D2H p0, signal(landed) ... D2H p(K-1), signal(landed),
//   for each piece i: wait(reduced >= i), H2D p_i, D2H p_(i+K), signal(landed),
//   signal(done).
// The worker waits for `landed`, runs the host collective on the slot, publishes `reduced`.
// Stream order makes slot reuse safe: D2H of piece i + K is queued after H2D of piece i (and
// after the wait for the worker's piece i, where a rank copies nothing back).
// Piece i covers element offsets [i * per, i * per + len(i)) of the segment; reduce_scatter
// and all_gather stage that range of every rank's segment, as `rows` rows of len(i) elements.
Status DeviceComm::run_staged(const CollectiveCall& c, cudaStream_t stream, uint64_t number) {
  Impl& m = *impl_;
  const int n = cfg_.world_size, me = cfg_.rank;
  const size_t es = element_size(c.type);
  const int rows = strided(c.kind) ? n : 1;
  const size_t piece = m.piece_bytes ? m.piece_bytes : piece_for(c.count * es * size_t(rows));
  const size_t per = std::max<size_t>(1, piece / (es * size_t(rows)));
  const size_t pieces = (c.count + per - 1) / per;
  const size_t K = Impl::kStagingSlots;
  const uint64_t seq = ++m.staged_seq;
  const uint64_t base = m.pieces_queued;
  m.pieces_queued += pieces;
  const uint64_t timeout_ns = uint64_t(cfg_.op_timeout.count()) * 1'000'000ull;
  const bool root = c.kind == CollectiveKind::kBroadcast && c.root == me;
  const bool leaf = c.kind == CollectiveKind::kBroadcast && c.root != me;
  const auto* send = static_cast<const uint8_t*>(c.send);
  auto* recv = static_cast<uint8_t*>(c.recv);
  const size_t seg_pitch = c.count * es;  // from one segment to the next in a strided buffer
  HostWords* w = m.words_dev;
  auto width = [&](size_t i) { return std::min(per, c.count - i * per) * es; };
  auto slot_mem = [&](size_t i) { return m.staging + (i % K) * m.slot_bytes; };
  // rows x `bytes`: one 2D copy where the pitches allow it, else a copy per row.
  auto copy_rows = [&](uint8_t* dst, size_t dpitch, const uint8_t* src, size_t spitch, size_t bytes,
                       cudaMemcpyKind kind) -> Status {
    if (dpitch <= m.max_pitch && spitch <= m.max_pitch) {
      GS_CUDA(cudaMemcpy2DAsync(dst, dpitch, src, spitch, bytes, size_t(rows), kind, stream),
              "cudaMemcpy2DAsync");
      return Status::Ok();
    }
    for (int r = 0; r < rows; ++r) {
      GS_CUDA(cudaMemcpyAsync(dst + r * dpitch, src + r * spitch, bytes, kind, stream),
              "cudaMemcpyAsync");
    }
    return Status::Ok();
  };
  auto d2h = [&](size_t i) -> Status {
    const size_t off = i * per * es, len = width(i);
    uint8_t* slot = slot_mem(i);
    if (c.kind == CollectiveKind::kReduceScatter) {
      GS_RETURN_IF_ERROR(copy_rows(slot, len, send + off, seg_pitch, len, cudaMemcpyDeviceToHost));
    } else if (!leaf) {  // a broadcast's non-root sends nothing
      uint8_t* at = c.kind == CollectiveKind::kAllGather ? slot + size_t(me) * len : slot;
      GS_CUDA(cudaMemcpyAsync(at, send + off, len, cudaMemcpyDeviceToHost, stream),
              "cudaMemcpyAsync device-to-host");
    }
    GS_CUDA(kernels::launch_signal_host(&w->landed, base + i + 1, nullptr, stream), "signal kernel");
    return Status::Ok();
  };
  auto h2d = [&](size_t i) -> Status {
    const size_t off = i * per * es, len = width(i);
    const uint8_t* slot = slot_mem(i);
    if (c.kind == CollectiveKind::kAllGather) {
      return copy_rows(recv + off, seg_pitch, slot, len, len, cudaMemcpyHostToDevice);
    }
    if (root) return Status::Ok();  // the root's buffer is the data
    const uint8_t* from = c.kind == CollectiveKind::kReduceScatter ? slot + size_t(me) * len : slot;
    GS_CUDA(cudaMemcpyAsync(recv + off, from, len, cudaMemcpyHostToDevice, stream),
            "cudaMemcpyAsync host-to-device");
    return Status::Ok();
  };
  // The ring entry of this call: the worker read the one of seq - kStampRing long ago.
  HostWords::Stamps* stamp_dev = &w->stamps[seq % HostWords::kStampRing];
  m.words->stamps[seq % HostWords::kStampRing].waited_ns = 0;
  GS_CUDA(kernels::launch_signal_host(nullptr, 0, &stamp_dev->start_ns, stream), "signal kernel");
  for (size_t i = 0; i < std::min(K, pieces); ++i) GS_RETURN_IF_ERROR(d2h(i));
  for (size_t i = 0; i < pieces; ++i) {
    GS_CUDA(kernels::launch_wait_host(&w->reduced, base + i + 1, &w->abort, &w->error, timeout_ns,
                                      &stamp_dev->waited_ns, stream), "wait kernel");
    GS_RETURN_IF_ERROR(h2d(i));
    if (i + K < pieces) GS_RETURN_IF_ERROR(d2h(i + K));
  }
  GS_CUDA(kernels::launch_signal_host(&w->done, seq, &stamp_dev->done_ns, stream), "signal kernel");

  ops_.enqueue([this, c, number, seq, base, pieces, per, rows, es, me]() -> Status {
    Impl& m = *impl_;
    const auto deadline = Clock::now() + cfg_.op_timeout;
    auto word = [](const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); };
    const size_t K = Impl::kStagingSlots;
    const std::string what =
        std::string("staged ") + to_string(c.kind) + " #" + std::to_string(number);
    double network_us = 0;
    const auto t0 = Clock::now();
    Status s = Status::Ok();
    for (size_t i = 0; i < pieces && s.ok(); ++i) {
      auto landed = [&] { return word(&m.words->landed) >= base + i + 1 || !ops_.abort_reason().empty(); };
      if (!poll_until(landed, deadline)) {
        s = {Code::kDeadlineExceeded,
             who() + ": " + what + ": the stream did not copy piece " + std::to_string(i) +
                 " to host memory within the op timeout "
                 "(work queued before it on the stream is not finishing?)"};
        break;
      }
      if (std::string r = ops_.abort_reason(); !r.empty()) {
        s = {Code::kAborted, r};
        break;
      }
      // The host collective of the same kind on the slot, in place (the host API's in-place
      // layouts: reduce_scatter's recv is row `rank` of send, all_gather's send row `rank`).
      uint8_t* mem = m.staging + (i % K) * m.slot_bytes;
      CollectiveCall h = c;
      h.count = std::min(per, c.count - i * per);
      h.send = mem;
      h.recv = mem;
      if (c.kind == CollectiveKind::kReduceScatter) h.recv = mem + size_t(me) * h.count * es;
      if (c.kind == CollectiveKind::kAllGather) h.send = mem + size_t(me) * h.count * es;
      const auto n0 = Clock::now();
      s = ops_.run_on_worker(h);
      network_us += std::chrono::duration<double, std::micro>(Clock::now() - n0).count();
      if (s.ok()) __atomic_store_n(&m.words->reduced, base + i + 1, __ATOMIC_RELEASE);
    }
    if (!s.ok()) {
      {
        std::lock_guard lock(m.mu);
        if (m.staged_error.ok()) m.staged_error = s;
      }
      // Let the stream run on (its data is garbage now; every later call reports the error).
      __atomic_store_n(&m.words->reduced, ~uint64_t(0) >> 1, __ATOMIC_RELEASE);
      return s;
    }
    StagedTiming t;
    t.pieces = int(pieces);
    t.network_us = network_us;
    t.wall_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (m.log_timing) {
      // For the overlap figure only: wait (briefly) for the stream to finish this call, then
      // read its GPU-clock span and the time its wait kernels waited for the worker, from the
      // call's own ring entry (the stream may already be running later calls).
      const HostWords::Stamps* st = &m.words->stamps[seq % HostWords::kStampRing];
      if (poll_until([&] { return word(&m.words->done) >= seq; }, Clock::now() + std::chrono::seconds(5)) &&
          word(&st->done_ns) > word(&st->start_ns)) {
        const double span_us = double(word(&st->done_ns) - word(&st->start_ns)) / 1e3;
        const double waited_us = double(word(&st->waited_ns)) / 1e3;
        t.wall_us = span_us;
        t.copy_us = span_us - waited_us;  // the stream's busy time: copies (and its tiny kernels)
      }
    }
    {
      std::lock_guard lock(m.mu);
      m.timing = t;
    }
    if (m.log_timing && cfg_.rank == 0) {
      // The stream copies (busy time c) while the network reduces (n): of c, what did not
      // lengthen the call (span - n) was hidden.
      const double cp = t.copy_us,
                   hidden =
                       cp > 0 ? std::clamp(1.0 - (t.wall_us - t.network_us) / cp, 0.0, 1.0) : 0;
      log::get("gpu")->info(
          "{} {} bytes, {} pieces: span {:.0f} us, host {} {:.0f} us, stream "
          "copying {:.0f} us, copy time hidden {:.0f}%",
          what, c.count * es * size_t(rows), t.pieces, t.wall_us, to_string(c.kind), t.network_us,
          cp, 100 * hidden);
    }
    return s;
  });
  return Status::Ok();
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
