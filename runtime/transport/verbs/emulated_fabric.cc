// Test double: see emulated_fabric.h for what is and is not modelled.
#include "transport/verbs/emulated_fabric.h"

#include <arpa/inet.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace gradsync::verbs {
namespace {

// Limits reported by query_device / enforced by create_qp; mlx5-like orders of magnitude.
constexpr int kMaxQpWr = 32768;          // work requests per queue
constexpr int kMaxSge = 30;              // scatter/gather entries per work request
constexpr uint32_t kMaxInline = 256;     // bytes of inline send data
constexpr int kMaxCqe = 4194303;         // entries per CQ
constexpr uint16_t kFirstIbLid = 1;      // IB LIDs: 1 + device index * 16 + port
constexpr uint8_t kPhysLinkUp = 5;       // ibv_port_attr.phys_state "LinkUp"
constexpr uint8_t kPhysDisabled = 3;     // ibv_port_attr.phys_state "Disabled"
// reg_dmabuf_mr: the access flags the man page allows, and the highest user address of any
// Linux x86-64 (5-level paging) or arm64 process; an iova range above it cannot be memory here.
constexpr int kDmabufAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                              IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                              IBV_ACCESS_RELAXED_ORDERING;
constexpr uint64_t kUserAddressLimit = uint64_t{1} << 57;

struct Port {
  ibv_port_state state = IBV_PORT_ACTIVE;
  ibv_mtu mtu = IBV_MTU_4096;
  uint16_t lid = 0;
  LinkLayer link_layer = LinkLayer::kEthernet;
  std::vector<ibv_gid_entry> gids;
};
struct Device {
  ibv_device dev{};
  std::string name;
  std::vector<Port> ports;  // ports[i] is port i + 1
  bool dmabuf = true;       // reg_dmabuf_mr supported (set_dmabuf_supported)
};
struct Context {
  ibv_context ctx{};
  Device* device = nullptr;
};
struct Mr {
  ibv_mr mr{};
  int access = 0;
  uint64_t base = 0;           // address keys reach: addr for reg_mr, iova for reg_dmabuf_mr
  bool device_memory = false;  // made by reg_dmabuf_mr
};
struct Cq {
  ibv_cq cq{};
  std::deque<ibv_wc> wcs;
};
struct RecvWr {
  uint64_t wr_id = 0;
  std::vector<ibv_sge> sges;
};
struct Qp {
  ibv_qp qp{};
  ibv_qp_cap cap{};
  bool sig_all = false;
  uint8_t port = 0;
  int access = 0;
  uint32_t dest_qpn = 0;
  ibv_ah_attr ah{};
  std::deque<RecvWr> recvs;
};

struct Fabric {
  std::mutex mu;
  std::vector<std::unique_ptr<Device>> devices;
  std::map<ibv_device**, std::unique_ptr<std::vector<ibv_device*>>> lists;
  std::map<ibv_context*, std::unique_ptr<Context>> contexts;
  std::map<ibv_pd*, std::unique_ptr<ibv_pd>> pds;
  std::map<ibv_mr*, std::unique_ptr<Mr>> mrs;
  std::map<ibv_cq*, std::unique_ptr<Cq>> cqs;
  std::map<ibv_qp*, std::unique_ptr<Qp>> qps;
  uint32_t next_key = 0x1000;  // lkeys/rkeys: distinct, never reused in a process
  uint32_t next_qpn = 0x100;   // QPNs below 0x100 look like special QPs on real NICs
  uint32_t next_handle = 1;
  EmulatedFabric::Copier copier = nullptr;  // null: memmove
};

Fabric& fab() {
  static Fabric f;
  return f;
}

// Every byte the fabric moves goes through here (EmulatedFabric::set_copier).
void copy_bytes(void* dst, const void* src, size_t n) {
  if (n == 0) return;
  if (fab().copier) {
    fab().copier(dst, src, n);
  } else {
    std::memmove(dst, src, n);
  }
}

template <typename M, typename K>
auto* find(M& map, K* key) {
  auto it = map.find(key);
  return it == map.end() ? nullptr : it->second.get();
}

Port* port_of(ibv_context* ctx, uint8_t num) {
  Context* c = find(fab().contexts, ctx);
  if (c == nullptr || num == 0 || num > c->device->ports.size()) return nullptr;
  return &c->device->ports[num - 1];
}

ibv_gid_entry make_gid(uint32_t index, uint32_t port, ibv_gid_type type, const uint8_t raw[16]) {
  ibv_gid_entry e{};
  std::memcpy(e.gid.raw, raw, sizeof(e.gid.raw));
  e.gid_index = index;
  e.port_num = port;
  e.gid_type = type;
  return e;
}

int emu_post_send(ibv_qp*, ibv_send_wr*, ibv_send_wr**);
int emu_post_recv(ibv_qp*, ibv_recv_wr*, ibv_recv_wr**);
int emu_poll_cq(ibv_cq*, int, ibv_wc*);

// ---- devices -----------------------------------------------------------------------------
ibv_device** emu_get_device_list(int* num) {
  std::lock_guard lock(fab().mu);
  auto list = std::make_unique<std::vector<ibv_device*>>();
  for (auto& d : fab().devices) list->push_back(&d->dev);
  if (num) *num = static_cast<int>(list->size());
  list->push_back(nullptr);
  ibv_device** data = list->data();
  fab().lists.emplace(data, std::move(list));
  return data;
}
void emu_free_device_list(ibv_device** list) {
  std::lock_guard lock(fab().mu);
  fab().lists.erase(list);
}
const char* emu_get_device_name(ibv_device* dev) { return dev->name; }

ibv_context* emu_open_device(ibv_device* dev) {
  std::lock_guard lock(fab().mu);
  for (auto& d : fab().devices) {
    if (&d->dev != dev) continue;
    auto c = std::make_unique<Context>();
    c->device = d.get();
    c->ctx.device = dev;
    c->ctx.cmd_fd = -1;
    c->ctx.async_fd = -1;
    c->ctx.num_comp_vectors = 1;
    // So verbs.h's inline ibv_post_send & co also work on emulated objects.
    c->ctx.ops.post_send = &emu_post_send;
    c->ctx.ops.post_recv = &emu_post_recv;
    c->ctx.ops.poll_cq = &emu_poll_cq;
    ibv_context* key = &c->ctx;
    fab().contexts.emplace(key, std::move(c));
    return key;
  }
  errno = ENODEV;
  return nullptr;
}
int emu_close_device(ibv_context* ctx) {
  std::lock_guard lock(fab().mu);
  for (auto& [pd, p] : fab().pds) if (p->context == ctx) return EBUSY;
  for (auto& [cq, c] : fab().cqs) if (c->cq.context == ctx) return EBUSY;
  return fab().contexts.erase(ctx) ? 0 : EINVAL;
}
int emu_query_device(ibv_context* ctx, ibv_device_attr* attr) {
  std::lock_guard lock(fab().mu);
  Context* c = find(fab().contexts, ctx);
  if (c == nullptr) return EINVAL;
  *attr = ibv_device_attr{};
  std::snprintf(attr->fw_ver, sizeof(attr->fw_ver), "emulated");
  attr->max_mr_size = UINT64_MAX;
  attr->max_qp = 1 << 16;
  attr->max_qp_wr = kMaxQpWr;
  attr->max_sge = kMaxSge;
  attr->max_cq = 1 << 16;
  attr->max_cqe = kMaxCqe;
  attr->max_mr = 1 << 20;
  attr->max_pd = 1 << 16;
  attr->phys_port_cnt = static_cast<uint8_t>(c->device->ports.size());
  return 0;
}
int emu_query_port(ibv_context* ctx, uint8_t num, ibv_port_attr* attr) {
  std::lock_guard lock(fab().mu);
  Port* p = port_of(ctx, num);
  if (p == nullptr) return EINVAL;
  *attr = ibv_port_attr{};
  attr->state = p->state;
  attr->max_mtu = IBV_MTU_4096;
  attr->active_mtu = p->mtu;
  attr->gid_tbl_len = static_cast<int>(p->gids.size());
  attr->lid = p->lid;
  attr->phys_state = p->state == IBV_PORT_ACTIVE ? kPhysLinkUp : kPhysDisabled;
  attr->link_layer = p->link_layer == LinkLayer::kEthernet ? IBV_LINK_LAYER_ETHERNET
                                                           : IBV_LINK_LAYER_INFINIBAND;
  return 0;
}
int emu_query_gid(ibv_context* ctx, uint8_t num, int index, ibv_gid* gid) {
  std::lock_guard lock(fab().mu);
  Port* p = port_of(ctx, num);
  if (p == nullptr || index < 0 || static_cast<size_t>(index) >= p->gids.size()) return EINVAL;
  *gid = p->gids[index].gid;
  return 0;
}
int emu_query_gid_ex(ibv_context* ctx, uint32_t num, uint32_t index, ibv_gid_entry* e, uint32_t) {
  std::lock_guard lock(fab().mu);
  Port* p = num > UINT8_MAX ? nullptr : port_of(ctx, static_cast<uint8_t>(num));
  if (p == nullptr || index >= p->gids.size()) return EINVAL;
  *e = p->gids[index];
  return 0;
}

// ---- PD, MR, CQ --------------------------------------------------------------------------
ibv_pd* emu_alloc_pd(ibv_context* ctx) {
  std::lock_guard lock(fab().mu);
  if (find(fab().contexts, ctx) == nullptr) { errno = EINVAL; return nullptr; }
  auto pd = std::make_unique<ibv_pd>();
  pd->context = ctx;
  pd->handle = fab().next_handle++;
  ibv_pd* key = pd.get();
  fab().pds.emplace(key, std::move(pd));
  return key;
}
int emu_dealloc_pd(ibv_pd* pd) {
  std::lock_guard lock(fab().mu);
  for (auto& [k, m] : fab().mrs) if (m->mr.pd == pd) return EBUSY;
  for (auto& [k, q] : fab().qps) if (q->qp.pd == pd) return EBUSY;
  return fab().pds.erase(pd) ? 0 : EINVAL;
}
ibv_mr* emu_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  std::lock_guard lock(fab().mu);
  // As in rdma-core: remote write needs local write.
  bool bad_access = (access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE);
  if (find(fab().pds, pd) == nullptr || addr == nullptr || length == 0 || bad_access) {
    errno = EINVAL;
    return nullptr;
  }
  auto m = std::make_unique<Mr>();
  m->mr = ibv_mr{pd->context, pd, addr, length, fab().next_handle++, fab().next_key,
                 fab().next_key + 1};
  fab().next_key += 2;
  m->access = access;
  m->base = reinterpret_cast<uint64_t>(addr);
  ibv_mr* key = &m->mr;
  fab().mrs.emplace(key, std::move(m));
  return key;
}
// See "dma-buf MRs" in emulated_fabric.h for what is checked and why iova is the address.
ibv_mr* emu_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                          int access) {
  std::lock_guard lock(fab().mu);
  // A provider without dma-buf support answers so whatever the fd (doctor's probe uses -1).
  if (find(fab().pds, pd) != nullptr) {
    if (Context* c = find(fab().contexts, pd->context); c != nullptr && !c->device->dmabuf) {
      errno = EOPNOTSUPP;
      return nullptr;
    }
  }
  struct stat st{};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    errno = EBADF;
    return nullptr;
  }
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const bool bad_access = (access & ~kDmabufAccess) != 0 ||
                          ((access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE));
  const bool beyond_fd = offset > UINT64_MAX - length ||
                         (st.st_size > 0 && offset + length > static_cast<uint64_t>(st.st_size));
  const bool bad_iova = iova == 0 || iova > kUserAddressLimit || length > kUserAddressLimit - iova;
  if (find(fab().pds, pd) == nullptr || length == 0 || bad_access || iova % page != offset % page ||
      beyond_fd || bad_iova) {
    errno = EINVAL;
    return nullptr;
  }
  auto m = std::make_unique<Mr>();
  // rdma-core's ibv_reg_dmabuf_mr stores the dma-buf offset in addr, not iova.
  m->mr = ibv_mr{pd->context, pd, reinterpret_cast<void*>(static_cast<uintptr_t>(offset)), length,
                 fab().next_handle++, fab().next_key, fab().next_key + 1};
  fab().next_key += 2;
  m->access = access;
  m->base = iova;
  m->device_memory = true;
  ibv_mr* key = &m->mr;
  fab().mrs.emplace(key, std::move(m));
  return key;
}
int emu_dereg_mr(ibv_mr* mr) {
  std::lock_guard lock(fab().mu);
  return fab().mrs.erase(mr) ? 0 : EINVAL;
}
ibv_cq* emu_create_cq(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* ch, int) {
  std::lock_guard lock(fab().mu);
  if (find(fab().contexts, ctx) == nullptr || cqe <= 0 || cqe > kMaxCqe || ch != nullptr) {
    errno = EINVAL;
    return nullptr;
  }
  auto c = std::make_unique<Cq>();
  c->cq.context = ctx;
  c->cq.cq_context = cq_context;
  c->cq.cqe = cqe;
  c->cq.handle = fab().next_handle++;
  ibv_cq* key = &c->cq;
  fab().cqs.emplace(key, std::move(c));
  return key;
}
int emu_destroy_cq(ibv_cq* cq) {
  std::lock_guard lock(fab().mu);
  for (auto& [k, q] : fab().qps)
    if (q->qp.send_cq == cq || q->qp.recv_cq == cq) return EBUSY;
  return fab().cqs.erase(cq) ? 0 : EINVAL;
}
int emu_poll_cq(ibv_cq* cq, int n, ibv_wc* wc) {
  std::lock_guard lock(fab().mu);
  Cq* c = find(fab().cqs, cq);
  if (c == nullptr || n < 0) return -EINVAL;
  int got = 0;
  while (got < n && !c->wcs.empty()) {
    wc[got++] = c->wcs.front();
    c->wcs.pop_front();
  }
  return got;
}

// ---- QPs ---------------------------------------------------------------------------------
void push_wc(ibv_cq* cq, const ibv_wc& wc) {
  if (Cq* c = find(fab().cqs, cq)) c->wcs.push_back(wc);
}
ibv_wc make_wc(uint64_t wr_id, ibv_wc_status status, ibv_wc_opcode op, uint32_t qpn) {
  ibv_wc wc{};
  wc.wr_id = wr_id;
  wc.status = status;
  wc.opcode = op;
  wc.qp_num = qpn;
  return wc;
}
// ERROR: every posted receive completes with WR_FLUSH_ERR, in order.
void enter_error(Qp& q) {
  q.qp.state = IBV_QPS_ERR;
  for (auto& r : q.recvs)
    push_wc(q.qp.recv_cq, make_wc(r.wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, q.qp.qp_num));
  q.recvs.clear();
}

ibv_qp* emu_create_qp(ibv_pd* pd, ibv_qp_init_attr* a) {
  std::lock_guard lock(fab().mu);
  if (a->qp_type != IBV_QPT_RC) { errno = EOPNOTSUPP; return nullptr; }
  bool caps_ok = a->cap.max_send_wr <= kMaxQpWr && a->cap.max_recv_wr <= kMaxQpWr &&
                 a->cap.max_send_sge <= kMaxSge && a->cap.max_recv_sge <= kMaxSge &&
                 a->cap.max_inline_data <= kMaxInline;
  if (find(fab().pds, pd) == nullptr || find(fab().cqs, a->send_cq) == nullptr ||
      find(fab().cqs, a->recv_cq) == nullptr || a->srq != nullptr || !caps_ok) {
    errno = EINVAL;
    return nullptr;
  }
  auto q = std::make_unique<Qp>();
  q->qp.context = pd->context;
  q->qp.qp_context = a->qp_context;
  q->qp.pd = pd;
  q->qp.send_cq = a->send_cq;
  q->qp.recv_cq = a->recv_cq;
  q->qp.handle = fab().next_handle++;
  q->qp.qp_num = fab().next_qpn++;
  q->qp.state = IBV_QPS_RESET;
  q->qp.qp_type = IBV_QPT_RC;
  q->cap = a->cap;
  q->sig_all = a->sq_sig_all != 0;
  ibv_qp* key = &q->qp;
  fab().qps.emplace(key, std::move(q));
  return key;
}
int emu_destroy_qp(ibv_qp* qp) {
  std::lock_guard lock(fab().mu);
  return fab().qps.erase(qp) ? 0 : EINVAL;
}

bool has(int mask, int required) { return (mask & required) == required; }

int emu_modify_qp(ibv_qp* qp, ibv_qp_attr* a, int mask) {
  std::lock_guard lock(fab().mu);
  Qp* q = find(fab().qps, qp);
  if (q == nullptr || !(mask & IBV_QP_STATE)) return EINVAL;
  const ibv_qp_state cur = q->qp.state;
  switch (a->qp_state) {
    case IBV_QPS_RESET:
      q->recvs.clear();
      q->qp.state = IBV_QPS_RESET;
      return 0;
    case IBV_QPS_ERR:
      enter_error(*q);
      return 0;
    case IBV_QPS_INIT: {
      if (cur != IBV_QPS_RESET && cur != IBV_QPS_INIT) return EINVAL;
      if (!has(mask, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) ||
          port_of(qp->context, a->port_num) == nullptr)
        return EINVAL;
      q->port = a->port_num;
      q->access = static_cast<int>(a->qp_access_flags);
      q->qp.state = IBV_QPS_INIT;
      return 0;
    }
    case IBV_QPS_RTR: {
      constexpr int kRtr = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
      if (cur != IBV_QPS_INIT || !has(mask, kRtr)) return EINVAL;
      Port* p = port_of(qp->context, q->port);
      const ibv_ah_attr& ah = a->ah_attr;
      if (a->path_mtu > p->mtu || ah.port_num != q->port) return EINVAL;
      if (ah.is_global ? ah.grh.sgid_index >= p->gids.size()
                       : (p->link_layer == LinkLayer::kEthernet || ah.dlid == 0))
        return EINVAL;  // RoCE always needs a GRH; IB without GRH needs a LID
      q->dest_qpn = a->dest_qp_num;
      q->ah = ah;
      q->qp.state = IBV_QPS_RTR;
      return 0;
    }
    case IBV_QPS_RTS: {
      constexpr int kRts = IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                           IBV_QP_MAX_QP_RD_ATOMIC;
      if (cur == IBV_QPS_RTS) return 0;
      if (cur != IBV_QPS_RTR || !has(mask, kRts)) return EINVAL;
      q->qp.state = IBV_QPS_RTS;
      return 0;
    }
    default:
      return EINVAL;
  }
}

// The MR of `pd` with `key` (lkey or rkey) covering [addr, addr + len), or null.
Mr* find_mr(ibv_pd* pd, uint32_t key, bool remote, uint64_t addr, uint64_t len) {
  for (auto& [k, m] : fab().mrs) {
    if (m->mr.pd != pd || (remote ? m->mr.rkey : m->mr.lkey) != key) continue;
    const uint64_t base = m->base;
    bool inside = addr >= base && len <= m->mr.length && addr - base <= m->mr.length - len;
    return inside ? m.get() : nullptr;
  }
  return nullptr;
}

// The connected peer QP, reachable over up links, addressed as set at RTR; else null.
Qp* resolve_peer(const Qp& q) {
  Port* lp = port_of(q.qp.context, q.port);
  if (lp == nullptr || lp->state != IBV_PORT_ACTIVE) return nullptr;
  for (auto& [k, r] : fab().qps) {
    if (r->qp.qp_num != q.dest_qpn) continue;
    Port* rp = port_of(r->qp.context, r->port);
    if (rp == nullptr || rp->state != IBV_PORT_ACTIVE || r->dest_qpn != q.qp.qp_num) return nullptr;
    if (r->qp.state != IBV_QPS_RTR && r->qp.state != IBV_QPS_RTS) return nullptr;
    bool addressed = false;
    if (q.ah.is_global) {
      for (auto& g : rp->gids)
        addressed |= std::memcmp(g.gid.raw, q.ah.grh.dgid.raw, sizeof(g.gid.raw)) == 0;
    } else {
      addressed = rp->link_layer == LinkLayer::kInfiniBand && rp->lid == q.ah.dlid;
    }
    return addressed ? r.get() : nullptr;
  }
  return nullptr;
}

// Executes one send WR against the fabric; returns the sender's completion status.
ibv_wc_status execute(Qp& q, const ibv_send_wr& wr) {
  const bool inl = wr.send_flags & IBV_SEND_INLINE;
  size_t total = 0;  // payload bytes over all SGEs
  for (int i = 0; i < wr.num_sge; ++i) {
    const ibv_sge& s = wr.sg_list[i];
    if (!inl && find_mr(q.qp.pd, s.lkey, false, s.addr, s.length) == nullptr)
      return IBV_WC_LOC_PROT_ERR;
    total += s.length;
  }
  Qp* r = resolve_peer(q);
  if (r == nullptr) return IBV_WC_RETRY_EXC_ERR;
  const bool write = wr.opcode == IBV_WR_RDMA_WRITE || wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
  const bool imm = wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM || wr.opcode == IBV_WR_SEND_WITH_IMM;
  if (write) {
    Mr* m = find_mr(r->qp.pd, wr.wr.rdma.rkey, true, wr.wr.rdma.remote_addr, total);
    if (m == nullptr || !(m->access & IBV_ACCESS_REMOTE_WRITE) ||
        !(r->access & IBV_ACCESS_REMOTE_WRITE))
      return IBV_WC_REM_ACCESS_ERR;
  }
  const bool consumes_recv = imm || !write;
  if (consumes_recv && r->recvs.empty()) return IBV_WC_RNR_RETRY_EXC_ERR;
  if (write) {
    // Straight from each local SGE into the remote MR (one copy, device to device for GPU MRs).
    uint64_t dst = wr.wr.rdma.remote_addr;
    for (int i = 0; i < wr.num_sge; ++i) {
      const ibv_sge& s = wr.sg_list[i];
      copy_bytes(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(s.addr), s.length);
      dst += s.length;
    }
  } else {
    std::vector<uint8_t> data(total);  // gathered payload
    size_t at = 0;
    for (int i = 0; i < wr.num_sge; ++i) {
      const ibv_sge& s = wr.sg_list[i];
      copy_bytes(data.data() + at, reinterpret_cast<const void*>(s.addr), s.length);
      at += s.length;
    }
    size_t off = 0;
    for (const ibv_sge& s : r->recvs.front().sges) {
      if (off == data.size()) break;
      size_t n = std::min<size_t>(s.length, data.size() - off);
      if (find_mr(r->qp.pd, s.lkey, false, s.addr, n) == nullptr) off = SIZE_MAX;
      if (off == SIZE_MAX) break;
      copy_bytes(reinterpret_cast<void*>(s.addr), data.data() + off, n);
      off += n;
    }
    if (off != data.size()) {  // receive buffer too small or not registered
      RecvWr rw = r->recvs.front();
      r->recvs.pop_front();
      push_wc(r->qp.recv_cq, make_wc(rw.wr_id, IBV_WC_LOC_LEN_ERR, IBV_WC_RECV, r->qp.qp_num));
      enter_error(*r);
      return IBV_WC_REM_INV_REQ_ERR;
    }
  }
  if (consumes_recv) {
    RecvWr rw = r->recvs.front();
    r->recvs.pop_front();
    ibv_wc wc = make_wc(rw.wr_id, IBV_WC_SUCCESS,
                        write ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV, r->qp.qp_num);
    wc.byte_len = static_cast<uint32_t>(total);
    wc.src_qp = q.qp.qp_num;
    if (imm) {
      wc.wc_flags = IBV_WC_WITH_IMM;
      wc.imm_data = wr.imm_data;  // network byte order, passed through as on the wire
    }
    push_wc(r->qp.recv_cq, wc);
  }
  return IBV_WC_SUCCESS;
}

int emu_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  std::lock_guard lock(fab().mu);
  Qp* q = find(fab().qps, qp);
  if (q == nullptr) {
    if (bad_wr) *bad_wr = wr;
    return EINVAL;
  }
  for (; wr != nullptr; wr = wr->next) {
    bool known = wr->opcode == IBV_WR_RDMA_WRITE || wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM ||
                 wr->opcode == IBV_WR_SEND || wr->opcode == IBV_WR_SEND_WITH_IMM;
    size_t inline_len = 0;
    for (int i = 0; i < wr->num_sge; ++i) inline_len += wr->sg_list[i].length;
    bool fits = wr->num_sge >= 0 && static_cast<uint32_t>(wr->num_sge) <= q->cap.max_send_sge &&
                (!(wr->send_flags & IBV_SEND_INLINE) || inline_len <= q->cap.max_inline_data);
    // A QP that has not reached RTS refuses the post itself (ERROR accepts it, then flushes).
    if (!known || !fits ||
        (q->qp.state != IBV_QPS_RTS && q->qp.state != IBV_QPS_ERR)) {
      if (bad_wr) *bad_wr = wr;
      return EINVAL;
    }
    const bool is_write = wr->opcode == IBV_WR_RDMA_WRITE || wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
    ibv_wc_status st = q->qp.state == IBV_QPS_ERR ? IBV_WC_WR_FLUSH_ERR : execute(*q, *wr);
    // The failed WR completes first, then the QP's receives are flushed (as a NIC reports it:
    // with one CQ for both, the cause comes before its consequences).
    if (st != IBV_WC_SUCCESS || q->sig_all || (wr->send_flags & IBV_SEND_SIGNALED))
      push_wc(q->qp.send_cq, make_wc(wr->wr_id, st, is_write ? IBV_WC_RDMA_WRITE : IBV_WC_SEND,
                                     q->qp.qp_num));
    if (st != IBV_WC_SUCCESS && st != IBV_WC_WR_FLUSH_ERR) enter_error(*q);
  }
  return 0;
}

int emu_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  std::lock_guard lock(fab().mu);
  Qp* q = find(fab().qps, qp);
  for (; wr != nullptr; wr = wr->next) {
    if (q == nullptr || q->qp.state == IBV_QPS_RESET || wr->num_sge < 0 ||
        static_cast<uint32_t>(wr->num_sge) > q->cap.max_recv_sge ||
        q->recvs.size() >= q->cap.max_recv_wr) {
      if (bad_wr) *bad_wr = wr;
      return q == nullptr || q->qp.state == IBV_QPS_RESET ? EINVAL : ENOMEM;
    }
    if (q->qp.state == IBV_QPS_ERR) {
      push_wc(q->qp.recv_cq, make_wc(wr->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, q->qp.qp_num));
      continue;
    }
    q->recvs.push_back(RecvWr{wr->wr_id, std::vector<ibv_sge>(wr->sg_list, wr->sg_list + wr->num_sge)});
  }
  return 0;
}

// Same wording as rdma-core's ibv_wc_status_str for the statuses this fabric produces.
const char* emu_wc_status_str(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request error";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    default: return "unknown";
  }
}

}  // namespace

EmulatedFabric& EmulatedFabric::instance() {
  static EmulatedFabric f;
  return f;
}

void EmulatedFabric::add_device(const std::string& name, int num_ports, LinkLayer link_layer) {
  std::lock_guard lock(fab().mu);
  auto d = std::make_unique<Device>();
  d->name = name;
  std::snprintf(d->dev.name, sizeof(d->dev.name), "%s", name.c_str());
  std::snprintf(d->dev.dev_name, sizeof(d->dev.dev_name), "uverbs%zu", fab().devices.size());
  d->dev.node_type = IBV_NODE_CA;
  d->dev.transport_type = IBV_TRANSPORT_IB;
  const auto dev_index = static_cast<uint8_t>(fab().devices.size());
  for (int i = 1; i <= num_ports; ++i) {
    Port p;
    p.link_layer = link_layer;
    const auto port = static_cast<uint8_t>(i);
    // fe80::<dev>:<port> link-local, and ::ffff:10.<dev>.<port>.1 IPv4-mapped.
    const uint8_t ll[16] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, dev_index, port};
    const uint8_t v4[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, dev_index, port, 1};
    if (link_layer == LinkLayer::kEthernet) {
      p.mtu = IBV_MTU_1024;  // a 1500-byte Ethernet MTU leaves 1024 for RoCE payload
      p.gids = {make_gid(0, i, IBV_GID_TYPE_ROCE_V1, ll), make_gid(1, i, IBV_GID_TYPE_ROCE_V2, ll),
                make_gid(2, i, IBV_GID_TYPE_ROCE_V1, v4), make_gid(3, i, IBV_GID_TYPE_ROCE_V2, v4)};
    } else {
      p.lid = static_cast<uint16_t>(kFirstIbLid + dev_index * 16 + i);
      p.gids = {make_gid(0, i, IBV_GID_TYPE_IB, ll)};
    }
    d->ports.push_back(p);
  }
  fab().devices.push_back(std::move(d));
}

void EmulatedFabric::set_link_state(const std::string& device, uint8_t port, bool up) {
  std::lock_guard lock(fab().mu);
  for (auto& d : fab().devices)
    if (d->name == device && port >= 1 && port <= d->ports.size())
      d->ports[port - 1].state = up ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
}

void EmulatedFabric::set_dmabuf_supported(const std::string& device, bool supported) {
  std::lock_guard lock(fab().mu);
  for (auto& d : fab().devices)
    if (d->name == device) d->dmabuf = supported;
}

void EmulatedFabric::force_qp_error(ibv_qp* qp) {
  std::lock_guard lock(fab().mu);
  if (Qp* q = find(fab().qps, qp)) enter_error(*q);
}

int EmulatedFabric::force_device_qp_errors(const std::string& device) {
  std::lock_guard lock(fab().mu);
  int n = 0;
  for (auto& [raw, q] : fab().qps) {
    Context* c = find(fab().contexts, raw->context);
    if (c == nullptr || c->device->name != device || q->qp.state == IBV_QPS_ERR) continue;
    enter_error(*q);
    ++n;
  }
  return n;
}

std::vector<EmulatedFabric::RemoteWindow> EmulatedFabric::remote_windows(const std::string& device) {
  std::lock_guard lock(fab().mu);
  std::vector<RemoteWindow> out;
  for (auto& [raw, m] : fab().mrs) {
    ibv_pd* pd = m->mr.pd;
    Context* c = pd ? find(fab().contexts, pd->context) : nullptr;
    if (c == nullptr || c->device->name != device || !(m->access & IBV_ACCESS_REMOTE_WRITE)) continue;
    out.push_back({m->base, m->mr.length, m->mr.rkey});
  }
  return out;
}

std::vector<ibv_qp*> EmulatedFabric::sending_qps(const std::string& device) {
  std::lock_guard lock(fab().mu);
  std::vector<ibv_qp*> out;
  for (auto& [raw, q] : fab().qps) {
    Context* c = find(fab().contexts, raw->context);
    if (c != nullptr && c->device->name == device && q->qp.state == IBV_QPS_RTS) out.push_back(raw);
  }
  return out;
}

ibv_qp_state EmulatedFabric::qp_state(ibv_qp* qp) {
  std::lock_guard lock(fab().mu);
  Qp* q = find(fab().qps, qp);
  return q ? q->qp.state : IBV_QPS_UNKNOWN;
}

void EmulatedFabric::reset() {
  std::lock_guard lock(fab().mu);
  fab().devices.clear();
}

void EmulatedFabric::set_copier(Copier copier) {
  std::lock_guard lock(fab().mu);
  fab().copier = copier;
}

bool EmulatedFabric::is_device_memory(ibv_mr* mr) {
  std::lock_guard lock(fab().mu);
  Mr* m = find(fab().mrs, mr);
  return m != nullptr && m->device_memory;
}

const IbvApi* emulated_ibv() {
  static const IbvApi api = {
      "emulated",       &emu_get_device_list, &emu_free_device_list, &emu_get_device_name,
      &emu_open_device, &emu_close_device,    &emu_query_device,     &emu_query_port,
      &emu_query_gid,   &emu_query_gid_ex,    &emu_alloc_pd,         &emu_dealloc_pd,
      &emu_reg_mr,      &emu_dereg_mr,        &emu_create_cq,        &emu_destroy_cq,
      &emu_create_qp,   &emu_destroy_qp,      &emu_modify_qp,        &emu_wc_status_str,
      &emu_post_send,   &emu_post_recv,       &emu_poll_cq,
      &emu_reg_dmabuf_mr, nullptr,
  };
  return &api;
}

}  // namespace gradsync::verbs
