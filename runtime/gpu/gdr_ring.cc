#include "gpu/gdr_ring.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>

#include "common/log.h"
#include "gpu/gdr_link.h"
#include "gpu/gdr_schedule.h"
#include "gpu/gpu_memory_registration.h"
#include "kernels/cuda_reduce.cuh"
#include "topology/gpudirect.h"
#include "transport/verbs/emulated_fabric.h"

namespace gradsync {
namespace {

// Wait kernels' `what` codes (NodeError::what; device_comm.cc words them).
constexpr uint32_t kWaitArrival = 3;
constexpr uint32_t kWaitSendSlot = 4;

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

Result<GdrRegion> host_region(const verbs::ProtectionDomain& pd, size_t bytes) {
  auto slots = std::make_shared<HostSlots>();
  GS_RETURN_IF_ERROR(cuda(cudaHostAlloc(&slots->ptr, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                          "cudaHostAlloc of the RDMA slots (" + std::to_string(bytes) + " bytes)"));
  std::memset(slots->ptr, 0, bytes);
  void* dev = nullptr;
  GS_RETURN_IF_ERROR(cuda(cudaHostGetDevicePointer(&dev, slots->ptr, 0), "cudaHostGetDevicePointer"));
  if (dev != slots->ptr) {
    return Status(Code::kUnimplemented, "pinned host slots need unified addressing (the GPU sees them elsewhere)");
  }
  auto mr = verbs::MemoryRegion::create(pd, slots->ptr, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!mr.ok()) return mr.status();
  slots->mr.emplace(std::move(mr).value());
  GdrRegion region;
  region.base = static_cast<uint8_t*>(slots->ptr);
  region.mr = &*slots->mr;
  region.method = "pinned host memory";
  region.owner = slots;
  return region;
}

}  // namespace

struct GdrRing::Impl {
  GdrConfig cfg;
  std::unique_ptr<GdrLink> link;
  std::string description;
  bool gpu_slots = true;          // false: the slots are in pinned host memory
  uint64_t slot_region_bytes = 0;  // the send and receive slots (GPU or pinned host memory)
  GdrWords* words = nullptr;      // mapped pinned host memory: host view
  GdrWords* words_dev = nullptr;  // device view
  // Messages numbered at enqueue (the caller's thread), per direction.
  uint64_t sends_queued = 0, recvs_queued = 0;
};

GdrRing::GdrRing(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GdrRing::~GdrRing() {
  impl_->link.reset();  // stops the worker before the words go
  if (impl_->words) (void)cudaFreeHost(impl_->words);
}

Result<std::unique_ptr<GdrRing>> GdrRing::create(const GdrConfig& cfg, const HostOps& ops,
                                                 std::string* why_not) {
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.cfg = cfg;
  std::unique_ptr<GdrRing> ring(new GdrRing(std::move(impl)));
  GdrLinkConfig lc = cfg.link;

  // What only this GPU decides: the mapped words and whether arrivals need a flush. A
  // failure here still takes part in the link's collective set-up (with no device), so that
  // every rank hears it.
  std::string local_why;
  bool flush_needed = false;
  void* w = nullptr;
  if (Status s = cuda(cudaSetDevice(cfg.device), "cudaSetDevice"); !s.ok()) {
    local_why = s.message();
  } else if (Status a = cuda(cudaHostAlloc(&w, sizeof(GdrWords), cudaHostAllocMapped), "cudaHostAlloc (mapped)");
             !a.ok()) {
    local_why = a.message();
  } else {
    std::memset(w, 0, sizeof(GdrWords));
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
  if (!local_why.empty()) lc.verbs_device.clear();

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
  GdrWords dummy{};
  auto link = GdrLink::create(lc, lo, make_region, m.words ? m.words : &dummy, std::move(flush), why_not);
  if (!link.ok()) return link.status();
  if (!*link) {
    if (!local_why.empty()) *why_not = "GPUDirect RDMA: " + local_why;
    return std::unique_ptr<GdrRing>();
  }
  m.link = std::move(link).value();
  m.gpu_slots = in_host->empty();
  m.slot_region_bytes = 2 * uint64_t(lc.slots) * lc.slot_bytes;  // GdrLink's one region
  m.description = m.gpu_slots ? "GPUDirect RDMA over " + m.link->describe() + where +
                                    (flush_needed ? ", flushing RDMA writes (ordering below OWNER)" : "")
                              : "host-staged RDMA over " + m.link->describe() + " (" + *in_host + ")";
  return ring;
}

bool GdrRing::gpu_slots() const { return impl_->gpu_slots; }

DeviceComm::MemoryUse GdrRing::memory() const {
  DeviceComm::MemoryUse u;
  (impl_->gpu_slots ? u.gpu_bytes : u.pinned_host_bytes) += impl_->slot_region_bytes;
  u.pinned_host_bytes += sizeof(GdrWords);
  return u;
}

const std::string& GdrRing::describe() const { return impl_->description; }
Status GdrRing::error() const { return impl_->link->error(); }
void GdrRing::quiesce() { impl_->link->quiesce(); }

Status GdrRing::enqueue(const CollectiveCall& c, cudaStream_t stream, int avg_divisor) {
  Impl& m = *impl_;
  const int n = m.link->ring_size(), r = m.link->ring_position();
  const int divisor = avg_divisor > 0 ? avg_divisor : n;
  int root = c.root;  // a broadcast's root: its place in the ring
  if (const auto& ring = m.cfg.link.ring; !ring.empty() && c.kind == CollectiveKind::kBroadcast) {
    root = int(std::find(ring.begin(), ring.end(), c.root) - ring.begin());
    if (root == int(ring.size())) return Status(Code::kInternal, m.cfg.link.who + ": broadcast root outside the ring");
  }
  const size_t es = element_size(c.type);
  const size_t per = std::max<size_t>(1, m.cfg.link.slot_bytes / es);
  const uint64_t timeout_ns = uint64_t(m.cfg.link.op_timeout.count()) * 1'000'000ull;
  auto* send = static_cast<const uint8_t*>(c.send);
  auto* recv = static_cast<uint8_t*>(c.recv);
  GdrWords* w = m.words_dev;
  GdrLink& link = *m.link;
  std::vector<uint32_t> sends, recvs;  // this call's message lengths, in order
  const std::string who = m.cfg.link.who;
  auto check = [&](cudaError_t e, const char* what) { return cuda(e, who + ": " + what); };

  // One step of the schedule on piece [off, off + len) of some segment: wait for the message
  // from the previous rank (recv_in), for a free send slot (send_out), run `body(in, out)`,
  // then tell the worker.
  auto step = [&](bool recv_in, bool send_out, size_t len,
                  const std::function<Status(const uint8_t* in, uint8_t* out)>& body) -> Status {
    const uint64_t k = m.recvs_queued, msg = m.sends_queued;
    if (recv_in) {
      GS_RETURN_IF_ERROR(check(kernels::launch_wait_host(&w->arrived, k + 1, m.cfg.abort_dev, m.cfg.error_dev,
                                                         timeout_ns, nullptr, stream, link.prev(), kWaitArrival),
                               "wait kernel"));
    }
    if (send_out && msg + 1 > link.slots()) {
      GS_RETURN_IF_ERROR(check(kernels::launch_wait_host(&w->send_free, msg + 1 - link.slots(), m.cfg.abort_dev,
                                                         m.cfg.error_dev, timeout_ns, nullptr, stream, link.next(),
                                                         kWaitSendSlot),
                               "wait kernel"));
    }
    GS_RETURN_IF_ERROR(body(recv_in ? link.slot(true, k) : nullptr, send_out ? link.slot(false, msg) : nullptr));
    if (send_out) {
      GS_RETURN_IF_ERROR(check(kernels::launch_signal_host(&w->ready, msg + 1, nullptr, stream), "signal kernel"));
      sends.push_back(uint32_t(len * es));
      ++m.sends_queued;
    }
    if (recv_in) {
      GS_RETURN_IF_ERROR(check(kernels::launch_signal_host(&w->consumed, k + 1, nullptr, stream), "signal kernel"));
      recvs.push_back(uint32_t(len * es));
      ++m.recvs_queued;
    }
    // The worker learns of each step as soon as it is queued, not at the end of the call: a
    // call of many steps fills the stream's launch queue, and cudaLaunchKernel then blocks
    // until the GPU has run earlier steps, whose messages the worker must already know.
    link.plan(sends, recvs);
    sends.clear();
    recvs.clear();
    return Status::Ok();
  };
  // Copies by a kernel, not cudaMemcpyAsync: a copy between two addresses of one device may
  // wait for the other streams' work (CUDA's implicit synchronization), and another stream of
  // this GPU may hold a kernel that waits for this very call (ranks sharing a GPU, or the
  // caller's own streams).
  auto copy = [&](void* dst, const void* src, size_t bytes) -> Status {
    if (dst == src || bytes == 0) return Status::Ok();
    return check(kernels::launch_copy(dst, src, bytes, stream), "copy kernel");
  };

  // The schedule (gpu/gdr_schedule.h), step by step: the kernels of each step's body between
  // its waits and its signals.
  Status s = Status::Ok();
  for (const gdr::Step& st : gdr::plan(c.kind, c.count, n, r, root, per)) {
    const size_t bytes = st.len * es;
    const uint8_t* input = send + st.in * es;
    uint8_t* output = recv + st.out * es;
    s = step(st.recv, st.send, st.len, [&](const uint8_t* in, uint8_t* out) -> Status {
      switch (st.body) {
        case gdr::Body::kCopyIn:
          return copy(out, input, bytes);
        case gdr::Body::kReduce:
          return check(kernels::launch_reduce(c.type, c.op, out, in, input, st.len, stream), "reduce kernel");
        case gdr::Body::kReduceFinal:
          return check(kernels::launch_reduce_final(c.type, c.op, output, out, in, input, st.len, divisor, stream),
                       "reduce kernel");
        case gdr::Body::kGatherFirst:
          GS_RETURN_IF_ERROR(copy(output, input, bytes));
          return copy(out, input, bytes);
        case gdr::Body::kCopyOut:
          GS_RETURN_IF_ERROR(copy(output, in, bytes));
          return out ? copy(out, in, bytes) : Status::Ok();
      }
      return Status(Code::kInternal, "unknown step");
    });
    if (!s.ok()) break;
  }
  // Hand the lengths to the worker even after an error: what was queued on the stream runs.
  link.plan(sends, recvs);
  return s;
}

}  // namespace gradsync
