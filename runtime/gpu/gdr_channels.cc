#include "gpu/gdr_channels.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>

#include "common/log.h"
#include "gpu/gdr_link.h"
#include "gpu/step_runner.h"
#include "gpu/gpu_memory_registration.h"
#include "gpu/ipc_memory.h"
#include "gpu/kernel_stream.h"
#include "gpu/step_table_cache.h"
#include "kernels/cuda_reduce.cuh"
#include "kernels/cuda_step.cuh"
#include "topology/gpudirect.h"
#include "transport/verbs/emulated_fabric.h"

namespace gradsync {
namespace {

Status cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return Status::Ok();
  return {Code::kInternal, what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")"};
}

// The slots in GPU memory and their registration; the registration goes first (its own
// destructor deregisters the MR, then closes the dma-buf fd).
struct GpuSlots {
  int device = 0;
  void* ptr = nullptr;
  std::optional<GpuRegistration> reg;
  ~GpuSlots() {
    reg.reset();
    if (ptr) {
      (void)cudaSetDevice(device);
      (void)cudaFree(ptr);
    }
  }
};

// The slots in pinned host memory, registered with the NIC as ordinary host memory: the
// host-staged RDMA path of design §3 for a rank whose GPU memory the NIC cannot reach. The
// kernels read and write them through the same address (unified addressing).
struct HostSlots {
  void* ptr = nullptr;
  std::optional<verbs::MemoryRegion> mr;
  ~HostSlots() {
    mr.reset();
    if (ptr) (void)cudaFreeHost(ptr);
  }
};

Result<GdrRegion> gpu_region(int device, const verbs::ProtectionDomain& pd, size_t bytes) {
  auto slots = std::make_shared<GpuSlots>();
  slots->device = device;
  GS_RETURN_IF_ERROR(cuda(cudaSetDevice(device), "cudaSetDevice"));
  GS_RETURN_IF_ERROR(cuda(cudaMalloc(&slots->ptr, bytes),
                          "cudaMalloc of the GPUDirect slots (" + std::to_string(bytes) + " bytes)"));
  GS_RETURN_IF_ERROR(cuda(cudaMemset(slots->ptr, 0, bytes), "cudaMemset"));
  GS_RETURN_IF_ERROR(cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  auto r = register_gpu_memory(pd, slots->ptr, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!r.ok()) return r.status();
  slots->reg.emplace(std::move(r).value());
  GdrRegion region;
  region.base = static_cast<uint8_t*>(slots->ptr);
  region.mr = &slots->reg->mr();
  region.method = slots->reg->method();
  region.owner = slots;
  return region;
}

// Pinned, mapped host memory (the slots of TCP peers, which the worker's sockets read and
// write, and the kernels through the same address).
Result<GdrRegion> pinned_region(size_t bytes) {
  auto slots = std::make_shared<HostSlots>();
  GS_RETURN_IF_ERROR(cuda(cudaHostAlloc(&slots->ptr, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                          "cudaHostAlloc of the step slots (" + std::to_string(bytes) + " bytes)"));
  std::memset(slots->ptr, 0, bytes);
  void* dev = nullptr;
  GS_RETURN_IF_ERROR(cuda(cudaHostGetDevicePointer(&dev, slots->ptr, 0), "cudaHostGetDevicePointer"));
  if (dev != slots->ptr) {
    return Status(Code::kUnimplemented, "pinned host slots need unified addressing (the GPU sees them elsewhere)");
  }
  GdrRegion region;
  region.base = static_cast<uint8_t*>(slots->ptr);
  region.method = "pinned host memory";
  region.owner = slots;
  return region;
}

// The same, registered with the NIC (the RDMA slots of a rank whose GPU memory it cannot reach).
Result<GdrRegion> host_region(const verbs::ProtectionDomain& pd, size_t bytes) {
  auto region = pinned_region(bytes);
  if (!region.ok()) return region;
  auto* slots = static_cast<HostSlots*>(region->owner.get());
  auto mr = verbs::MemoryRegion::create(pd, slots->ptr, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!mr.ok()) return mr.status();
  slots->mr.emplace(std::move(mr).value());
  region->mr = &*slots->mr;
  return region;
}

// The direct region (gpu/gdr_link.h) in GPU memory; its handle is gpu/ipc_memory.h's.
static_assert(sizeof(IpcHandle) <= kGdrHandleBytes, "the direct region's handle does not fit");

Result<GdrDirectRegion> direct_region(int device, size_t bytes) {
  GS_RETURN_IF_ERROR(cuda(cudaSetDevice(device), "cudaSetDevice"));
  void* p = nullptr;
  GS_RETURN_IF_ERROR(cuda(cudaMalloc(&p, bytes), "cudaMalloc of the CUDA IPC slots (" + std::to_string(bytes) + " bytes)"));
  GdrDirectRegion d;
  d.owner = std::shared_ptr<void>(p, [device](void* q) {
    (void)cudaSetDevice(device);
    (void)cudaFree(q);
  });
  GS_RETURN_IF_ERROR(cuda(cudaMemset(p, 0, bytes), "cudaMemset"));
  GS_RETURN_IF_ERROR(cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  auto h = ipc_export(p, device);
  if (!h.ok()) return h.status();
  d.base = static_cast<uint8_t*>(p);
  std::memcpy(d.handle, &*h, sizeof(IpcHandle));
  return d;
}

Result<GdrDirectRegion> open_direct_region(int device, const uint8_t* handle) {
  IpcHandle h{};
  std::memcpy(&h, handle, sizeof(h));
  bool opened = false;
  auto p = ipc_open(h, device, &opened);
  if (!p.ok()) return p.status();
  GdrDirectRegion d;
  d.base = static_cast<uint8_t*>(*p);
  if (opened) d.owner = std::shared_ptr<void>(*p, [device](void* q) { ipc_close(q, device); });
  return d;
}

}  // namespace

struct GdrChannels::Impl {
  GdrConfig cfg;
  RdmaChannels channels;
  std::unique_ptr<GdrLink> link;
  std::unique_ptr<StepRunner> runner;
  std::string description;
  bool gpu_slots = true;           // false: the slots are in pinned host memory
  GdrWords* words = nullptr;       // one per peer, mapped pinned host memory: host view
  GdrWords* words_dev = nullptr;   // device view
  size_t nwords = 0;
  // The step kernels' counters (kernels/cuda_step.cuh), in device memory, and on one node the
  // bases of the calls' relative counts (gpu/step_runner.h).
  uint32_t* step_counters = nullptr;
  uint64_t* step_bases = nullptr;
  KernelStreamWords stream_words;  // what the calls' KernelStreams read (gpu/kernel_stream.h)
  // One node (relative counts): the tables of recent calls, relaunched when a call repeats
  // (gpu/step_table_cache.h); off with GRADSYNC_GPU_STEP_CACHE=0.
  bool cache_tables = false;
  StepTableCache cache;
};

namespace {

// Every world rank, in rank order: the plan's ranks.
std::vector<int> members_of(const GdrConfig& cfg) {
  std::vector<int> all(size_t(cfg.link.world_size));
  for (int r = 0; r < cfg.link.world_size; ++r) all[size_t(r)] = r;
  return all;
}

// The members' channels and this rank's peers (gpu/step_runner.h).
Result<RdmaChannels> channels_of(const GdrConfig& cfg, bool direct) {
  return rdma_channels(members_of(cfg), cfg.nodes.empty() ? cfg.link.hosts : cfg.nodes, cfg.link.rank, direct,
                       cfg.pairs);
}

// The slots of `peers` in GPU memory: per peer and direction used (a direct peer: receive
// slots only; we write into its own), `slots` of `slot_bytes` and `slots` low-latency slots
// of `ll_bytes` (GdrLink's blocks; an RDMA peer's only with `ll_queue_pairs`). TCP peers'
// slots are in pinned host memory and have no low-latency slots.
uint64_t peer_slot_bytes(const std::vector<GdrPeer>& peers, const GdrLinkConfig& link) {
  uint64_t bytes = 0;
  for (const GdrPeer& p : peers) {
    if (link.tcp && !p.direct) continue;
    const uint64_t directions = uint64_t(p.send && !p.direct) + uint64_t(p.recv);
    const bool ll = p.direct || link.ll_queue_pairs;
    bytes += directions * link.slots * (link.slot_bytes + (ll ? link.ll_bytes : 0));
  }
  return bytes;
}

}  // namespace

GdrChannels::GdrChannels(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GdrChannels::~GdrChannels() {
  impl_->link.reset();  // stops the worker before the words go
  if (impl_->words) (void)cudaFreeHost(impl_->words);
  if (impl_->step_counters) (void)cudaFree(impl_->step_counters);
  if (impl_->step_bases) (void)cudaFree(impl_->step_bases);
}

uint64_t GdrChannels::slot_region_bytes(const GdrConfig& cfg) {
  auto ch = channels_of(cfg, cfg.direct);
  return ch.ok() ? peer_slot_bytes(ch->peers, cfg.link) : 0;
}

Result<std::unique_ptr<GdrChannels>> GdrChannels::create(const GdrConfig& cfg, const HostOps& ops,
                                                         std::string* why_not) {
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.cfg = cfg;
  std::unique_ptr<GdrChannels> chan(new GdrChannels(std::move(impl)));
  // Direct hops inside a node only where every rank wants them (GRADSYNC_GDR_DIRECT).
  int32_t direct = cfg.direct ? 1 : 0;
  GS_RETURN_IF_ERROR(ops.allreduce_now(&direct, &direct, 1, DataType::kInt32, ReduceOp::kMin));
  m.cfg.direct = direct != 0;
  // GRADSYNC_PROTO the same on every rank: ranks on different protocols would read each
  // other's messages in the wrong slots until the op timeout.
  int64_t proto[2] = {cfg.protocol ? int64_t(*cfg.protocol) + 1 : 0, 0};
  proto[1] = -proto[0];
  GS_RETURN_IF_ERROR(ops.allreduce_now(proto, proto, 2, DataType::kInt64, ReduceOp::kMin));
  if (proto[0] != -proto[1]) {
    return Status(Code::kInvalidArgument, cfg.link.who + ": GRADSYNC_PROTO differs between ranks (here " +
                                              (cfg.protocol ? plan::to_string(*cfg.protocol) : "unset") +
                                              "): every rank of a job must run the same GPU protocol");
  }
  std::string refused;
  auto made = set_up(m, ops, why_not, &refused);
  if (made.ok() && !*made && !refused.empty()) {
    // Some pair of this node's ranks could not map the other's memory: the same channels with
    // every hop through the NIC (every rank learnt it in the same round).
    log::get("gpu")->warn("{}: no CUDA IPC between this node's ranks on the RDMA channels ({}); their hops go "
                          "through the NIC", cfg.link.who, refused);
    m.cfg.direct = false;
    why_not->clear();
    made = set_up(m, ops, why_not, nullptr);
  }
  if (!made.ok()) return made.status();
  if (!*made) return std::unique_ptr<GdrChannels>();
  return chan;
}

// One attempt at the channels' set-up with m.cfg (collective). False with *why_not: not on
// every rank. *refused (when given) gets why direct peers failed, and false is returned.
Result<bool> GdrChannels::set_up(Impl& m, const HostOps& ops, std::string* why_not, std::string* refused) {
  const GdrConfig& cfg = m.cfg;
  if (m.words) {
    (void)cudaFreeHost(m.words);
    m.words = nullptr;
  }
  GdrLinkConfig lc = cfg.link;
  auto ch = channels_of(cfg, cfg.direct);
  if (!ch.ok()) return Status(ch.status().code(), cfg.link.who + ": " + ch.status().message());
  m.channels = std::move(ch).value();
  rdma_choose_algos(m.channels);
  lc.peers = m.channels.peers;
  const size_t nwords = std::max<size_t>(1, lc.peers.size());
  m.nwords = nwords;

  // What only this GPU decides: the mapped words and whether arrivals need a flush. A
  // failure here still takes part in the link's collective set-up (with no device), so that
  // every rank hears it.
  std::string local_why;
  bool flush_needed = false;
  void* w = nullptr;
  if (Status s = cuda(cudaSetDevice(cfg.device), "cudaSetDevice"); !s.ok()) {
    local_why = s.message();
  } else if (Status a = cuda(cudaHostAlloc(&w, nwords * sizeof(GdrWords), cudaHostAllocMapped),
                             "cudaHostAlloc (mapped)");
             !a.ok()) {
    local_why = a.message();
  } else {
    std::memset(w, 0, nwords * sizeof(GdrWords));
    m.words = static_cast<GdrWords*>(w);
    void* dv = nullptr;
    if (Status d = cuda(cudaHostGetDevicePointer(&dv, w, 0), "cudaHostGetDevicePointer"); !d.ok()) {
      local_why = d.message();
    }
    m.words_dev = static_cast<GdrWords*>(dv);
    auto f = gdr_flush_needed(cfg.device);
    if (!f.ok()) local_why = f.status().message();
    else flush_needed = *f;
  }
  // The step kernels' counters, and on one node with every hop direct the bases of relative
  // counts (every call's counts relative to them, so that a call captured in a CUDA graph
  // replays; both conditions are the same on every rank: direct is agreed). Allocated here,
  // while every rank is in this collective set-up: a cudaMalloc may wait for the kernels of
  // the context, which for ranks sharing a GPU could be a peer's first step waiting for this rank.
  const bool relative = m.channels.shape.node_count() == 1 && cfg.direct;
  auto zeroed = [&](void** at, size_t bytes, const std::string& what) {
    if (!local_why.empty() || *at != nullptr) return;
    if (Status a = cuda(cudaMalloc(at, bytes), "cudaMalloc of the " + what); !a.ok()) {
      local_why = a.message();
    } else if (Status z = cuda(cudaMemset(*at, 0, bytes), "cudaMemset of the " + what); !z.ok()) {
      local_why = z.message();
    } else if (Status y = cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); !y.ok()) {
      local_why = y.message();
    }
  };
  zeroed(reinterpret_cast<void**>(&m.step_counters), kernels::kStepCounterWords * sizeof(uint32_t), "step counters");
  if (relative) zeroed(reinterpret_cast<void**>(&m.step_bases), kernels::kStepMaxBases * sizeof(uint64_t), "step bases");
  // Design §3: GPUDirect only within GRADSYNC_GDR_LEVEL of the NIC (the PCIe distance from
  // sysfs, as gradsyncctl doctor shows it); farther, this rank's slots go to pinned host
  // memory (host-staged RDMA), as they do when the NIC cannot register GPU memory or
  // GRADSYNC_GDR_HOST_SLOTS asks for it. The emulated fabric's devices have no place in the
  // PCIe tree, so the distance rule does not apply to them.
  std::string where, host_why;
  if (const char* h = std::getenv("GRADSYNC_GDR_HOST_SLOTS"); h != nullptr && std::strcmp(h, "0") != 0) {
    host_why = "GRADSYNC_GDR_HOST_SLOTS is set";
  }
  if (local_why.empty() && host_why.empty() && !lc.verbs_device.empty() &&
      lc.verbs_api != verbs::emulated_ibv()->name) {
    topology::PciDistance level = topology::PciDistance::PXB;
    const char* lv = std::getenv("GRADSYNC_GDR_LEVEL");
    char bus[32] = {};
    if (lv != nullptr && *lv != '\0' && !topology::parse_distance(lv)) {
      local_why = std::string("GRADSYNC_GDR_LEVEL='") + lv + "' is not one of PIX, PXB, PHB, NODE, SYS";
    } else if (cudaDeviceGetPCIBusId(bus, sizeof(bus) - 1, cfg.device) != cudaSuccess) {
      (void)cudaGetLastError();
      host_why = "the GPU's PCI address is unknown (cudaDeviceGetPCIBusId failed)";
    } else {
      if (lv != nullptr && *lv != '\0') level = *topology::parse_distance(lv);
      const auto d = topology::gpu_nic_distance(topology::SysfsRoot{}, bus, lc.verbs_device);
      const std::string pair = std::string("GPU ") + bus + " - " + lc.verbs_device;
      if (!d) {
        host_why = "no PCIe path known between " + pair + " (distance unknown)";
      } else if (int(*d) > int(level)) {
        host_why = pair + " is " + topology::distance_name(*d) + ", above GRADSYNC_GDR_LEVEL=" +
                   topology::distance_name(level);
      } else {
        where = ", " + pair + " is " + topology::distance_name(*d);
      }
    }
  }
  if (!local_why.empty()) lc.refuse = local_why;

  const int device = cfg.device;
  // Non-empty once this rank's slots are in host memory: why.
  auto in_host = std::make_shared<std::string>(host_why);
  GdrRegionMaker make_region = [device, in_host](const verbs::ProtectionDomain& pd,
                                                 size_t bytes) -> Result<GdrRegion> {
    if (in_host->empty()) {
      auto gpu = gpu_region(device, pd, bytes);
      if (gpu.ok()) return gpu;
      *in_host = "the NIC cannot register this GPU's memory: " + gpu.status().message();
    }
    return host_region(pd, bytes);
  };
  std::function<Status()> flush;
  if (flush_needed) {
    flush = [device, in_host] {  // RDMA writes into GPU memory only
      if (!in_host->empty()) return Status::Ok();
      (void)cudaSetDevice(device);
      return flush_gdr_writes();
    };
  }
  GdrLinkOps lo;
  lo.allreduce_now = ops.allreduce_now;
  lo.abort_reason = ops.abort_reason;
  lo.abort_job = ops.abort_job;
  // The stream's waits end at once when the link fails (every other rank's through the abort).
  uint32_t* abort_host = cfg.abort_host;
  lo.on_failure = [abort_host] { __atomic_store_n(abort_host, 1u, __ATOMIC_RELEASE); };
  lo.direct_make = [device](size_t bytes) { return direct_region(device, bytes); };
  lo.direct_open = [device](const uint8_t* handle, int) { return open_direct_region(device, handle); };
  lc.tcp = cfg.tcp;
  if (cfg.tcp) lo.tcp_region = [](size_t bytes) { return pinned_region(bytes); };
  std::vector<GdrWords> dummy(nwords);
  bool direct_refused = false;
  auto link = GdrLink::create(lc, lo, make_region, m.words ? m.words : dummy.data(), std::move(flush), why_not,
                              &direct_refused);
  if (!link.ok()) return link.status();
  if (!*link) {
    if (direct_refused && refused != nullptr) {
      *refused = *why_not;
      return false;
    }
    if (!local_why.empty()) *why_not = "GPUDirect RDMA: " + local_why;
    return false;
  }
  m.link = std::move(link).value();
  m.runner = std::make_unique<StepRunner>(m.link.get(), relative);
  KernelStreamWords& sw = m.stream_words;
  sw.link = m.link.get();
  sw.host = reinterpret_cast<const uint8_t*>(m.words);
  sw.device = reinterpret_cast<uint8_t*>(m.words_dev);
  sw.bytes = m.nwords * sizeof(GdrWords);
  sw.abort = cfg.abort_dev;
  sw.error = cfg.error_dev;
  sw.counters = m.step_counters;
  sw.bases = relative ? m.step_bases : nullptr;
  const char* cache_env = std::getenv("GRADSYNC_GPU_STEP_CACHE");
  m.cache_tables = relative && (cache_env == nullptr || std::strcmp(cache_env, "0") != 0);
  sw.timeout_ns = uint64_t(cfg.link.op_timeout.count()) * 1'000'000ull;
  sw.max_blocks = cfg.max_blocks;
  sw.block_bytes = cfg.block_bytes;
  sw.who = cfg.link.who;
  m.gpu_slots = in_host->empty() && !cfg.tcp;
  // The protocol in words: GRADSYNC_PROTO's, else the model's per size (low-latency by the
  // model only on one node; forced, on the hops to direct and RDMA peers, while TCP hops
  // stay bulk).
  const std::string proto = cfg.protocol ? std::string(plan::to_string(*cfg.protocol)) + " at every size (GRADSYNC_PROTO" +
                                               (*cfg.protocol == plan::Protocol::kLowLatency && cfg.tcp &&
                                                        m.channels.shape.node_count() > 1
                                                    ? ", on the hops inside a node; TCP hops bulk"
                                                    : "") +
                                               ")"
                                         : rdma_protocol_summary(m.channels);
  if (m.channels.shape.node_count() == 1) {  // no RDMA: every hop by CUDA IPC
    m.description = std::string("CUDA IPC steps (ring and double binary tree") +
                    (m.channels.pairs.size() > 0 ? ", one-shot and two-shot on every pair" : "") + " on this node; " +
                    (m.channels.pairs.size() > 0 ? "allreduce by the cost model: " + rdma_auto_summary(m.channels) + "; "
                                                 : std::string()) +
                    proto + ") over " + m.link->describe();
    return true;
  }
  const std::string what = std::string("ring and double binary tree") +
                           (m.channels.hier.size() > 0 ? ", hierarchical (the pairs of each node, a ring per local index)"
                                                       : "") +
                           " over " + std::to_string(m.channels.shape.node_count()) +
                           (m.channels.shape.node_count() == 1 ? " node" : " nodes") +
                           "; allreduce by the cost model: " + rdma_auto_summary(m.channels) + "; " + proto;
  if (cfg.tcp) {
    m.description = "TCP steps (" + what + ") over " + m.link->describe();
    return true;
  }
  m.description = m.gpu_slots ? "GPUDirect RDMA (" + what + ") over " + m.link->describe() + where +
                                    (flush_needed ? ", flushing RDMA writes (ordering below OWNER)" : "")
                              : "host-staged RDMA (" + what + ") over " + m.link->describe() + " (" + *in_host + ")";
  return true;
}

bool GdrChannels::gpu_slots() const { return impl_->gpu_slots; }
bool GdrChannels::tcp() const { return impl_->cfg.tcp; }
bool GdrChannels::hierarchical() const { return impl_->channels.hier.size() > 0; }
bool GdrChannels::capturable() const { return impl_->stream_words.bases != nullptr; }
bool GdrChannels::one_node() const { return impl_->channels.shape.node_count() == 1; }

DeviceComm::MemoryUse GdrChannels::memory() const {
  DeviceComm::MemoryUse u;
  (impl_->gpu_slots ? u.gpu_bytes : u.pinned_host_bytes) += impl_->link->region_bytes();
  u.gpu_bytes += impl_->link->direct_region_bytes();
  u.pinned_host_bytes += std::max<size_t>(1, impl_->channels.peers.size()) * sizeof(GdrWords);
  return u;
}

void GdrChannels::add_bytes_sent(Communicator::GpuBytesSent& b) const {
  const Impl& m = *impl_;
  const std::vector<std::string>& node = m.cfg.nodes.empty() ? m.cfg.link.hosts : m.cfg.nodes;
  const std::string& mine = node[size_t(m.cfg.link.rank)];
  for (int p = 0; p < m.link->peer_count(); ++p) {
    const uint64_t bytes = m.link->bytes_sent(p);
    (m.link->peer(p).direct                      ? b.cuda_ipc
     : m.link->peer(p).tcp                        ? b.tcp
     : node[size_t(m.link->peer(p).rank)] == mine ? b.rdma_same_node
                                                  : b.rdma_other_nodes) += bytes;
  }
}

const std::string& GdrChannels::describe() const { return impl_->description; }
Status GdrChannels::error() const { return impl_->link->error(); }
void GdrChannels::quiesce() { impl_->link->quiesce(); }

Status GdrChannels::enqueue(const CollectiveCall& c, cudaStream_t stream,
                            std::optional<plan::Algo> forced) {
  Impl& m = *impl_;
  const int divisor = int(m.channels.members.size());
  const size_t es = element_size(c.type);
  // Forced (`forced`, else CallOptions::algorithm or GRADSYNC_ALGO, resolved by the caller),
  // else the cost model's choice for an allreduce of this size on these channels.
  const plan::Algo algo = forced                              ? *forced
                          : c.algorithm == Algorithm::kTree ? plan::Algo::kTree
                          : c.algorithm == Algorithm::kRing || c.kind != CollectiveKind::kAllreduce
                              ? plan::Algo::kRing
                              : rdma_auto_algo(m.channels, c.count * es);
  // The protocol: GRADSYNC_PROTO, else the model's choice for this algorithm and size (the
  // same on every rank: the channels and the call are). Low-latency messages are at most a
  // low-latency slot's payload.
  const size_t payload = m.link->ll_payload_bytes();
  const bool ll = payload >= es && (m.cfg.protocol ? *m.cfg.protocol == plan::Protocol::kLowLatency
                                                   : rdma_auto_low_latency(m.channels, algo, c.count * es));
  const size_t chunk = ll ? std::min(m.cfg.link.slot_bytes, payload) : m.cfg.link.slot_bytes;
  // Broadcast has one buffer (the recv buffer), read on the root and written elsewhere.
  const void* input = c.kind == CollectiveKind::kBroadcast ? c.recv : c.send;
  const StepCallKey key{c.kind, algo, ll, c.count, c.type, c.op, c.root, divisor, input, c.recv};
  if (m.cache_tables) {
    if (const StepTableCache::Entry* e = m.cache.find(key)) return replay(*e, c, stream);
  }
  auto steps = rdma_steps(m.channels, c.kind, algo, c.count, es, c.root, chunk, m.link->slots());
  if (!steps.ok()) return Status(steps.status().code(), m.cfg.link.who + ": " + steps.status().message());
  // A planned call keeps a copy of each table it launches, and its bytes per peer, for the
  // calls that repeat it.
  std::vector<std::unique_ptr<kernels::StepTable>> tables;
  std::vector<uint64_t> before(size_t(m.link->peer_count()));
  for (int p = 0; p < m.link->peer_count(); ++p) before[size_t(p)] = m.link->bytes_sent(p);
  KernelStream::Launch launch;
  if (m.cache_tables) {
    launch = [&](const kernels::StepTable& t) {
      if (tables.size() <= StepTableCache::kMaxTables) tables.push_back(std::make_unique<kernels::StepTable>(t));
      return kernels::launch_steps(t, c.type, c.op, stream);
    };
  }
  KernelStream ks(m.stream_words, stream, c.type, c.op, divisor, std::move(launch));
  Status s = m.runner->run(*steps, m.channels.members, input, c.recv, es, ks, ll);
  if (!s.ok()) return Status(s.code(), m.cfg.link.who + ": " + s.message());
  if (m.cache_tables) {
    for (int p = 0; p < m.link->peer_count(); ++p) before[size_t(p)] = m.link->bytes_sent(p) - before[size_t(p)];
    m.cache.put(key, std::move(tables), std::move(before));
  }
  return s;
}

// A repeated one-node call: its tables as planned the first time, and its bytes counted.
Status GdrChannels::replay(const StepTableCache::Entry& e, const CollectiveCall& c, cudaStream_t stream) {
  Impl& m = *impl_;
  for (const auto& t : e.tables) {
    if (const cudaError_t err = kernels::launch_steps(*t, c.type, c.op, stream); err != cudaSuccess) {
      return {Code::kInternal, m.cfg.link.who + ": step kernel: launch: " + cudaGetErrorName(err) + " (" +
                                   cudaGetErrorString(err) + ")"};
    }
  }
  std::vector<GdrLink::Message> sent;
  for (size_t p = 0; p < e.bytes_sent.size(); ++p) {
    for (uint64_t left = e.bytes_sent[p]; left > 0;) {
      const uint32_t b = uint32_t(std::min<uint64_t>(left, uint64_t(1) << 31));
      sent.push_back({int(p), true, b});
      left -= b;
    }
  }
  m.link->plan(sent);
  return Status::Ok();
}

}  // namespace gradsync
