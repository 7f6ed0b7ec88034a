#include "gpu/gdr_link.h"

#include <arpa/inet.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "common/log.h"
#include "transport/verbs/emulated_fabric.h"
#include "transport/verbs/node.h"

namespace gradsync {
namespace {

using Clock = std::chrono::steady_clock;

// Host memory registered with the NIC: the next rank writes its `consumed` into `credit`;
// `credit_src` is the source of our own credit write to the previous rank (left untouched
// while that write is in flight).
struct alignas(64) CreditWords {
  uint64_t credit;
  uint64_t credit_src;
};

// One rank's row of the set-up exchange (summed as bytes over ranks; other rows are zero).
struct GdrBlob {
  uint32_t qpn_next = 0;  // our QP to the next rank (it connects its "from previous" QP to it)
  uint32_t qpn_prev = 0;  // our QP from the previous rank
  uint32_t psn = 0;       // both our QPs' initial send PSN (24 bits)
  uint32_t lid = 0;
  uint32_t mtu = 0;
  uint32_t slot_rkey = 0;
  uint32_t credit_rkey = 0;
  uint32_t pad = 0;
  uint64_t recv_slots = 0;   // address of receive slot 0
  uint64_t credit_addr = 0;  // host address of CreditWords::credit
  uint8_t gid[16] = {};
};

constexpr uint64_t kCreditWr = uint64_t(1) << 63;  // wr_id bit of credit writes

template <class T>
T load(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

}  // namespace

struct GdrLink::Impl {
  GdrLinkConfig cfg;
  GdrLinkOps ops;
  std::function<Status()> flush;
  std::string description;
  int next = 0, prev = 0;  // world ranks
  int position = 0;        // in cfg.ring

  std::shared_ptr<VerbsNode> node;
  GdrRegion region;
  CreditWords* credit = nullptr;
  verbs::MemoryRegion credit_mr;
  verbs::CompletionQueue cq;
  verbs::QueuePair qp_next, qp_prev;
  GdrWords* words = nullptr;

  // The next rank's receive slots and the previous rank's credit word.
  uint64_t peer_slots = 0;
  uint32_t peer_slot_rkey = 0;
  uint64_t peer_credit = 0;
  uint32_t peer_credit_rkey = 0;

  // The worker's plan: message lengths in order, appended by plan().
  mutable std::mutex mu;
  std::deque<uint32_t> send_len, recv_len;  // of messages not yet completed / arrived
  uint64_t planned_sends = 0, planned_recvs = 0;
  Status error;

  std::atomic<bool> stop{false};
  std::atomic<bool> draining{false};
  std::thread worker;

  // Worker state.
  uint64_t posted = 0, completed = 0, arrived = 0;
  uint64_t credit_sent = 0;
  bool credit_inflight = false;
  std::deque<uint32_t> landed;  // lengths of receives completed but not yet planned

  uint8_t* slot(bool recv_side, uint64_t msg) const {
    return region.base + (recv_side ? cfg.slots : 0) * cfg.slot_bytes + size_t(msg % cfg.slots) * cfg.slot_bytes;
  }
  std::string peer_name(int r) const {
    return "rank " + std::to_string(r) +
           (size_t(r) < cfg.hosts.size() ? " (host " + cfg.hosts[r] + ")" : std::string());
  }

  Status setup_local(const GdrRegionMaker& make_region);
  void run();
  void fail(Status s);
};

// Everything this rank can do alone: device, region, credit word, CQ, QPs (to INIT).
Status GdrLink::Impl::setup_local(const GdrRegionMaker& make_region) {
  if (cfg.verbs_device.empty()) {
    return {Code::kUnavailable, "this node's gradsyncd runs no verbs channels (its transport is tcp)"};
  }
  const verbs::IbvApi* api = nullptr;
  if (cfg.verbs_api == verbs::emulated_ibv()->name) {
    api = verbs::emulated_ibv();
  } else {
    auto loaded = verbs::load_libibverbs();
    if (!loaded.ok()) return loaded.status();
    api = *loaded;
  }
  auto opened = VerbsNode::open(api, cfg.verbs_device, uint8_t(cfg.verbs_port), cfg.gid_index);
  if (!opened.ok()) {
    return {opened.status().code(), "the daemon's RDMA device " + cfg.verbs_device + ": " +
                                        opened.status().message()};
  }
  node = std::move(opened).value();
  auto reg = make_region(node->pd(), 2 * size_t(cfg.slots) * cfg.slot_bytes);
  if (!reg.ok()) return reg.status();
  region = std::move(reg).value();

  void* c = nullptr;
  if (::posix_memalign(&c, 4096, 4096) != 0) return {Code::kInternal, "posix_memalign"};
  std::memset(c, 0, 4096);
  credit = static_cast<CreditWords*>(c);
  auto cmr = verbs::MemoryRegion::create(node->pd(), credit, sizeof(CreditWords),
                                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!cmr.ok()) return cmr.status();
  credit_mr = std::move(cmr).value();

  // One CQ for both QPs: at most `slots` data writes and one credit write signaled at a time,
  // and `slots` receives posted; twice that so it can never overrun.
  auto q = verbs::CompletionQueue::create(node->context(), int(4 * cfg.slots + 8));
  if (!q.ok()) return q.status();
  cq = std::move(q).value();
  verbs::QpCaps caps;
  caps.max_send_wr = cfg.slots + 2;  // data writes (next) or credit writes (prev), + slack
  caps.max_recv_wr = cfg.slots;      // one per receive slot
  auto a = verbs::QueuePair::create_rc(node->pd(), cq, cq, caps, "next " + peer_name(next));
  if (!a.ok()) return a.status();
  qp_next = std::move(a).value();
  auto b = verbs::QueuePair::create_rc(node->pd(), cq, cq, caps, "previous " + peer_name(prev));
  if (!b.ok()) return b.status();
  qp_prev = std::move(b).value();
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  GS_RETURN_IF_ERROR(qp_next.to_init(node->port(), access));
  GS_RETURN_IF_ERROR(qp_prev.to_init(node->port(), access));
  return Status::Ok();
}

GdrLink::GdrLink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GdrLink::~GdrLink() {
  Impl& m = *impl_;
  m.stop.store(true, std::memory_order_release);
  if (m.worker.joinable()) m.worker.join();
  // Verbs objects in order (QPs, CQ, MRs) before the memory they name and the PD.
  m.qp_prev = {};
  m.qp_next = {};
  m.cq = {};
  m.credit_mr = {};
  m.region = {};
  std::free(m.credit);
}

Result<std::unique_ptr<GdrLink>> GdrLink::create(const GdrLinkConfig& cfg, const GdrLinkOps& ops,
                                                 const GdrRegionMaker& make_region, GdrWords* words,
                                                 std::function<Status()> flush, std::string* why_not) {
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.cfg = cfg;
  m.ops = ops;
  m.words = words;
  m.flush = std::move(flush);
  const int n = cfg.world_size, me = cfg.rank;
  if (m.cfg.ring.empty()) {
    for (int r = 0; r < n; ++r) m.cfg.ring.push_back(r);
  }
  const std::vector<int>& ring = m.cfg.ring;
  const auto at = std::find(ring.begin(), ring.end(), me);
  if (at == ring.end() || ring.size() < 2 ||
      std::any_of(ring.begin(), ring.end(), [&](int r) { return r < 0 || r >= n; })) {
    return Status(Code::kInternal, cfg.who + ": a GPUDirect RDMA ring of " + std::to_string(ring.size()) +
                                       " ranks that does not hold rank " + std::to_string(me) +
                                       " once among " + std::to_string(n));
  }
  m.position = int(at - ring.begin());
  const int k = int(ring.size());
  m.next = ring[size_t((m.position + 1) % k)];
  m.prev = ring[size_t((m.position + k - 1) % k)];
  std::unique_ptr<GdrLink> link(new GdrLink(std::move(impl)));

  // Round 1: can every rank set up? The failing ranks are named to all.
  Status local = m.setup_local(make_region);
  std::vector<int32_t> bad(n, 0);
  bad[me] = local.ok() ? 0 : 1;
  GS_RETURN_IF_ERROR(ops.allreduce_now(bad.data(), bad.data(), n, DataType::kInt32, ReduceOp::kSum));
  auto failing = [&] {
    std::string who;
    for (int r = 0; r < n; ++r) {
      if (bad[r] != 0) who += (who.empty() ? "" : ", ") + m.peer_name(r);
    }
    return who;
  };
  if (!local.ok()) {
    *why_not = "GPUDirect RDMA: " + local.message();
    return std::unique_ptr<GdrLink>();
  }
  if (std::count(bad.begin(), bad.end(), 1) > 0) {
    *why_not = "GPUDirect RDMA is not possible on " + failing() + " (see its log)";
    return std::unique_ptr<GdrLink>();
  }

  // Round 2: the blobs.
  std::vector<GdrBlob> table(n);  // value-initialized: zero rows
  GdrBlob& mine = table[me];
  mine.qpn_next = m.qp_next.qpn();
  mine.qpn_prev = m.qp_prev.qpn();
  mine.psn = std::random_device{}() & 0xffffff;
  mine.lid = m.node->port_info().lid;
  mine.mtu = uint32_t(m.node->port_info().active_mtu);
  mine.slot_rkey = m.region.mr->rkey();
  mine.credit_rkey = m.credit_mr.rkey();
  mine.recv_slots = reinterpret_cast<uint64_t>(m.slot(true, 0));
  mine.credit_addr = reinterpret_cast<uint64_t>(&m.credit->credit);
  std::memcpy(mine.gid, m.node->gid().raw, sizeof(mine.gid));
  GS_RETURN_IF_ERROR(ops.allreduce_now(table.data(), table.data(), n * sizeof(GdrBlob),
                                       DataType::kUInt8, ReduceOp::kSum));
  auto address = [&](const GdrBlob& b, uint32_t qpn) {
    verbs::PeerAddress p;
    p.qpn = qpn;
    p.psn = b.psn;
    p.lid = uint16_t(b.lid);
    std::memcpy(p.gid.raw, b.gid, sizeof(b.gid));
    p.mtu = static_cast<ibv_mtu>(b.mtu);
    return p;
  };
  const GdrBlob& nb = table[m.next];
  const GdrBlob& pb = table[m.prev];
  m.peer_slots = nb.recv_slots;
  m.peer_slot_rkey = nb.slot_rkey;
  m.peer_credit = pb.credit_addr;
  m.peer_credit_rkey = pb.credit_rkey;
  const ibv_mtu mtu = m.node->port_info().active_mtu;
  const int sgid = m.node->sgid_index();
  Status conn = m.qp_next.to_rtr(address(nb, nb.qpn_prev), mtu, sgid);
  if (conn.ok()) conn = m.qp_next.to_rts(mine.psn);
  if (conn.ok()) conn = m.qp_prev.to_rtr(address(pb, pb.qpn_next), mtu, sgid);
  if (conn.ok()) conn = m.qp_prev.to_rts(mine.psn);
  for (uint32_t i = 0; conn.ok() && i < cfg.slots; ++i) conn = m.qp_prev.post_recv(i);

  // Round 3: every QP is ready to receive before anyone sends.
  std::fill(bad.begin(), bad.end(), 0);
  bad[me] = conn.ok() ? 0 : 1;
  GS_RETURN_IF_ERROR(ops.allreduce_now(bad.data(), bad.data(), n, DataType::kInt32, ReduceOp::kSum));
  if (!conn.ok()) {
    *why_not = "GPUDirect RDMA: connecting the ring's queue pairs: " + conn.message();
    return std::unique_ptr<GdrLink>();
  }
  if (std::count(bad.begin(), bad.end(), 1) > 0) {
    *why_not = "GPUDirect RDMA: the ring's queue pairs did not connect on " + failing();
    return std::unique_ptr<GdrLink>();
  }

  m.description = m.node->describe() + ", " + m.region.method + ", " + std::to_string(cfg.slots) + " x " +
                  std::to_string(cfg.slot_bytes) + "-byte slots";
  m.worker = std::thread([&m] { m.run(); });
  return link;
}

const std::string& GdrLink::describe() const { return impl_->description; }
uint8_t* GdrLink::slot(bool receive, uint64_t msg) const { return impl_->slot(receive, msg); }
int GdrLink::next() const { return impl_->next; }
int GdrLink::prev() const { return impl_->prev; }
int GdrLink::ring_size() const { return int(impl_->cfg.ring.size()); }
int GdrLink::ring_position() const { return impl_->position; }
uint32_t GdrLink::slots() const { return impl_->cfg.slots; }

Status GdrLink::error() const {
  std::lock_guard lock(impl_->mu);
  return impl_->error;
}

void GdrLink::plan(const std::vector<uint32_t>& send_bytes, const std::vector<uint32_t>& recv_bytes) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  m.send_len.insert(m.send_len.end(), send_bytes.begin(), send_bytes.end());
  m.recv_len.insert(m.recv_len.end(), recv_bytes.begin(), recv_bytes.end());
  m.planned_sends += send_bytes.size();
  m.planned_recvs += recv_bytes.size();
}

void GdrLink::Impl::fail(Status s) {
  {
    std::lock_guard lock(mu);
    if (!error.ok()) return;
    error = s;
  }
  log::get(cfg.log_name)->error("{}: {}", cfg.who, s.message());
  if (ops.on_failure) ops.on_failure();
  if (ops.abort_job) ops.abort_job(s.message());
}

void GdrLink::quiesce() {
  Impl& m = *impl_;
  if (!m.worker.joinable()) return;
  m.draining.store(true, std::memory_order_release);
  m.worker.join();
}

// The worker: posts the stream's filled send slots as the next rank frees its receive slots,
// publishes arrivals, returns credits. Polls with a short back-off (no completion channel).
void GdrLink::Impl::run() {
  const char* tr = std::getenv("GRADSYNC_GDR_TRACE");
  const bool trace = tr != nullptr && *tr != '\0' && std::strcmp(tr, "0") != 0;
  auto last_progress = Clock::now();
  auto last_trace = last_progress;
  int idle = 0;
  ibv_wc wcs[16];
  while (!stop.load(std::memory_order_acquire)) {
    bool progress = false;
    uint64_t planned_s = 0, planned_r = 0;
    {
      std::lock_guard lock(mu);
      planned_s = planned_sends;
      planned_r = planned_recvs;
    }
    // Sends: filled by the stream, a free receive slot at the next rank, room in the SQ.
    while (posted < planned_s && load(&words->ready) > posted &&
           load(&credit->credit) + cfg.slots > posted && posted - completed < cfg.slots) {
      uint32_t len = 0;
      {
        std::lock_guard lock(mu);
        len = send_len[size_t(posted - completed)];
      }
      const uint64_t m = posted;
      Status s = qp_next.post_write_with_imm(*region.mr, size_t(reinterpret_cast<uint64_t>(slot(false, m)) - region.mr->addr()),
                                             len, peer_slots + (m % cfg.slots) * cfg.slot_bytes,
                                             peer_slot_rkey, uint32_t(m), m);
      if (!s.ok()) return fail({s.code(), "GPUDirect RDMA write of message " + std::to_string(m) + " to " +
                                              peer_name(next) + ": " + s.message()});
      ++posted;
      progress = true;
      if (trace) log::get(cfg.log_name)->info("{}: gdr posted message {} ({} bytes) to {}", cfg.who, m, len, peer_name(next));
    }
    // Completions.
    auto got = cq.poll(wcs);
    if (!got.ok()) return fail(got.status());
    for (int i = 0; i < *got; ++i) {
      const ibv_wc& wc = wcs[i];
      if (trace) {
        log::get(cfg.log_name)->info("{}: gdr completion qp {} opcode {} wr_id {:#x} status {} bytes {}", cfg.who, wc.qp_num,
                              int(wc.opcode), wc.wr_id, int(wc.status), wc.byte_len);
      }
      const bool from_prev = wc.qp_num == qp_prev.qpn();
      const verbs::QueuePair& qp = from_prev ? qp_prev : qp_next;
      if (Status s = qp.check(wc); !s.ok()) {
        const std::string what = !from_prev                 ? "GPUDirect RDMA write to " + peer_name(next)
                                 : (wc.wr_id & kCreditWr) != 0 ? "credit write to " + peer_name(prev)
                                                               : "GPUDirect RDMA receive from " + peer_name(prev);
        return fail({Code::kAborted, what + " failed: " + s.message()});
      }
      if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        // A message may land before this rank queued the call it belongs to (the first
        // `slots` of a call need no credit): it is checked and published once planned.
        const uint32_t imm = ntohl(wc.imm_data);
        const uint64_t seq = arrived + landed.size();
        if (imm != uint32_t(seq)) {
          return fail({Code::kMismatch, "GPUDirect RDMA: from " + peer_name(prev) + " came message " +
                                            std::to_string(imm) + ", expected message " +
                                            std::to_string(uint32_t(seq)) + " (lost or reordered write)"});
        }
        landed.push_back(wc.byte_len);
        if (Status s = qp_prev.post_recv(wc.wr_id); !s.ok()) return fail(s);
      } else if ((wc.wr_id & kCreditWr) != 0) {
        credit_inflight = false;
      } else {
        {
          std::lock_guard lock(mu);
          send_len.pop_front();
        }
        ++completed;
        __atomic_store_n(&words->send_free, completed, __ATOMIC_RELEASE);
      }
      progress = true;
    }
    // Arrivals the stream may read: checked against the plan, flushed, published.
    while (!landed.empty() && arrived < planned_r) {
      uint32_t want = 0;
      {
        std::lock_guard lock(mu);
        want = recv_len.front();
        recv_len.pop_front();
      }
      if (landed.front() != want) {
        return fail({Code::kMismatch,
                     "GPUDirect RDMA: message " + std::to_string(arrived) + " from " + peer_name(prev) +
                         " has " + std::to_string(landed.front()) + " bytes; this rank expected " +
                         std::to_string(want) + " (the ranks called different collectives or counts?)"});
      }
      landed.pop_front();
      if (flush) {
        if (Status s = flush(); !s.ok()) return fail(s);
      }
      ++arrived;
      __atomic_store_n(&words->arrived, arrived, __ATOMIC_RELEASE);
      progress = true;
    }
    // Credits: the stream read receive slots; the previous rank may write them again.
    const uint64_t consumed = load(&words->consumed);
    if (consumed > credit_sent && !credit_inflight) {
      credit->credit_src = consumed;
      Status s = qp_prev.post_write(credit_mr, offsetof(CreditWords, credit_src), sizeof(uint64_t),
                                    peer_credit, peer_credit_rkey, kCreditWr | consumed, true);
      if (!s.ok()) return fail(s);
      credit_sent = consumed;
      credit_inflight = true;
      progress = true;
    }
    if (!ops.abort_reason().empty()) return;  // the stream's waits end through the abort word
    const bool pending = completed < planned_s || arrived < planned_r;
    if (draining.load(std::memory_order_acquire) && !pending && !credit_inflight &&
        load(&words->consumed) == credit_sent) {
      return;
    }
    if (progress) {
      last_progress = Clock::now();
      idle = 0;
      continue;
    }
    if (pending && Clock::now() - last_progress > cfg.op_timeout) {
      const bool waiting_recv = arrived < planned_r && load(&words->consumed) == arrived;
      const std::string state =
          " [messages: sent " + std::to_string(posted) + " of " + std::to_string(planned_s) + " planned, " +
          std::to_string(completed) + " completed, stream filled " + std::to_string(load(&words->ready)) +
          ", next rank freed up to " + std::to_string(load(&credit->credit) + cfg.slots) + "; received " +
          std::to_string(arrived) + " (+" + std::to_string(landed.size()) + " early) of " +
          std::to_string(planned_r) + " planned, stream read " + std::to_string(load(&words->consumed)) + "]";
      return fail({Code::kDeadlineExceeded,
                   "GPUDirect RDMA made no progress for " + std::to_string(cfg.op_timeout.count()) +
                       " ms (op timeout): " +
                       (waiting_recv ? "waiting for message " + std::to_string(arrived) + " from " + peer_name(prev)
                                     : "waiting to send message " + std::to_string(posted) + " to " +
                                           peer_name(next) + " (its receive slots are full)") +
                       "; that rank is slow, hung, or never called the same collective" + state});
    }
    if (trace && Clock::now() - last_trace > std::chrono::seconds(1)) {
      last_trace = Clock::now();
      log::get(cfg.log_name)->info("{}: gdr idle: planned {}/{} posted {} completed {} ready {} credit {} arrived {} "
                            "landed {} consumed {}", cfg.who, planned_s, planned_r, posted, completed,
                            load(&words->ready), load(&credit->credit), arrived, landed.size(),
                            load(&words->consumed));
    }
    if (++idle > 64) std::this_thread::sleep_for(std::chrono::microseconds(idle > 4096 ? 200 : 5));
  }
}

}  // namespace gradsync
