// The insides of GdrLink (gpu/gdr_link.h), shared by its two files: gdr_link.cc (set-up,
// direct peers, the RDMA worker) and gdr_link_tcp.cc (TCP peers: their connections and their
// worker). Not for other users.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "gpu/gdr_link.h"
#include "transport/verbs/node.h"

namespace gradsync {
namespace gdr_link_detail {

// Host memory, one per peer: the peer, as the receiver of our messages, writes its `consumed`
// into `credit` (an RDMA write, or our worker on a TCP credit frame); `credit_src` is the
// source of our own credit write to it (left untouched while that write is in flight).
struct alignas(64) CreditWords {
  uint64_t credit;
  uint64_t credit_src;
};

// A direct region: this header, a GdrWords per peer index, then the receive slots.
constexpr size_t kDirectWordsOffset = 64;

template <class T>
T load(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

// A frame on a TCP peer's connection: a message (kTcpData: `bytes` of payload follow, its
// number) or a credit (kTcpCredit: the receiver's `consumed`, no payload).
constexpr uint32_t kTcpData = 0x47534d31;    // "GSM1"
constexpr uint32_t kTcpCredit = 0x47534331;  // "GSC1"
struct TcpFrame {
  uint32_t magic = 0;
  uint32_t bytes = 0;
  uint64_t number = 0;
};
static_assert(sizeof(TcpFrame) == 16, "TcpFrame is a wire format");

// A TCP peer's connection and where the worker is in each direction: at most one frame
// going out and one coming in at a time, resumed where a non-blocking call stopped.
struct TcpConn {
  Fd fd;
  std::string where;  // the peer's address and port, for errors
  bool closed = false;  // the peer closed its end (or reset it)
  std::string closed_why;
  // Out: the frame's header, its payload (a send slot; null for a credit), bytes written.
  TcpFrame out{};
  const uint8_t* out_payload = nullptr;
  size_t out_done = 0;
  bool out_busy = false;
  // In: the header read so far, then the payload into its receive slot.
  TcpFrame in{};
  uint8_t* in_dest = nullptr;
  size_t in_done = 0;
};

// A planned message: its payload bytes, and whether it travels in the low-latency slots (as
// lines: 16 bytes on the wire for each 8 of payload, the last line whole).
struct PlannedMsg {
  uint32_t bytes = 0;
  bool ll = false;
  uint32_t wire() const { return ll ? (bytes + 7) / 8 * 16 : bytes; }
};

// One peer: its queue pair (or TCP connection), its slots in our region, its words, and the
// worker's state.
struct PeerLink {
  GdrPeer peer;
  verbs::QueuePair qp;
  size_t send_off = 0, recv_off = 0;  // our slots' offsets in the region
  GdrWords* words = nullptr;
  CreditWords* credit = nullptr;
  // The peer's receive slots for us, and its credit word for our credits.
  uint64_t peer_slots = 0;
  uint64_t peer_credit = 0;
  uint32_t peer_slot_rkey = 0, peer_credit_rkey = 0;
  // Planned messages not yet completed (sends) / arrived (receives); guarded by the link's
  // mutex.
  std::deque<PlannedMsg> send_len, recv_len;
  uint64_t planned_sends = 0, planned_recvs = 0;
  // Worker state.
  uint64_t posted = 0, completed = 0, arrived = 0;
  uint64_t credit_sent = 0;
  bool credit_inflight = false;
  uint64_t bytes_sent = 0;  // payload bytes posted; written by the worker, read atomically
  std::deque<uint32_t> landed;  // lengths of receives completed but not yet planned
  // Direct peers: its region as mapped here, its receive slots for us and its words for us
  // (offsets there); recv_off is then our receive slots' offset in our direct region.
  GdrDirectRegion peer_region;
  size_t peer_recv_off = 0, peer_words_off = 0;
  TcpConn tcp;  // TCP peers
};

// What a rank tells the others of its TCP side at set-up (its row of the exchange).
constexpr size_t kTcpAddressBytes = 64;
constexpr size_t kTcpNonceBytes = 32;
struct TcpEndpoint {
  char address[kTcpAddressBytes] = {};  // NUL-terminated; empty: it listens nowhere
  uint32_t port = 0;
  uint32_t pad = 0;
};

}  // namespace gdr_link_detail

struct GdrLink::Impl {
  using PeerLink = gdr_link_detail::PeerLink;
  using CreditWords = gdr_link_detail::CreditWords;

  GdrLinkConfig cfg;
  GdrLinkOps ops;
  std::function<Status()> flush;
  std::string description;

  std::shared_ptr<VerbsNode> node;
  GdrRegion region;
  size_t region_bytes = 0;
  CreditWords* credits = nullptr;  // one per peer
  GdrDirectRegion direct;          // with direct peers: words, then their receive slots
  size_t direct_bytes = 0;
  verbs::MemoryRegion credit_mr;
  verbs::CompletionQueue cq;
  std::vector<PeerLink> peers;
  // TCP peers: the listening socket (set-up only) and its port.
  bool tcp = false;
  Fd listener;
  int port = 0;

  mutable std::mutex mu;  // the plan (PeerLink::send_len/recv_len/planned_*) and error
  Status error;

  std::atomic<bool> stop{false};
  std::atomic<bool> draining{false};
  std::thread worker;

  uint8_t* slot(int p, bool recv_side, uint64_t msg) const {
    const PeerLink& l = peers[size_t(p)];
    const size_t at = size_t(msg % cfg.slots) * cfg.slot_bytes;
    if (l.peer.direct) return recv_side ? direct.base + l.recv_off + at : l.peer_region.base + l.peer_recv_off + at;
    return region.base + (recv_side ? l.recv_off : l.send_off) + at;
  }
  // Where a block's low-latency slot of message `msg` starts: each block (a direct peer's
  // receive block; an RDMA peer's send block and receive block) holds its `slots` slots, then
  // its `slots` low-latency slots. The same on both ends, so that a sender finds the peer's
  // low-latency receive slot from the peer's receive slot 0 (GdrPeerEntry::recv_slots).
  size_t ll_offset(uint64_t msg) const {
    return size_t(cfg.slots) * cfg.slot_bytes + size_t(msg % cfg.slots) * cfg.ll_bytes;
  }
  // Low-latency slots exist beside a direct peer's receive slots and an RDMA peer's send and
  // receive slots; TCP peers have none (their frames are bulk: a frame's bytes reach the
  // receive slot by the worker's read, which publishes `arrived` anyway).
  // RDMA peers' only with GdrLinkConfig::ll_queue_pairs.
  bool has_ll(const PeerLink& l) const {
    return cfg.ll_bytes > 0 && !l.peer.tcp && (l.peer.direct || cfg.ll_queue_pairs);
  }
  uint8_t* ll_slot(int p, bool recv_side, uint64_t msg) const {
    const PeerLink& l = peers[size_t(p)];
    if (!has_ll(l)) return nullptr;
    if (l.peer.direct) {
      return recv_side ? direct.base + l.recv_off + ll_offset(msg) : l.peer_region.base + l.peer_recv_off + ll_offset(msg);
    }
    return region.base + (recv_side ? l.recv_off : l.send_off) + ll_offset(msg);
  }
  GdrWords* direct_words(int p) const {
    return reinterpret_cast<GdrWords*>(direct.base + gdr_link_detail::kDirectWordsOffset) + p;
  }
  std::string peer_name(int r) const {
    return "rank " + std::to_string(r) +
           (size_t(r) < cfg.hosts.size() ? " (host " + cfg.hosts[r] + ")" : std::string());
  }
  int by_qpn(uint32_t qpn) const {
    for (size_t i = 0; i < peers.size(); ++i) {
      if (!peers[i].peer.direct && peers[i].qp.qpn() == qpn) return int(i);
    }
    return -1;
  }

  Status setup_local(const GdrRegionMaker& make_region);
  Status open_nic();
  Status setup_queue_pairs(size_t credit_bytes);
  void run();
  void fail(Status s);
  std::string stall(const PeerLink& l, uint64_t planned_sends, uint64_t planned_recvs) const;
  // Every peer's planned sends and receives so far, under the lock (a worker's loop reads them once a pass).
  void snapshot_planned(std::vector<uint64_t>& sends, std::vector<uint64_t>& recvs) {
    std::lock_guard lock(mu);
    for (size_t i = 0; i < peers.size(); ++i) {
      sends[i] = peers[i].planned_sends;
      recvs[i] = peers[i].planned_recvs;
    }
  }
  void log_outstanding(const char* how, const std::vector<uint64_t>& planned_s,
                       const std::vector<uint64_t>& planned_r) const;
  // What each peer with messages outstanding waited for a second into the present stall (no
  // progress since), taken once per stall by the worker (note_stall; cleared by progress).
  // log_outstanding prints it beside the state at the end, which a failed stream's late
  // signals (stored after its failed wait, so that peers stop at once) may have moved on.
  std::vector<std::string> stall_seen;
  std::chrono::steady_clock::time_point stall_seen_at;
  void note_stall(std::chrono::steady_clock::time_point last_progress, const std::vector<uint64_t>& planned_s,
                  const std::vector<uint64_t>& planned_r);
  // Shared by both workers: publishes peer i's landed messages that are planned (checked
  // against the plan, flushed); false after a failure.
  bool publish_landed(size_t i, uint64_t planned_recvs, bool* progress);
  // The stall error of the peer waited for first (both workers, after the op timeout).
  Status stalled(const std::vector<uint64_t>& planned_s, const std::vector<uint64_t>& planned_r) const;

  // gdr_link_tcp.cc: listen (setup_local), connect every TCP peer with the nonce and the
  // peers' endpoints (by world rank; set-up round 2), and the worker of TCP peers.
  Status tcp_listen();
  Status tcp_connect(const std::vector<gdr_link_detail::TcpEndpoint>& ends, const uint8_t* nonce);
  void run_tcp();
};

}  // namespace gradsync
