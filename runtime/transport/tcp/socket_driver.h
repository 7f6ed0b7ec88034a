// Rank-owned TCP channels (docs/architecture.md, "Rank sockets"): the cross-node channels of a
// rank whose two nodes both run TCP, moved by the rank's own thread instead of gradsyncd's
// proxy. The daemons still find the peer, connect, check the handshake and hand each rank the
// connected sockets of its channel ends (SCM_RIGHTS with the join reply); from then on a slot
// goes rank -> kernel -> peer rank, with no hand-off to another process on either side.
//
// Each socket carries the frames of one channel, the same frames the proxy sends: SlotMeta, then
// meta.bytes of payload. The send side's slots are the rank's staging channel in shared memory
// (the driver is that channel's consumer); the receive side reads each frame straight into a
// slot of the rank's incoming channel (the driver is its producer). So the algorithms see the
// same channels, credits and checks as with the proxy.
//
// Progress happens only inside the rank's waits (ChannelDriver). Every wait of a rank that owns
// sockets moves all of them, and a collective ends with flush(), so a rank never holds back a
// slot a peer is waiting for. Inside lanes (a large ring call on several threads) each thread
// moves the sockets of its own rings, in parallel; a thread flushes its lane before it leaves.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "channel/channel.h"
#include "common/fd.h"

namespace gradsync {

class SocketDriver : public ChannelDriver {
 public:
  // `who` names this rank in errors: "job=x rank 3 (host h)".
  explicit SocketDriver(std::string who);

  // Takes one channel end. `ch` is a view without a driver (the driver's own side of it);
  // `peer` names the rank at the other end: "rank 1 (host h)"; errors add the address and
  // port of the connection's far end.
  // `peer_rank`: that rank's number, for failed_peer() (-1: not known).
  void add_sender(Channel ch, Fd sock, std::string peer, int peer_rank = -1);
  void add_receiver(Channel ch, Fd sock, std::string peer, int peer_rank = -1);
  size_t size() const { return ports_.size(); }

  Status progress_until(const std::function<bool()>& ready, const WaitContext& ctx, int channel) override;
  Status poke(const WaitContext& ctx) override;
  void published(uint32_t channel) override;
  void send_from(uint32_t channel, uint32_t seq, const void* data) override;
  void recv_into(uint32_t channel, uint32_t seq, const SlotMeta& expect, void* dst) override;
  const uint8_t* landed_at(uint32_t channel, uint32_t seq) override;
  void abandon(const Status& why) override;
  Status flush(const WaitContext& ctx) override;
  int failed_peer() const override { return std::max(-1, broken_peer_.load(std::memory_order_acquire)); }
  void goodbye(Deadline deadline) override;
  void tell_abort(const std::string& reason, int culprit, Deadline deadline) override;
  ToldAbort told_abort() const override;
  void interrupt() override;
  bool begin_lanes() override;
  void assign_lane(bool send, uint32_t channel, int lane) override;
  void enter_lane(int lane) override;
  void end_lanes() override;

 private:
  struct Port {
    Channel ch;
    Fd sock;
    bool send = false;
    std::string peer;
    int peer_rank = -1;
    size_t done = 0;       // bytes of the current frame (meta + payload) moved so far
    SlotMeta meta{};       // receive side: the frame being read
    bool closed = false;   // the peer closed its end (at a frame boundary)
    bool left = false;     // ... after its goodbye frame: it left the job healthy
    // Send side: the payload of slot seq % kMaxSlots when it is not in the slot (send_from).
    std::array<const uint8_t*, kMaxSlots> external{};
    // Receive side: where the next frame may land instead of its slot (recv_into) ...
    uint8_t* direct = nullptr;
    uint32_t direct_seq = 0;
    SlotMeta direct_meta{};
    uint8_t* dest = nullptr;  // ... where the current frame's payload goes ...
    std::array<const uint8_t*, kMaxSlots> landed{};  // ... and where each slot's went
    int lane = -1;  // inside lanes: the thread that moves this socket (-1: lane 0)
  };

  void add(Channel ch, Fd sock, bool send, std::string peer, int peer_rank);
  Status progress(const std::function<bool()>& ready, const WaitContext& ctx, int channel);
  // A broken socket's error (kUnavailable), or the job's abort when it arrives within
  // kAbortGrace: the abort names the cause; other statuses pass through.
  Status after_break(Status s, const WaitContext& ctx);
  // Moves what each socket takes or has right now (`focus` >= 0: of the receive sockets, only
  // that channel's). Sets *moved when anything did.
  Status pump(bool* moved, int focus = -1);
  Status pump_send(Port& p, bool* moved);
  Status pump_recv(Port& p, bool* moved);
  Status broken(const Port& p, const std::string& what) const;
  // Sleeps until a socket with work is ready, at most `timeout_ms` (`send_only`: only
  // something coming back on a send socket, or interrupt(), ends the sleep early).
  Status wait_sockets(int timeout_ms, bool send_only = false);
  // Reads the reason of an abort frame whose meta is `meta` from `p` (the frame's meta already
  // read) and records it: the failure every wait reports from now on.
  Status read_told(Port& p, const SlotMeta& meta);
  // Every kSilenceCheckEvery (per thread: each lane checks its own sockets): fails the first
  // send socket whose peer host has answered nothing for the data connections' limit while
  // data waits (common/tcp_socket.h).
  Status check_silent_sends();
  // Reads what came back on send socket `p` (only ever an abort frame).
  Status read_back(Port& p);
  // Writes `n` bytes to `p`'s socket until `deadline`; false when it could not.
  bool write_until(Port& p, const void* data, size_t n, Deadline deadline);
  // Whether the calling thread moves `p` (always, outside lanes).
  bool mine(const Port& p) const;
  // The first failure (the lanes' threads share it), and recording one.
  Status failure() const;
  Status fail(Status s);

  std::string who_;
  std::vector<Port> ports_;
  bool lanes_ = false;  // set and cleared while only one thread uses the driver
  std::atomic<bool> has_failed_{false};
  mutable std::mutex failed_mu_;
  Status failed_;  // the first broken socket: every later wait reports it
  // The rank of the first socket found broken; kCulpritNotKnown when that one went silent.
  static constexpr int kCulpritNotKnown = -2;
  mutable std::atomic<int> broken_peer_{-1};
  ToldAbort told_;  // under failed_mu_: the first abort a peer told (tell_abort)
  Fd wake_;         // an eventfd, readable once interrupt() was called (it stays so)
  // When poke() next looks for frames coming back on send sockets (Clock ticks).
  std::atomic<int64_t> next_look_back_{0};
};

}  // namespace gradsync
