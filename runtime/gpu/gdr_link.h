// The transport half of the GPU communicator's RDMA path (gpu/gdr_channels.h): one rank's queue
// pairs to its peers (the ranks it sends to or receives from in any of its channels: ring
// neighbours, tree parents and children), its registered slot region, and the worker thread that
// moves messages between them. No CUDA here: the region is whatever the caller registered (GPU
// memory by dma-buf in the GPU communicator; host memory in the CPU tests,
// tests/verbs/gdr_link_test.cc, which run this very engine on the emulated fabric), and the
// "stream" that fills and reads the slots is whoever writes and reads the four words below.
//
// One RC queue pair per peer carries both directions. Slots, per peer in `peers` order: `slots`
// send slots when this rank sends to it, then `slots` receive slots when it receives from it,
// `slot_bytes` each, each block followed by its low-latency slots (with ll_bytes and
// ll_queue_pairs, below). Messages are numbered per peer and direction from 0 since set-up;
// message m to peer p uses our send slot m % slots and lands in p's receive slot m % slots
// for us.
//
// The words, per peer, each a count of messages (monotonic), in memory both sides can reach:
//   ready      the stream filled send slots up to here      (stream writes, worker reads)
//   send_free  the NIC completed sends up to here           (worker writes, stream waits)
//   arrived    receives landed, checked and flushed         (worker writes, stream waits)
//   consumed   the stream read receive slots up to here     (stream writes, worker reads)
// plan() tells the worker the lengths of the messages of each call, per peer, in order, and
// which of them are low-latency (below), before or after the stream starts on them.
//
// The worker posts WRITE_WITH_IMM (imm = message number) of send slot m to peer p when p's
// ready > m and p's credit (its `consumed` for us, RDMA-written into our credit word for p)
// leaves its receive slot free; checks every completion (an error fails the link naming the
// peer and the verbs status); checks each arrival's number and length against the plan; calls
// `flush` before publishing it; writes `consumed` into the sending peer's credit word as it
// advances. A stall longer than the op timeout fails the link with the state of the peer waited
// for. On failure it calls ops.on_failure and ops.abort_job; when ops.abort_reason() is
// non-empty it stops quietly.
//
// Direct peers (GdrPeer::direct: ranks of this node whose GPU memory this rank can map, by
// CUDA IPC in the GPU communicator) need neither queue pair nor worker: the stream writes each
// message straight into the peer's receive slot and signals by storing into the peer's words.
// Each rank's direct region (ops.direct_make, mapped by its direct peers with
// ops.direct_open) holds a GdrWords per peer index, then its receive slots for each direct
// peer it receives from. For direct peer p (this rank is peer q of p):
//   our send slot m      = p's receive slot m % slots for us (in p's region)
//   ready  (stream)      -> stored into p's words[q].arrived
//   consumed (stream)    -> stored into p's words[q].send_free (p may write that slot again)
//   arrived, send_free   <- our own words[p] in our region, which p stores into
// stream_words() gives the stream those addresses; for RDMA peers they are the `words` given to
// create. The stream's waits keep their own deadline (the worker never sees direct messages).
// With GdrLinkConfig::ll_bytes, each direct peer's receive slots, and (with ll_queue_pairs
// too) each RDMA peer's send and receive slots, have `slots` low-latency slots of ll_bytes
// beside them (ll_slot; each block is its slots, then its low-latency slots, on every rank
// alike): a message there
// travels as 16-byte lines of 8 payload bytes, each 4 bytes followed by the message's flag
// (kernels/cuda_node_ll.cuh's format), so a receiver reads each line once its flags say it
// holds the message, without waiting for `arrived`. To a direct peer the stream writes the
// lines into the peer's slot itself; to an RDMA peer it writes them into our low-latency send
// slot and signals `ready`, and the worker posts them (WRITE_WITH_IMM, the lines' bytes,
// under the same credits) into the peer's low-latency receive slot, where the receiving
// worker checks number and length and still publishes `arrived`, which the stream then
// need not wait for. The plan (Message::ll) tells the workers which messages are low-latency.
// Only low-latency messages are ever written there, and a flag repeats only after 2^32
// messages to one peer in one direction: a line's old flags are an earlier message's, never a
// match by chance in a payload. TCP peers have no low-latency slots: their messages stay bulk
// (a frame lands by the worker's reads, which then publishes `arrived` anyway).
// A rank whose peers are all direct (one node's ring and trees) opens no RDMA device and runs
// no worker.
//
// TCP peers (GdrLinkConfig::tcp: every peer that is not direct, for nodes whose daemons have
// no RDMA device) carry the same messages over one TCP connection per peer, owned by the
// worker (gpu/gdr_link_tcp.cc): the slots are in host memory the stream reaches
// (GdrLinkOps::tcp_region), the words mean what they mean for a queue pair, and each message
// travels as a frame (header: message number and length, checked on arrival) straight from the
// send slot into the peer's receive slot for it; credits travel back as frames too. The
// connections are made at set-up and authenticated (gdr_link_tcp.cc says how).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/gradsync.h"
#include "transport/verbs/verbs.h"

namespace gradsync {

struct GdrWords {
  uint64_t arrived;
  uint64_t ready;
  uint64_t send_free;
  uint64_t consumed;
};

// A rank this one exchanges messages with, and in which directions. Symmetric: when rank a
// lists b with `send`, b lists a with `recv` (set-up checks it).
struct GdrPeer {
  int rank = -1;  // world rank
  bool send = false;
  bool recv = false;
  bool direct = false;  // through the peer's mapped memory (same node), not a queue pair
  bool tcp = false;     // over a TCP connection (set by the link from GdrLinkConfig::tcp)
};
constexpr int kMaxGdrPeers = 16;

struct GdrLinkConfig {
  std::string who;  // "job=j rank 1 (host h, GPU 0)", for messages
  int rank = 0;
  int world_size = 1;
  // This rank's peers (at most kMaxGdrPeers, no rank twice, never itself; may be empty). Set-up
  // is collective over the whole world: every rank calls create at the same point, whichever
  // peers it has, so the rings of every rail (hierarchical) are built together.
  std::vector<GdrPeer> peers;
  std::vector<std::string> hosts;  // every rank's host, for errors naming a peer
  std::string verbs_device;        // the daemon's RDMA device; empty: the node has none (a rank
                                   // whose peers are all direct needs none)
  // Non-empty: this rank takes part in the collective set-up but refuses the link (why), so
  // that every rank learns it and none gets one.
  std::string refuse;
  // Every peer that is not direct is a TCP peer: no RDMA device is opened. This rank listens
  // on `tcp_address` (its node's data address, which the peers' nodes can reach; an
  // ephemeral port), and `tcp_token` (the job token; may be empty) keys the connections'
  // proofs together with a fresh random nonce (gdr_link_tcp.h).
  bool tcp = false;
  std::string tcp_address;
  std::string tcp_token;
  int verbs_port = 1;
  int gid_index = -1;
  std::string verbs_api;  // "emulated" (the in-process test fabric) or the libibverbs soname
  size_t slot_bytes = 1u << 20;
  uint32_t slots = 4;
  // Bytes of each low-latency slot (a multiple of 16; 0: none), half of them payload: beside
  // each direct peer's receive slots and (with ll_queue_pairs) each RDMA peer's send and
  // receive slots, never a TCP peer's. Equal on every rank, as slot_bytes.
  size_t ll_bytes = 0;
  // The RDMA peers' low-latency slots exist only with this (the GPU communicator sets it where
  // GRADSYNC_PROTO=ll forces the protocol: its cost model never takes it across nodes, so
  // elsewhere they would be memory no call uses); a direct peer's need only ll_bytes. Equal on
  // every rank.
  bool ll_queue_pairs = false;
  std::chrono::milliseconds op_timeout{300'000};
  std::string log_name = "gpu";  // spdlog logger
};

// Memory the ranks of this node can map: a rank's direct region, or a peer's as opened.
constexpr size_t kGdrHandleBytes = 96;
struct GdrDirectRegion {
  uint8_t* base = nullptr;
  uint8_t handle[kGdrHandleBytes] = {};  // what a peer needs to open it (direct_make fills it)
  std::shared_ptr<void> owner;           // keeps it allocated (made) or mapped (opened)
};

// The slot region, registered with the link's protection domain by the caller (TCP
// peers: host memory, no MR).
struct GdrRegion {
  uint8_t* base = nullptr;
  const verbs::MemoryRegion* mr = nullptr;  // covers the whole region (every peer's slots)
  std::string method;                       // "dma-buf", "peermem", "host memory"
  std::shared_ptr<void> owner;              // keeps memory and MR alive; released after the QPs
};

struct GdrLinkOps {
  // A host allreduce among the job's ranks, now, on the calling thread (set-up).
  std::function<Status(const void* send, void* recv, size_t count, DataType, ReduceOp)> allreduce_now;
  std::function<std::string()> abort_reason;               // non-empty: the job was aborted
  std::function<void(const std::string& reason)> abort_job;  // abort it on every rank
  std::function<void()> on_failure;                        // the link failed (after error is set)
  // Direct peers only: allocate this rank's direct region (zeroed), and map a peer's from its
  // handle (`rank`: the peer, for errors).
  std::function<Result<GdrDirectRegion>(size_t bytes)> direct_make;
  std::function<Result<GdrDirectRegion>(const uint8_t* handle, int rank)> direct_open;
  // TCP peers only: their slots (zeroed host memory the stream reaches; mr stays null).
  std::function<Result<GdrRegion>(size_t bytes)> tcp_region;
  // Tests: called with this rank's listening address and port once it listens (set-up).
  std::function<void(const std::string& address, int port)> tcp_listening;
};

using GdrRegionMaker = std::function<Result<GdrRegion>(const verbs::ProtectionDomain& pd, size_t bytes)>;

class GdrLink {
 public:
  // Collective: every rank calls it at the same point. Null with *why_not when some rank
  // cannot set up (every rank learns which); an error only when the host allreduce failed or
  // the peers are not symmetric. `words` (one per peer, in `peers` order) must stay valid while
  // the link lives; `flush` may be empty. When the null comes from direct peers that some
  // rank could not map, *direct_refused (if given) is set on every rank: the same set-up
  // without direct peers may work.
  static Result<std::unique_ptr<GdrLink>> create(const GdrLinkConfig& cfg, const GdrLinkOps& ops,
                                                 const GdrRegionMaker& make_region, GdrWords* words,
                                                 std::function<Status()> flush, std::string* why_not,
                                                 bool* direct_refused = nullptr);
  ~GdrLink();
  GdrLink(const GdrLink&) = delete;
  GdrLink& operator=(const GdrLink&) = delete;

  int peer_count() const;
  const GdrPeer& peer(int index) const;
  int peer_index(int rank) const;  // -1 when `rank` is not a peer
  // Send slot (receive: false) or receive slot of message `msg` to or from peer `index` (a
  // direct peer's send slot is in its region).
  uint8_t* slot(int index, bool receive, uint64_t msg) const;
  // The low-latency slot of that message (a direct peer's send slot is in its region; an RDMA
  // peer's are our own, which the worker writes into the peer's low-latency receive slot):
  // null for a TCP peer, an RDMA peer without GdrLinkConfig::ll_queue_pairs, or without
  // GdrLinkConfig::ll_bytes. It holds ll_payload_bytes() of
  // payload.
  uint8_t* ll_slot(int index, bool receive, uint64_t msg) const;
  size_t ll_payload_bytes() const;
  // The bytes from one low-latency slot to the next (the lines of ll_payload_bytes()).
  size_t ll_slot_bytes() const;
  // Where the stream waits (arrived, send_free) and signals (ready, consumed) for peer `index`.
  struct StreamWords {
    uint64_t* arrived;
    uint64_t* send_free;
    uint64_t* ready;
    uint64_t* consumed;
  };
  StreamWords stream_words(int index) const;
  // Bytes of this rank's slot region (its RDMA peers' send and receive slots, with their
  // low-latency slots) and of its direct region (words and receive slots, with their
  // low-latency slots; 0 without direct peers).
  size_t region_bytes() const;
  size_t direct_region_bytes() const;
  uint32_t slots() const;
  size_t slot_bytes() const;
  // The next messages' lengths in bytes (payload), in order per peer and direction, and
  // their protocol: `ll`, the message travels in the peer's low-latency slots (ll_slot; the
  // runner asks so only where ll_slot is not null, on both ends alike), as lines of
  // (bytes + 7) / 8 * 16 bytes.
  struct Message {
    int peer = 0;  // index
    bool send = false;
    uint32_t bytes = 0;
    bool ll = false;
  };
  void plan(const std::vector<Message>& messages);
  Status error() const;
  // Payload bytes written to peer `index` so far (RDMA writes posted, the credit words not
  // counted, and of a low-latency message its payload, not its lines' flags: the same count
  // as bulk; a TCP peer's: message payloads handed to its socket, headers and credits not
  // counted; a direct peer's: the messages planned).
  uint64_t bytes_sent(int index) const;
  // Lets the last credits go out and stops the worker; the stream must be idle.
  void quiesce();
  // "<device port> (...), dma-buf, 4 x 1048576-byte slots, 2 peers".
  const std::string& describe() const;

  struct Impl;

 private:
  explicit GdrLink(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync
