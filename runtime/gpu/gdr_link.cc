#include "gpu/gdr_link.h"
#include "gpu/gdr_link_impl.h"

#include <arpa/inet.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/secret.h"
#include "transport/verbs/emulated_fabric.h"
#include "transport/verbs/node.h"

namespace gradsync {
namespace {

using Clock = std::chrono::steady_clock;
using namespace gdr_link_detail;

// One rank's row of the set-up exchange (summed as bytes over ranks; other rows are zero).
struct GdrPeerEntry {
  int32_t rank_plus_one = 0;  // 0: unused
  uint32_t qpn = 0;           // our QP to that peer
  uint64_t recv_slots = 0;    // our receive slot 0 for its messages (0: we receive nothing);
                              // direct: its offset in our direct region
  uint64_t credit_addr = 0;   // our credit word for our messages to it (0: we send nothing);
                              // direct: our words for it (their offset), when we send
  uint64_t words_off = 0;     // direct: the offset of our words for it (always set)
  uint32_t direct = 0;        // 1: a direct peer
  uint32_t pad = 0;
};
struct GdrBlob {
  uint32_t psn = 0;  // every QP's initial send PSN (24 bits)
  uint32_t lid = 0;
  uint32_t mtu = 0;
  uint32_t slot_rkey = 0;
  uint32_t credit_rkey = 0;
  uint32_t npeers = 0;
  uint8_t gid[16] = {};
  uint8_t direct_handle[kGdrHandleBytes] = {};
  GdrPeerEntry peers[kMaxGdrPeers];
  TcpEndpoint tcp;                        // TCP peers: where this rank listens
  uint8_t tcp_nonce[kTcpNonceBytes] = {};  // rank 0's row: the link's nonce (gdr_link_tcp.cc)
};

constexpr uint64_t kCreditWr = uint64_t(1) << 63;  // wr_id bit of credit writes
constexpr uint64_t kRecvWr = uint64_t(1) << 62;    // wr_id bit of posted receives (error completions carry no opcode)

}  // namespace

// Everything this rank can do alone: device, region, credit words, CQ, QPs (to INIT).
Status GdrLink::Impl::setup_local(const GdrRegionMaker& make_region) {
  if (!cfg.refuse.empty()) return {Code::kUnavailable, cfg.refuse};
  // Peers all on this node (or none): their hops are the stream's stores into mapped memory,
  // so no NIC, queue pair or worker is needed (one node's ring and trees).
  // Peers on other nodes go through the NIC, or over TCP connections (GdrLinkConfig::tcp).
  const bool remote = std::any_of(peers.begin(), peers.end(), [](const PeerLink& l) { return !l.peer.direct; });
  tcp = remote && cfg.tcp;
  const bool nic = remote && !cfg.tcp;
  if (nic && cfg.verbs_device.empty()) {
    return {Code::kUnavailable, "this node's gradsyncd runs no verbs channels (its transport is tcp)"};
  }
  if (nic) GS_RETURN_IF_ERROR(open_nic());
  if (tcp) {
    if (!ops.tcp_region) return {Code::kInternal, "TCP peers without tcp_region"};
    GS_RETURN_IF_ERROR(tcp_listen());
  }
  // The region: per RDMA (or TCP) peer, its send block then its receive block (only the
  // directions used). The direct region: the words, then each direct peer's receive block.
  // A block is `slots` slots, then (with ll_bytes; for an RDMA peer only with ll_queue_pairs;
  // never for TCP peers) `slots` low-latency slots (Impl::ll_offset): the same layout on every
  // rank, so the sender of an RDMA message finds the peer's low-latency receive slot from its
  // receive slot 0.
  const size_t block = size_t(cfg.slots) * cfg.slot_bytes;
  const size_t ll_block = block + size_t(cfg.slots) * cfg.ll_bytes;
  const size_t direct_block = ll_block;
  const size_t remote_block = tcp || !cfg.ll_queue_pairs ? block : ll_block;
  bool any_direct = false;
  direct_bytes = (kDirectWordsOffset + peers.size() * sizeof(GdrWords) + 255) / 256 * 256;
  for (PeerLink& l : peers) {
    if (l.peer.direct) {
      any_direct = true;
      if (l.peer.recv) l.recv_off = std::exchange(direct_bytes, direct_bytes + direct_block);
      continue;
    }
    if (l.peer.send) l.send_off = std::exchange(region_bytes, region_bytes + remote_block);
    if (l.peer.recv) l.recv_off = std::exchange(region_bytes, region_bytes + remote_block);
  }
  if (region_bytes > 0) {
    auto reg = tcp ? ops.tcp_region(region_bytes) : make_region(node->pd(), region_bytes);
    if (!reg.ok()) return reg.status();
    region = std::move(reg).value();
  }
  if (!any_direct) {
    direct_bytes = 0;
  } else {
    if (!ops.direct_make || !ops.direct_open) return {Code::kInternal, "direct peers without direct_make/direct_open"};
    auto d = ops.direct_make(direct_bytes);
    if (!d.ok()) return {d.status().code(), "the direct region for this node's peers: " + d.status().message()};
    direct = std::move(d).value();
  }
  const size_t credit_bytes = std::max<size_t>(1, peers.size()) * sizeof(CreditWords);
  void* c = nullptr;
  if (::posix_memalign(&c, 4096, (credit_bytes + 4095) / 4096 * 4096) != 0) return {Code::kInternal, "posix_memalign"};
  std::memset(c, 0, credit_bytes);
  credits = static_cast<CreditWords*>(c);
  for (size_t i = 0; i < peers.size(); ++i) peers[i].credit = &credits[i];
  return nic ? setup_queue_pairs(credit_bytes) : Status::Ok();
}

// The RDMA device (the daemon's, or the rank's rail).
Status GdrLink::Impl::open_nic() {
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
    return {opened.status().code(), "the RDMA device " + cfg.verbs_device + ": " + opened.status().message()};
  }
  node = std::move(opened).value();
  return Status::Ok();
}

// The credit words' registration, the CQ and a queue pair (to INIT) per RDMA peer.
Status GdrLink::Impl::setup_queue_pairs(size_t credit_bytes) {
  auto cmr = verbs::MemoryRegion::create(node->pd(), credits, credit_bytes,
                                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!cmr.ok()) return cmr.status();
  credit_mr = std::move(cmr).value();

  // One CQ for every QP: per peer at most `slots` data writes and one credit write signaled
  // at a time, and `slots` receives posted; twice that so it can never overrun.
  auto q = verbs::CompletionQueue::create(node->context(), int(std::max<size_t>(1, peers.size()) * (4 * cfg.slots + 8)));
  if (!q.ok()) return q.status();
  cq = std::move(q).value();
  verbs::QpCaps caps;
  caps.max_send_wr = cfg.slots + 2;  // data writes and credit writes, + slack
  caps.max_recv_wr = cfg.slots;      // one per receive slot
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  for (PeerLink& l : peers) {
    if (l.peer.direct) continue;
    auto a = verbs::QueuePair::create_rc(node->pd(), cq, cq, caps, peer_name(l.peer.rank));
    if (!a.ok()) return a.status();
    l.qp = std::move(a).value();
    GS_RETURN_IF_ERROR(l.qp.to_init(node->port(), access));
  }
  return Status::Ok();
}

GdrLink::GdrLink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GdrLink::~GdrLink() {
  Impl& m = *impl_;
  m.stop.store(true, std::memory_order_release);
  if (m.worker.joinable()) m.worker.join();
  // Verbs objects in order (QPs, CQ, MRs) before the memory they name and the PD; the peers'
  // direct regions unmapped before ours goes.
  for (PeerLink& l : m.peers) {
    l.qp = {};
    l.peer_region = {};
  }
  m.direct = {};
  m.cq = {};
  m.credit_mr = {};
  m.region = {};
  std::free(m.credits);
}

Result<std::unique_ptr<GdrLink>> GdrLink::create(const GdrLinkConfig& cfg, const GdrLinkOps& ops,
                                                 const GdrRegionMaker& make_region, GdrWords* words,
                                                 std::function<Status()> flush, std::string* why_not,
                                                 bool* direct_refused) {
  if (direct_refused != nullptr) *direct_refused = false;
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.cfg = cfg;
  m.ops = ops;
  m.flush = std::move(flush);
  const int n = cfg.world_size, me = cfg.rank;
  if (cfg.ll_bytes % 16 != 0) {
    return Status(Code::kInternal, cfg.who + ": low-latency slots of " + std::to_string(cfg.ll_bytes) +
                                       " bytes, not a multiple of 16");
  }
  if (cfg.peers.size() > size_t(kMaxGdrPeers)) {
    return Status(Code::kInternal, cfg.who + ": " + std::to_string(cfg.peers.size()) + " RDMA peers, at most " +
                                       std::to_string(kMaxGdrPeers));
  }
  for (size_t i = 0; i < cfg.peers.size(); ++i) {
    const GdrPeer& p = cfg.peers[i];
    const bool twice = std::any_of(cfg.peers.begin(), cfg.peers.begin() + long(i),
                                   [&](const GdrPeer& q) { return q.rank == p.rank; });
    if (p.rank < 0 || p.rank >= n || p.rank == me || twice || (!p.send && !p.recv)) {
      return Status(Code::kInternal, cfg.who + ": RDMA peer rank " + std::to_string(p.rank) +
                                         " is outside the world of " + std::to_string(n) +
                                         ", this rank, listed twice or used in no direction");
    }
    PeerLink l;
    l.peer = p;
    l.peer.tcp = cfg.tcp && !p.direct;
    l.words = &words[i];
    m.peers.push_back(std::move(l));
  }
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
  const std::string label = cfg.tcp ? "TCP steps" : "GPUDirect RDMA";
  if (!local.ok()) {
    *why_not = label + ": " + local.message();
    return std::unique_ptr<GdrLink>();
  }
  if (std::count(bad.begin(), bad.end(), 1) > 0) {
    *why_not = label + " is not possible on " + failing() + " (see its log)";
    return std::unique_ptr<GdrLink>();
  }

  // Round 2: the blobs.
  std::vector<GdrBlob> table(n);  // value-initialized: zero rows
  GdrBlob& mine = table[me];
  mine.psn = std::random_device{}() & 0xffffff;
  if (m.node) {
    mine.lid = m.node->port_info().lid;
    mine.mtu = uint32_t(m.node->port_info().active_mtu);
    mine.slot_rkey = m.region.mr ? m.region.mr->rkey() : 0;
    mine.credit_rkey = m.credit_mr.rkey();
    std::memcpy(mine.gid, m.node->gid().raw, sizeof(mine.gid));
  }
  mine.npeers = uint32_t(m.peers.size());
  std::memcpy(mine.direct_handle, m.direct.handle, sizeof(mine.direct_handle));
  if (m.tcp) {
    std::snprintf(mine.tcp.address, sizeof(mine.tcp.address), "%s", cfg.tcp_address.c_str());
    mine.tcp.port = uint32_t(m.port);
  }
  // The nonce from rank 0 alone, whether or not it has TCP peers itself.
  if (cfg.tcp && me == 0) GS_RETURN_IF_ERROR(random_bytes(mine.tcp_nonce, sizeof(mine.tcp_nonce)));
  for (size_t i = 0; i < m.peers.size(); ++i) {
    const PeerLink& l = m.peers[i];
    GdrPeerEntry& e = mine.peers[i];
    e.rank_plus_one = l.peer.rank + 1;
    if (l.peer.direct) {
      e.direct = 1;
      e.words_off = kDirectWordsOffset + i * sizeof(GdrWords);
      e.recv_slots = l.peer.recv ? l.recv_off : 0;
      e.credit_addr = l.peer.send ? e.words_off : 0;
      continue;
    }
    if (!l.peer.tcp) e.qpn = l.qp.qpn();
    e.recv_slots = l.peer.recv ? reinterpret_cast<uint64_t>(m.slot(int(i), true, 0)) : 0;
    e.credit_addr = l.peer.send ? reinterpret_cast<uint64_t>(&l.credit->credit) : 0;
  }
  GS_RETURN_IF_ERROR(ops.allreduce_now(table.data(), table.data(), n * sizeof(GdrBlob),
                                       DataType::kUInt8, ReduceOp::kSum));
  // Only a rank with RDMA peers has a NIC (setup_local).
  const ibv_mtu mtu = m.node ? m.node->port_info().active_mtu : IBV_MTU_1024;
  const int sgid = m.node ? m.node->sgid_index() : 0;
  Status conn = Status::Ok();
  bool direct_failed = false;
  for (size_t i = 0; conn.ok() && i < m.peers.size(); ++i) {
    PeerLink& l = m.peers[i];
    const GdrBlob& b = table[size_t(l.peer.rank)];
    const GdrPeerEntry* e = nullptr;
    for (uint32_t j = 0; j < std::min<uint32_t>(b.npeers, kMaxGdrPeers); ++j) {
      if (b.peers[j].rank_plus_one == me + 1) e = &b.peers[j];
    }
    // Symmetry: what we send it receives, and the other way round. A programming error, the
    // same on every rank (the peers come from the same plan).
    if (e == nullptr || (l.peer.send != (e->recv_slots != 0)) || (l.peer.recv != (e->credit_addr != 0)) ||
        l.peer.direct != (e->direct != 0)) {
      return Status(Code::kInternal, cfg.who + ": the RDMA peers are not symmetric: this rank " +
                                         (l.peer.send ? "sends to " : "") + (l.peer.recv ? "receives from " : "") +
                                         (l.peer.direct ? "(directly) " : "") + m.peer_name(l.peer.rank) +
                                         ", which " + (e == nullptr ? "does not list it" : "lists it otherwise"));
    }
    if (l.peer.direct) {
      auto opened = ops.direct_open(b.direct_handle, l.peer.rank);
      if (!opened.ok()) {
        conn = Status(opened.status().code(), "mapping the memory of " + m.peer_name(l.peer.rank) +
                                                  " on this node: " + opened.status().message());
        direct_failed = true;
        break;
      }
      l.peer_region = std::move(opened).value();
      l.peer_recv_off = size_t(e->recv_slots);
      l.peer_words_off = size_t(e->words_off);
      continue;
    }
    if (l.peer.tcp) continue;  // connected below, once every peer is known
    l.peer_slots = e->recv_slots;
    l.peer_slot_rkey = b.slot_rkey;
    l.peer_credit = e->credit_addr;
    l.peer_credit_rkey = b.credit_rkey;
    verbs::PeerAddress a;
    a.qpn = e->qpn;
    a.psn = b.psn;
    a.lid = uint16_t(b.lid);
    std::memcpy(a.gid.raw, b.gid, sizeof(b.gid));
    a.mtu = static_cast<ibv_mtu>(b.mtu);
    conn = l.qp.to_rtr(a, mtu, sgid);
    if (conn.ok()) conn = l.qp.to_rts(mine.psn);
    for (uint32_t s = 0; conn.ok() && l.peer.recv && s < cfg.slots; ++s) conn = l.qp.post_recv(kRecvWr | s);
  }
  if (conn.ok() && m.tcp) {
    std::vector<TcpEndpoint> ends(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) ends[size_t(r)] = table[size_t(r)].tcp;
    conn = m.tcp_connect(ends, table[0].tcp_nonce);
  }

  // Round 3: every QP is ready to receive before anyone sends (2: a direct peer failed).
  std::fill(bad.begin(), bad.end(), 0);
  bad[me] = conn.ok() ? 0 : direct_failed ? 2 : 1;
  GS_RETURN_IF_ERROR(ops.allreduce_now(bad.data(), bad.data(), n, DataType::kInt32, ReduceOp::kSum));
  if (direct_refused != nullptr) *direct_refused = std::count(bad.begin(), bad.end(), 2) > 0;
  std::replace(bad.begin(), bad.end(), 2, 1);
  const std::string conns = m.tcp ? "the TCP connections" : "the queue pairs";
  if (!conn.ok()) {
    *why_not = label + ": connecting " + conns + ": " + conn.message();
    return std::unique_ptr<GdrLink>();
  }
  if (std::count(bad.begin(), bad.end(), 1) > 0) {
    *why_not = label + ": " + conns + " did not connect on " + failing();
    return std::unique_ptr<GdrLink>();
  }

  const auto direct = std::count_if(m.peers.begin(), m.peers.end(), [](const PeerLink& l) { return l.peer.direct; });
  m.description = (m.node  ? m.node->describe() + ", " + (m.region.method.empty() ? "no slots" : m.region.method)
                   : m.tcp ? "TCP from " + cfg.tcp_address + ":" + std::to_string(m.port) + ", " + m.region.method
                           : std::string("no NIC (every peer on this node)")) +
                  ", " + std::to_string(cfg.slots) + " x " + std::to_string(cfg.slot_bytes) + "-byte slots, " +
                  std::to_string(m.peers.size()) + (m.peers.size() == 1 ? " peer" : " peers");
  if (direct > 0) m.description += " (" + std::to_string(direct) + " of them on this node, by CUDA IPC)";
  // The worker moves RDMA or TCP messages only: a rank whose peers are all direct needs none.
  if (m.node) m.worker = std::thread([&m] { m.run(); });
  if (m.tcp) m.worker = std::thread([&m] { m.run_tcp(); });
  return link;
}

const std::string& GdrLink::describe() const { return impl_->description; }
int GdrLink::peer_count() const { return int(impl_->peers.size()); }
const GdrPeer& GdrLink::peer(int index) const { return impl_->peers[size_t(index)].peer; }
int GdrLink::peer_index(int rank) const {
  for (size_t i = 0; i < impl_->peers.size(); ++i) {
    if (impl_->peers[i].peer.rank == rank) return int(i);
  }
  return -1;
}
uint8_t* GdrLink::slot(int index, bool receive, uint64_t msg) const { return impl_->slot(index, receive, msg); }
uint8_t* GdrLink::ll_slot(int index, bool receive, uint64_t msg) const { return impl_->ll_slot(index, receive, msg); }
size_t GdrLink::ll_payload_bytes() const { return impl_->cfg.ll_bytes / 2; }
size_t GdrLink::ll_slot_bytes() const { return impl_->cfg.ll_bytes; }
size_t GdrLink::region_bytes() const { return impl_->region_bytes; }
size_t GdrLink::direct_region_bytes() const { return impl_->direct_bytes; }

GdrLink::StreamWords GdrLink::stream_words(int index) const {
  const Impl& m = *impl_;
  const PeerLink& l = m.peers[size_t(index)];
  if (!l.peer.direct) return {&l.words->arrived, &l.words->send_free, &l.words->ready, &l.words->consumed};
  GdrWords* mine = m.direct_words(index);
  auto* theirs = reinterpret_cast<GdrWords*>(l.peer_region.base + l.peer_words_off);
  return {&mine->arrived, &mine->send_free, &theirs->arrived, &theirs->send_free};
}
uint32_t GdrLink::slots() const { return impl_->cfg.slots; }
size_t GdrLink::slot_bytes() const { return impl_->cfg.slot_bytes; }

uint64_t GdrLink::bytes_sent(int index) const {
  return __atomic_load_n(&impl_->peers[size_t(index)].bytes_sent, __ATOMIC_RELAXED);
}

Status GdrLink::error() const {
  std::lock_guard lock(impl_->mu);
  return impl_->error;
}

void GdrLink::plan(const std::vector<Message>& messages) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  for (const Message& msg : messages) {
    PeerLink& l = m.peers[size_t(msg.peer)];
    if (l.peer.direct) {  // the stream moves it; the worker never sees it
      if (msg.send) __atomic_fetch_add(&l.bytes_sent, uint64_t(msg.bytes), __ATOMIC_RELAXED);
      continue;
    }
    // A low-latency message only where the peer has the slots (the runner asks so only there).
    const PlannedMsg planned{msg.bytes, msg.ll && m.has_ll(l)};
    if (msg.send) {
      l.send_len.push_back(planned);
      ++l.planned_sends;
    } else {
      l.recv_len.push_back(planned);
      ++l.planned_recvs;
    }
  }
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

// What a peer's messages are waiting for, for the stall error.
std::string GdrLink::Impl::stall(const PeerLink& l, uint64_t planned_sends, uint64_t planned_recvs) const {
  const bool waiting_recv = l.arrived < planned_recvs && load(&l.words->consumed) == l.arrived;
  const std::string state =
      " [with " + peer_name(l.peer.rank) + ": sent " + std::to_string(l.posted) + " of " +
      std::to_string(planned_sends) + " planned, " + std::to_string(l.completed) + " completed, stream filled " +
      std::to_string(load(&l.words->ready)) + ", it freed up to " + std::to_string(load(&l.credit->credit) + cfg.slots) +
      "; received " + std::to_string(l.arrived) + " (+" + std::to_string(l.landed.size()) + " early) of " +
      std::to_string(planned_recvs) + " planned, stream read " + std::to_string(load(&l.words->consumed)) + "]";
  return (waiting_recv ? "waiting for message " + std::to_string(l.arrived) + " from " + peer_name(l.peer.rank)
                       : "waiting to send message " + std::to_string(l.posted) + " to " + peer_name(l.peer.rank) +
                             " (its receive slots are full)") +
         "; that rank is slow, hung, or never called the same collective" + state;
}

// Arrivals of peer i the stream may read: checked against the plan, flushed, published.
bool GdrLink::Impl::publish_landed(size_t i, uint64_t planned_recvs, bool* progress) {
  PeerLink& l = peers[i];
  while (!l.landed.empty() && l.arrived < planned_recvs) {
    // The bytes that landed: a low-latency message's lines (PlannedMsg::wire).
    uint32_t want = 0;
    {
      std::lock_guard lock(mu);
      want = l.recv_len.front().wire();
      l.recv_len.pop_front();
    }
    if (l.landed.front() != want) {
      fail({Code::kMismatch, std::string(tcp ? "TCP steps" : "GPUDirect RDMA") + ": message " +
                                 std::to_string(l.arrived) + " from " + peer_name(l.peer.rank) + " has " +
                                 std::to_string(l.landed.front()) + " bytes; this rank expected " +
                                 std::to_string(want) + " (the ranks called different collectives or counts?)"});
      return false;
    }
    l.landed.pop_front();
    if (flush) {
      if (Status s = flush(); !s.ok()) {
        fail(s);
        return false;
      }
    }
    ++l.arrived;
    __atomic_store_n(&l.words->arrived, l.arrived, __ATOMIC_RELEASE);
    *progress = true;
  }
  return true;
}

// After the op timeout without progress: the peer waited for, one whose message this stream
// waits for first, else one we cannot send to.
Status GdrLink::Impl::stalled(const std::vector<uint64_t>& planned_s, const std::vector<uint64_t>& planned_r) const {
  size_t c = peers.size();
  for (size_t i = 0; i < peers.size() && c == peers.size(); ++i) {
    const PeerLink& l = peers[i];
    if (!l.peer.direct && l.arrived < planned_r[i] && load(&l.words->consumed) == l.arrived) c = i;
  }
  for (size_t i = 0; i < peers.size() && c == peers.size(); ++i) {
    if (!peers[i].peer.direct && peers[i].completed < planned_s[i]) c = i;
  }
  if (c == peers.size()) c = 0;
  return {Code::kDeadlineExceeded, std::string(tcp ? "TCP steps" : "GPUDirect RDMA") + " made no progress for " +
                                       std::to_string(cfg.op_timeout.count()) +
                                       " ms (op timeout): " + stall(peers[c], planned_s[c], planned_r[c])};
}

// The worker: posts the stream's filled send slots as each peer frees its receive slots,
// publishes arrivals, returns credits. Polls with a short back-off (no completion channel).
void GdrLink::Impl::run() {
  const char* tr = std::getenv("GRADSYNC_GDR_TRACE");
  const bool trace = tr != nullptr && *tr != '\0' && std::strcmp(tr, "0") != 0;
  auto last_progress = Clock::now();
  auto last_trace = last_progress;
  int idle = 0;
  ibv_wc wcs[16];
  std::vector<uint64_t> planned_s(peers.size()), planned_r(peers.size());
  while (!stop.load(std::memory_order_acquire)) {
    bool progress = false;
    snapshot_planned(planned_s, planned_r);
    // Sends: filled by the stream, a free receive slot at the peer, room in the SQ.
    for (size_t i = 0; i < peers.size(); ++i) {
      PeerLink& l = peers[i];
      while (!l.peer.direct && l.posted < planned_s[i] && load(&l.words->ready) > l.posted &&
             load(&l.credit->credit) + cfg.slots > l.posted && l.posted - l.completed < cfg.slots) {
        PlannedMsg planned;
        {
          std::lock_guard lock(mu);
          planned = l.send_len[size_t(l.posted - l.completed)];
        }
        // A low-latency message goes from our low-latency send slot into the peer's
        // low-latency receive slot, as its lines; a bulk one from slot to slot. Either way
        // the immediate is its number, and the receiver checks the length it expects.
        const uint64_t msg = l.posted;
        const uint8_t* src = planned.ll ? ll_slot(int(i), false, msg) : slot(int(i), false, msg);
        const uint64_t dst = l.peer_slots + (planned.ll ? ll_offset(msg) : (msg % cfg.slots) * cfg.slot_bytes);
        const size_t off = size_t(reinterpret_cast<uint64_t>(src) - region.mr->addr());
        // Counted before the write is posted: once it lands, the peer's stream may finish
        // the call, and whoever reads the count after the call then finds this message in it.
        // Payload bytes, for either protocol: a low-latency message's flags are not counted.
        __atomic_fetch_add(&l.bytes_sent, uint64_t(planned.bytes), __ATOMIC_RELEASE);
        Status s = l.qp.post_write_with_imm(*region.mr, off, planned.wire(), dst, l.peer_slot_rkey, uint32_t(msg), msg);
        if (!s.ok()) {
          return fail({s.code(), "GPUDirect RDMA write of message " + std::to_string(msg) + " to " +
                                     peer_name(l.peer.rank) + ": " + s.message()});
        }
        ++l.posted;
        progress = true;
        if (trace) {
          log::get(cfg.log_name)->info("{}: gdr posted message {} ({} bytes{}) to {}", cfg.who, msg, planned.wire(),
                                       planned.ll ? ", low-latency" : "", peer_name(l.peer.rank));
        }
      }
    }
    // Completions.
    auto got = cq.poll(wcs);
    if (!got.ok()) return fail(got.status());
    for (int k = 0; k < *got; ++k) {
      const ibv_wc& wc = wcs[k];
      if (trace) {
        log::get(cfg.log_name)->info("{}: gdr completion qp {} opcode {} wr_id {:#x} status {} bytes {}", cfg.who,
                                     wc.qp_num, int(wc.opcode), wc.wr_id, int(wc.status), wc.byte_len);
      }
      const int p = by_qpn(wc.qp_num);
      if (p < 0) return fail({Code::kInternal, "GPUDirect RDMA: a completion of an unknown queue pair"});
      PeerLink& l = peers[size_t(p)];
      if (Status s = l.qp.check(wc); !s.ok()) {
        const std::string what = (wc.wr_id & kCreditWr) != 0 ? "credit write to " + peer_name(l.peer.rank)
                                 : (wc.wr_id & kRecvWr) != 0 ? "GPUDirect RDMA receive from " + peer_name(l.peer.rank)
                                                             : "GPUDirect RDMA write to " + peer_name(l.peer.rank);
        return fail({Code::kAborted, what + " failed: " + s.message()});
      }
      if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        // A message may land before this rank queued the call it belongs to (the first
        // `slots` of a call need no credit): it is checked and published once planned.
        const uint32_t imm = ntohl(wc.imm_data);
        const uint64_t seq = l.arrived + l.landed.size();
        if (imm != uint32_t(seq)) {
          return fail({Code::kMismatch, "GPUDirect RDMA: from " + peer_name(l.peer.rank) + " came message " +
                                            std::to_string(imm) + ", expected message " +
                                            std::to_string(uint32_t(seq)) + " (lost or reordered write)"});
        }
        l.landed.push_back(wc.byte_len);
        if (Status s = l.qp.post_recv(wc.wr_id); !s.ok()) return fail(s);
      } else if ((wc.wr_id & kCreditWr) != 0) {
        l.credit_inflight = false;
      } else {
        {
          std::lock_guard lock(mu);
          l.send_len.pop_front();
        }
        ++l.completed;
        __atomic_store_n(&l.words->send_free, l.completed, __ATOMIC_RELEASE);
      }
      progress = true;
    }
    bool pending = false;
    for (size_t i = 0; i < peers.size(); ++i) {
      PeerLink& l = peers[i];
      if (l.peer.direct) continue;
      if (!publish_landed(i, planned_r[i], &progress)) return;
      // Credits: the stream read receive slots; the peer may write them again. Never past
      // the messages whose completion this worker took (each gave its receive request back):
      // a low-latency message is read by its lines, possibly before its completion is polled,
      // and a credit for it then would let the peer write into a queue with no receive posted
      // (RNR: the write fails).
      const uint64_t consumed = std::min<uint64_t>(load(&l.words->consumed), l.arrived + l.landed.size());
      if (consumed > l.credit_sent && !l.credit_inflight) {
        l.credit->credit_src = consumed;
        const size_t off = size_t(i) * sizeof(CreditWords) + offsetof(CreditWords, credit_src);
        Status s = l.qp.post_write(credit_mr, off, sizeof(uint64_t), l.peer_credit, l.peer_credit_rkey,
                                   kCreditWr | consumed, true);
        if (!s.ok()) return fail(s);
        l.credit_sent = consumed;
        l.credit_inflight = true;
        progress = true;
      }
      if (l.completed < planned_s[i] || l.arrived < planned_r[i]) pending = true;
    }
    if (!ops.abort_reason().empty()) {
      // The stream's waits end through the abort word.
      return log_outstanding("stopped by the abort", planned_s, planned_r);
    }
    if (draining.load(std::memory_order_acquire) && !pending &&
        std::all_of(peers.begin(), peers.end(), [](const PeerLink& l) {
          return l.peer.direct || (!l.credit_inflight && load(&l.words->consumed) == l.credit_sent);
        })) {
      return;
    }
    if (progress) {
      last_progress = Clock::now();
      idle = 0;
      stall_seen.clear();
      continue;
    }
    if (pending) note_stall(last_progress, planned_s, planned_r);
    if (pending && Clock::now() - last_progress > cfg.op_timeout) return fail(stalled(planned_s, planned_r));
    if (trace && Clock::now() - last_trace > std::chrono::seconds(1)) {
      last_trace = Clock::now();
      for (const PeerLink& l : peers) {
        if (l.peer.direct) continue;
        log::get(cfg.log_name)->info("{}: gdr idle with {}: planned {}/{} posted {} completed {} ready {} credit {} "
                                     "arrived {} landed {} consumed {}", cfg.who, peer_name(l.peer.rank),
                                     planned_s[size_t(&l - peers.data())], planned_r[size_t(&l - peers.data())], l.posted, l.completed, load(&l.words->ready),
                                     load(&l.credit->credit), l.arrived, l.landed.size(), load(&l.words->consumed));
      }
    }
    if (++idle > 64) std::this_thread::sleep_for(std::chrono::microseconds(idle > 4096 ? 200 : 5));
  }
  {
    std::lock_guard lock(mu);
    for (size_t i = 0; i < peers.size(); ++i) {
      planned_s[i] = peers[i].planned_sends;
      planned_r[i] = peers[i].planned_recvs;
    }
  }
  log_outstanding("stopped (the link is closed)", planned_s, planned_r);
}

// What this rank still waited for when its worker stops early, for the diagnosis of whoever
// failed (a stall seen first by a stream's wait kernel, whose timeout does not wait for the
// worker's).
void GdrLink::Impl::log_outstanding(const char* how, const std::vector<uint64_t>& planned_s,
                                    const std::vector<uint64_t>& planned_r) const {
  for (size_t i = 0; i < peers.size(); ++i) {
    if (peers[i].peer.direct) continue;
    if (peers[i].completed < planned_s[i] || peers[i].arrived < planned_r[i]) {
      log::get(cfg.log_name)->warn("{}: {} with messages outstanding: {}", cfg.who, how,
                                   stall(peers[i], planned_s[i], planned_r[i]));
    }
  }
  if (!stall_seen.empty()) {
    const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - stall_seen_at).count();
    for (const std::string& w : stall_seen) {
      log::get(cfg.log_name)->warn("{}: {} ms before, a second into the stall: {}", cfg.who, ago, w);
    }
  }
}

void GdrLink::Impl::note_stall(Clock::time_point last_progress, const std::vector<uint64_t>& planned_s,
                               const std::vector<uint64_t>& planned_r) {
  if (!stall_seen.empty() || Clock::now() - last_progress < std::chrono::seconds(1)) return;
  stall_seen_at = Clock::now();
  for (size_t i = 0; i < peers.size(); ++i) {
    if (peers[i].peer.direct) continue;
    if (peers[i].completed < planned_s[i] || peers[i].arrived < planned_r[i]) {
      stall_seen.push_back(stall(peers[i], planned_s[i], planned_r[i]));
    }
  }
  if (stall_seen.empty()) stall_seen.push_back("nothing outstanding with a peer through the NIC or TCP");
}

}  // namespace gradsync
