#include "transport/verbs/verbs.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"

namespace gradsync::verbs {
namespace {

// RC connection parameters (rc_pingpong, perftest, tensorpipe agree; see
// shared/reference/gdr_verbs.md §2).
constexpr uint8_t kMinRnrTimer = 12;     // encoded: 12 = 0.64 ms wait before an RNR retry
constexpr uint8_t kTimeout = 14;         // ACK timeout 4.096 us * 2^14 ≈ 67 ms per try
constexpr uint8_t kRetryCount = 7;       // transport retries before RETRY_EXC_ERR (max)
constexpr uint8_t kRnrRetry = 7;         // 7 = retry RNR forever: credits prevent real RNRs
constexpr uint8_t kRdAtomic = 1;         // outstanding RDMA READs: we only write
constexpr uint8_t kHopLimit = 255;       // GRH hops (NCCL): routed RoCEv2 may cross routers
constexpr uint16_t kPkeyIndex = 0;       // default partition
constexpr uint32_t kPsnMask = 0xffffff;  // PSNs are 24 bits

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

}  // namespace

template <typename T, auto Destroy>
void IbvDeleter<T, Destroy>::operator()(T* obj) const {
  if (obj == nullptr) return;
  if (int rc = (api->*Destroy)(obj); rc != 0)
    log::get("verbs")->warn("releasing a verbs object failed: {} (objects freed out of order?)",
                            errno_text(rc));
}

// The wrappers are used (moved, destroyed) outside this file: every deleter is instantiated here.
template struct IbvDeleter<ibv_context, &IbvApi::close_device>;
template struct IbvDeleter<ibv_pd, &IbvApi::dealloc_pd>;
template struct IbvDeleter<ibv_mr, &IbvApi::dereg_mr>;
template struct IbvDeleter<ibv_cq, &IbvApi::destroy_cq>;
template struct IbvDeleter<ibv_qp, &IbvApi::destroy_qp>;

// ---- Context -----------------------------------------------------------------------------
Result<Context> Context::open(const IbvApi* api, const std::string& device) {
  int n = 0;
  errno = 0;
  ibv_device** list = api->get_device_list(&n);
  if (list == nullptr)
    return Status(Code::kUnavailable, std::string("no verbs devices (") + api->name +
                                          " ibv_get_device_list: " + errno_text(errno) + ")");
  std::unique_ptr<ibv_device*, void (*)(ibv_device**)> hold(list, api->free_device_list);
  std::string seen;
  for (int i = 0; i < n; ++i) {
    std::string name = api->get_device_name(list[i]);
    seen += (seen.empty() ? "" : ",") + name;
    if (!device.empty() && name != device) continue;
    ibv_context* raw = api->open_device(list[i]);
    if (raw == nullptr)
      return Status(Code::kUnavailable, "verbs device " + name + ": open failed: " + errno_text(errno));
    Context ctx;
    ctx.api_ = api;
    ctx.name_ = name;
    ctx.ctx_ = decltype(ctx.ctx_)(raw, {api});
    return ctx;
  }
  return Status(Code::kNotFound, "verbs device '" + (device.empty() ? std::string("<any>") : device) +
                                     "' not found; devices: [" + seen + "]");
}

Result<PortInfo> query_port(const Context& ctx, uint8_t port) {
  ibv_port_attr attr{};
  if (int rc = ctx.api()->query_port(ctx.get(), port, &attr); rc != 0)
    return Status(Code::kInvalidArgument,
                  "verbs device " + ctx.name() + " port " + std::to_string(port) + ": query failed: " + errno_text(rc));
  return PortInfo{attr.state, attr.link_layer, attr.active_mtu, attr.lid, attr.gid_tbl_len};
}

Result<std::vector<DeviceInfo>> list_devices(const IbvApi* api) {
  int n = 0;
  errno = 0;
  ibv_device** list = api->get_device_list(&n);
  if (list == nullptr) {
    // ENOSYS: the kernel has no uverbs (no RDMA stack) — same as "no devices".
    if (errno == ENOSYS) return std::vector<DeviceInfo>{};
    return Status(Code::kUnavailable, std::string(api->name) + " ibv_get_device_list: " + errno_text(errno));
  }
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) names.emplace_back(api->get_device_name(list[i]));
  api->free_device_list(list);
  std::vector<DeviceInfo> out;
  for (const auto& name : names) {
    DeviceInfo info{name, {}};
    auto ctx = Context::open(api, name);
    if (!ctx.ok()) {
      log::get("verbs")->warn("{}", ctx.status().message());
    } else {
      ibv_device_attr attr{};
      if (api->query_device(ctx->get(), &attr) == 0)
        for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p)
          if (auto pi = query_port(*ctx, p); pi.ok()) info.ports.push_back(*pi);
    }
    out.push_back(std::move(info));
  }
  return out;
}

Result<GidChoice> select_gid(const Context& ctx, uint8_t port, int override_index) {
  auto pi = query_port(ctx, port);
  if (!pi.ok()) return pi.status();
  const std::string where = "verbs device " + ctx.name() + " port " + std::to_string(port);
  const ibv_gid zero{};
  GidChoice c;
  if (override_index >= 0) {
    if (override_index >= pi->gid_tbl_len ||
        ctx.api()->query_gid(ctx.get(), port, override_index, &c.gid) != 0 ||
        std::memcmp(&c.gid, &zero, sizeof(zero)) == 0)
      return Status(Code::kInvalidArgument, where + ": GID index override " + std::to_string(override_index) +
                                                " is not a valid GID (table has " +
                                                std::to_string(pi->gid_tbl_len) + ")");
    c.index = override_index;
    return c;
  }
  if (!pi->is_ethernet()) {  // IB: routed by LID, GID 0 only for a GRH
    if (ctx.api()->query_gid(ctx.get(), port, 0, &c.gid) != 0)
      return Status(Code::kInternal, where + ": cannot read GID 0");
    return c;
  }
  if (!ctx.api()->query_gid_ex)
    log::get("verbs")->warn("{}: GID types unreadable (old rdma-core); RoCE v1/v2 not checked", where);
  for (int i = 0; i < pi->gid_tbl_len; ++i) {
    ibv_gid g{};
    if (ctx.api()->query_gid(ctx.get(), port, i, &g) != 0) continue;  // containers: unmapped
    const uint8_t* r = g.raw;
    const bool v4_mapped = std::all_of(r, r + 10, [](uint8_t b) { return b == 0; }) &&
                           r[10] == 0xff && r[11] == 0xff;
    if (!v4_mapped) continue;  // skips zero and link-local fe80:: too
    if (ctx.api()->query_gid_ex) {
      ibv_gid_entry e{};
      if (ctx.api()->query_gid_ex(ctx.get(), port, i, &e, 0) != 0 || e.gid_type != IBV_GID_TYPE_ROCE_V2)
        continue;
    }
    c.index = i;
    c.gid = g;
    return c;
  }
  return Status(Code::kNotFound, where + ": no RoCE v2 IPv4-mapped GID (is an IPv4 address "
                                         "configured on the netdev?); set a GID index override");
}

// ---- PD, MR, CQ --------------------------------------------------------------------------
Result<ProtectionDomain> ProtectionDomain::create(const Context& ctx) {
  ibv_pd* raw = ctx.api()->alloc_pd(ctx.get());
  if (raw == nullptr)
    return Status(Code::kInternal, "verbs device " + ctx.name() + ": alloc_pd failed: " + errno_text(errno));
  ProtectionDomain pd;
  pd.api_ = ctx.api();
  pd.device_ = ctx.name();
  pd.pd_ = decltype(pd.pd_)(raw, {ctx.api()});
  return pd;
}

Result<MemoryRegion> MemoryRegion::create(const ProtectionDomain& pd, void* addr, size_t length, int access) {
  ibv_mr* raw = pd.api()->reg_mr(pd.get(), addr, length, access);
  if (raw == nullptr)
    return Status(Code::kInternal, "verbs device " + pd.device() + ": reg_mr of " + std::to_string(length) +
                                       " bytes failed: " + errno_text(errno) + " (memlock limit?)");
  MemoryRegion mr;
  mr.base_ = reinterpret_cast<uint64_t>(raw->addr);
  mr.mr_ = decltype(mr.mr_)(raw, {pd.api()});
  return mr;
}

bool probe_dmabuf(const ProtectionDomain& pd, std::string* note) {
  const IbvApi* api = pd.api();
  if (api->reg_dmabuf_mr == nullptr) {
    *note = std::string("no ibv_reg_dmabuf_mr in ") + api->name +
            (api->reg_dmabuf_mr_missing ? std::string(": ") + api->reg_dmabuf_mr_missing : std::string());
    return false;
  }
  errno = 0;
  ibv_mr* raw = api->reg_dmabuf_mr(pd.get(), 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE);
  const int err = errno;
  if (raw != nullptr) {
    (void)api->dereg_mr(raw);
    *note = "ibv_reg_dmabuf_mr accepted fd -1 (provider does not check it)";
    return true;
  }
  if (err == EOPNOTSUPP || err == EPROTONOSUPPORT) {
    *note = "ibv_reg_dmabuf_mr with fd -1: " + errno_text(err) + " (provider or kernel without dma-buf MRs)";
    return false;
  }
  *note = "ibv_reg_dmabuf_mr with fd -1: " + errno_text(err) + ", as expected (dma-buf MRs supported)";
  return true;
}

Result<MemoryRegion> MemoryRegion::create_dmabuf(const ProtectionDomain& pd, int fd, uint64_t offset,
                                                 size_t length, uint64_t iova, int access) {
  const std::string where = "verbs device " + pd.device() + ": reg_dmabuf_mr";
  if (pd.api()->reg_dmabuf_mr == nullptr)
    return Status(Code::kUnavailable,
                  where + " unavailable: " +
                      (pd.api()->reg_dmabuf_mr_missing ? pd.api()->reg_dmabuf_mr_missing
                                                       : "not in the verbs function table"));
  errno = 0;
  ibv_mr* raw = pd.api()->reg_dmabuf_mr(pd.get(), offset, length, iova, fd, access);
  if (raw == nullptr) {
    const int err = errno;
    char detail[160];
    std::snprintf(detail, sizeof(detail), " of %zu bytes (fd %d, offset %llu, iova 0x%llx) failed: ", length,
                  fd, static_cast<unsigned long long>(offset), static_cast<unsigned long long>(iova));
    const bool unsupported = err == EOPNOTSUPP || err == EPROTONOSUPPORT;
    const char* hint = unsupported ? " (the device, driver or kernel has no dma-buf MRs: kernel >= 5.12 and a "
                                     "provider with reg_dmabuf_mr are needed)"
                       : err == EBADF ? " (not an open dma-buf fd)"
                       : err == EINVAL ? " (bad range, access flags, or iova/offset page offsets differ)"
                                       : "";
    const Code code = unsupported                       ? Code::kUnavailable
                      : (err == EBADF || err == EINVAL) ? Code::kInvalidArgument
                                                        : Code::kInternal;
    return Status(code, where + detail + errno_text(err) + hint);
  }
  MemoryRegion mr;
  mr.base_ = iova;
  mr.mr_ = decltype(mr.mr_)(raw, {pd.api()});
  return mr;
}

Result<CompletionQueue> CompletionQueue::create(const Context& ctx, int entries) {
  ibv_cq* raw = ctx.api()->create_cq(ctx.get(), entries, nullptr, nullptr, 0);
  if (raw == nullptr)
    return Status(Code::kInternal, "verbs device " + ctx.name() + ": create_cq(" + std::to_string(entries) +
                                       ") failed: " + errno_text(errno));
  CompletionQueue cq;
  cq.api_ = ctx.api();
  cq.cq_ = decltype(cq.cq_)(raw, {ctx.api()});
  return cq;
}

Result<int> CompletionQueue::poll(std::span<ibv_wc> out) const {
  int n = api_->poll_cq(cq_.get(), static_cast<int>(out.size()), out.data());
  if (n < 0) return Status(Code::kInternal, "poll_cq failed: " + errno_text(-n));
  return n;
}

// ---- QueuePair ---------------------------------------------------------------------------
Result<QueuePair> QueuePair::create_rc(const ProtectionDomain& pd, const CompletionQueue& send_cq,
                                       const CompletionQueue& recv_cq, const QpCaps& caps, std::string peer) {
  ibv_qp_init_attr init{};
  init.send_cq = send_cq.get();
  init.recv_cq = recv_cq.get();
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // we choose which sends complete (IBV_SEND_SIGNALED)
  init.cap = {caps.max_send_wr, caps.max_recv_wr, caps.max_send_sge, caps.max_recv_sge, caps.max_inline_data};
  ibv_qp* raw = pd.api()->create_qp(pd.get(), &init);
  if (raw == nullptr)
    return Status(Code::kInternal, "verbs device " + pd.device() + ": create_qp for peer " + peer +
                                       " failed: " + errno_text(errno));
  QueuePair qp;
  qp.api_ = pd.api();
  qp.device_ = pd.device();
  qp.peer_ = std::move(peer);
  qp.qp_ = decltype(qp.qp_)(raw, {pd.api()});
  return qp;
}

std::string QueuePair::where() const {
  char qpn[16];
  std::snprintf(qpn, sizeof(qpn), "0x%x", qp_->qp_num);
  return std::string("qp ") + qpn + " on " + device_ + ":" + std::to_string(port_) + " to peer " + peer_;
}

Status QueuePair::modify(ibv_qp_attr& attr, int mask, const char* what) {
  if (int rc = api_->modify_qp(qp_.get(), &attr, mask); rc != 0)
    return Status(Code::kInternal, where() + ": modify to " + what + " failed: " + errno_text(rc));
  return Status::Ok();
}

Status QueuePair::to_init(uint8_t port, int access) {
  port_ = port;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = kPkeyIndex;
  a.port_num = port;
  a.qp_access_flags = static_cast<unsigned>(access);
  return modify(a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
}

Status QueuePair::to_rtr(const PeerAddress& peer, ibv_mtu local_active_mtu, int sgid_index) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = std::min(local_active_mtu, peer.mtu);
  a.dest_qp_num = peer.qpn;
  a.rq_psn = peer.psn & kPsnMask;
  a.max_dest_rd_atomic = kRdAtomic;
  a.min_rnr_timer = kMinRnrTimer;
  a.ah_attr.dlid = peer.lid;
  a.ah_attr.port_num = port_;
  if (sgid_index >= 0) {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = peer.gid;
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(sgid_index);
    a.ah_attr.grh.hop_limit = kHopLimit;
  }
  return modify(a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, "RTR");
}

Status QueuePair::to_rts(uint32_t psn) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = kTimeout;
  a.retry_cnt = kRetryCount;
  a.rnr_retry = kRnrRetry;
  a.sq_psn = psn & kPsnMask;
  a.max_rd_atomic = kRdAtomic;
  return modify(a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                       IBV_QP_MAX_QP_RD_ATOMIC, "RTS");
}

Status QueuePair::post_rdma(ibv_wr_opcode opcode, const MemoryRegion& local, size_t offset, size_t len,
                            uint64_t remote_addr, uint32_t rkey, uint32_t imm, uint64_t wr_id, bool signaled) {
  if (offset > local.length() || len > local.length() - offset || len > UINT32_MAX)
    return Status(Code::kInvalidArgument, where() + ": write of " + std::to_string(len) + " bytes at offset " +
                                              std::to_string(offset) + " exceeds the local region");
  ibv_sge sge{local.addr() + offset, static_cast<uint32_t>(len), local.lkey()};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = opcode;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  if (opcode == IBV_WR_RDMA_WRITE_WITH_IMM) wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  if (int rc = api_->post_send(qp_.get(), &wr, &bad); rc != 0)
    return Status(Code::kFailedPrecondition, where() + ": post_send refused: " + errno_text(rc) +
                                                 " (QP not in RTS, or send queue full)");
  return Status::Ok();
}

Status QueuePair::post_write_with_imm(const MemoryRegion& local, size_t offset, size_t len,
                                      uint64_t remote_addr, uint32_t rkey, uint32_t imm, uint64_t wr_id) {
  return post_rdma(IBV_WR_RDMA_WRITE_WITH_IMM, local, offset, len, remote_addr, rkey, imm, wr_id, true);
}

Status QueuePair::post_write(const MemoryRegion& local, size_t offset, size_t len, uint64_t remote_addr,
                             uint32_t rkey, uint64_t wr_id, bool signaled) {
  return post_rdma(IBV_WR_RDMA_WRITE, local, offset, len, remote_addr, rkey, 0, wr_id, signaled);
}

Status QueuePair::post_recv(uint64_t wr_id) {
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  ibv_recv_wr* bad = nullptr;
  if (int rc = api_->post_recv(qp_.get(), &wr, &bad); rc != 0)
    return Status(Code::kFailedPrecondition, where() + ": post_recv refused: " + errno_text(rc));
  return Status::Ok();
}

Status QueuePair::check(const ibv_wc& wc) const {
  if (wc.status == IBV_WC_SUCCESS) return Status::Ok();
  const char* hint = wc.status == IBV_WC_RETRY_EXC_ERR       ? " (peer unreachable: link down or peer died)"
                     : wc.status == IBV_WC_RNR_RETRY_EXC_ERR ? " (peer posted no receive: credit bug?)"
                     : wc.status == IBV_WC_REM_ACCESS_ERR    ? " (bad rkey/bounds, or region not writable)"
                                                             : "";
  return Status(Code::kAborted, where() + ": wr_id " + std::to_string(wc.wr_id) + " failed: " +
                                    api_->wc_status_str(wc.status) + " (status " + std::to_string(wc.status) +
                                    ", vendor_err " + std::to_string(wc.vendor_err) + ")" + hint);
}

}  // namespace gradsync::verbs
