// The daemon's TCP proxy (design §2, §3): pumps channel slots between this node's shared
// memory and peer daemons. One TCP connection per cross-node channel, so a stalled job never
// blocks another's.
//
// Wire format (docs/wire.md): the connecting (sending) daemon writes a Hello with a nonce, the
// accepting daemon answers with its own nonce, the connector proves the job token with an
// HMAC over the Hello and both nonces, and the acceptor answers with a HelloReply and, when
// it accepted, its own proof. Then a stream of frames, each a SlotMeta followed by
// meta.bytes of payload, ends with a frame whose bytes == kByeBytes (orderly end of the job).
// A connection that ends without Bye means the peer daemon died or the network failed.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "channel/channel.h"
#include "channel/shared_memory.h"
#include "common/fd.h"
#include "common/secret.h"

namespace gradsync {

constexpr uint32_t kProxyMagic = 0x47535058;  // "GSPX"
constexpr uint32_t kProxyVersion = 4;
constexpr uint32_t kByeBytes = 0xFFFFFFFFu;

// How a cross-node channel moves its slots once the handshake is done.
enum class ChannelTransport : uint32_t {
  kTcp = 0,    // frames on this connection
  kVerbs = 1,  // RDMA writes on an RC QP; this connection only bootstraps and says Bye
  kTcpRank = 2,  // frames on this connection, but both daemons hand it to their rank after
                 // the handshake: the ranks move the slots (transport/tcp/socket_driver.h)
};
const char* to_string(ChannelTransport t);

using HelloNonce = std::array<uint8_t, 16>;

struct ProxyHello {
  std::string job;
  ChannelTransport transport = ChannelTransport::kTcp;
  uint64_t generation = 0;
  uint32_t tag = 0;  // which channel between the two ranks (collectives/topology.h)
  uint32_t src_rank = 0;
  uint32_t dst_rank = 0;
  HelloNonce nonce{};  // the connector's, fresh per connection
};

// Who computes a proof: the two sides' proofs differ, so one cannot be reflected as the other.
enum class HelloRole : uint32_t { kConnector = 1, kAcceptor = 2 };
// HMAC-SHA256 under the job token over the role, every field of the Hello (job, transport,
// generation, tag, ranks), the connector's nonce and the acceptor's nonce.
Mac hello_proof(const std::string& token, const ProxyHello& hello, const HelloNonce& acceptor_nonce, HelloRole role);

// Reports a broken connection: (failed rank or -1, reason).
using PumpFailure = std::function<void(int, const std::string&)>;

// What a pump needs of its job: the region, the channel, and flags that stop it.
struct PumpContext {
  std::shared_ptr<SharedMemory> shm;
  ShmLayout layout;
  uint32_t channel = 0;
  const std::atomic<bool>* stop = nullptr;   // the job is over (aborted or torn down)
  const std::atomic<bool>* drain = nullptr;  // every local rank left: send what is queued, then Bye
  std::string peer;                          // "rank 3 (host h, gradsyncd h:port)" for errors
  std::string ids;                           // "job=x gen=1 ch=2" for logs
  // Sending side: the local rank that fills the staging channel, blamed when a slot's
  // metadata (which that trainer writes) is out of bounds.
  int local_rank = -1;
  std::string local;                         // "rank 0 (pid 123, host h)"
  // Payload bytes moved on this channel, added to the daemon's per-peer-daemon counter (or null).
  std::shared_ptr<std::atomic<uint64_t>> pumped;
};

// One end of a cross-node channel, on its own thread: the transport-independent face that
// LocalJob and the daemon's teardown use (TCP: Pump below; verbs: daemon/verbs_pump.h).
class ChannelPump {
 public:
  virtual ~ChannelPump() = default;
  // Unblocks the thread (it also watches the job's stop flag) and joins it.
  virtual void stop_and_join() = 0;
  virtual bool is_sender() const = 0;
  virtual bool finished() const = 0;
};

// One cross-node channel end over TCP, with its thread.
class Pump : public ChannelPump {
 public:
  // Sending side: staging channel -> socket.
  static std::unique_ptr<Pump> start_sender(PumpContext ctx, Fd sock, PumpFailure on_failure);
  // Receiving side: socket -> the local rank's incoming channel.
  static std::unique_ptr<Pump> start_receiver(PumpContext ctx, Fd sock, PumpFailure on_failure);
  ~Pump() override;

  void stop_and_join() override;
  bool is_sender() const override { return sender_; }
  bool finished() const override { return finished_.load(std::memory_order_acquire); }

 private:
  Pump() = default;
  static std::unique_ptr<Pump> start(PumpContext ctx, Fd sock, PumpFailure on_failure, bool sender);
  void send_loop(PumpFailure on_failure);
  void recv_loop(PumpFailure on_failure);

  PumpContext ctx_;
  Fd sock_;
  bool sender_ = false;
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

// The error of a sending pump whose local rank published more bytes than a slot holds.
std::string oversized_slot(const PumpContext& ctx, uint32_t bytes);

// Client side of the handshake (a fresh nonce, the proof of `token`, the acceptor's proof
// checked); kUnavailable naming the address when nobody answers, kPermissionDenied when the
// acceptor cannot prove the token.
Result<Fd> proxy_connect(const std::string& endpoint, ProxyHello hello, const std::string& token, Deadline deadline);
// The client's steps one by one, for tests that play a hostile peer: a connected socket, the
// Hello as given (nonce included), the acceptor's nonce, a proof. The connection is made by
// `deadline`: kDeadlineExceeded naming the endpoint when nothing answered by then (a firewall
// drops it, or its host is down), kUnavailable when it is refused or unreachable.
Result<Fd> proxy_dial(const std::string& endpoint, Deadline deadline);
// Whether gradsyncd at `endpoint` still accepts connections (the connection is closed at
// once, before any byte): OK when it does; kUnavailable when the host refuses it (nothing
// listens there: that daemon is gone); kDeadlineExceeded when nothing answered by `deadline`
// (its host or the network is down, or it is too busy to tell).
Status probe_daemon(const std::string& endpoint, Deadline deadline);
Status hello_send(int sock, const ProxyHello& hello, uint32_t version = kProxyVersion);
Result<HelloNonce> hello_read_challenge(int sock, Deadline deadline);
Status hello_send_proof(int sock, const Mac& proof);

// Server side: reads the Hello of an accepted connection.
Result<ProxyHello> proxy_read_hello(int sock, Deadline deadline);
// Sends this side's fresh nonce, which the connector's proof must cover.
Result<HelloNonce> hello_challenge(int sock);
Result<Mac> hello_read_proof(int sock, Deadline deadline);
// Accepts the channel: an OK reply, then this side's proof.
Status hello_accept(int sock, const Mac& acceptor_proof);
Status proxy_reply(int sock, const Status& status);
// Reads what proxy_reply wrote: the peer's status.
Status proxy_read_reply(int sock, Deadline deadline);

// Whether the bootstrap connection of a running channel has something to read (the peer's Bye,
// or EOF when its daemon died) without blocking.
bool proxy_readable(int sock);

// A listening TCP socket on `host:port` (port 0: any); returns the bound port.
Result<Fd> tcp_listen(const std::string& host, uint16_t port, uint16_t* bound_port);

}  // namespace gradsync
