// The daemon's TCP proxy (design §2, §3): pumps channel slots between this node's shared
// memory and peer daemons. One TCP connection per cross-node channel, so a stalled job never
// blocks another's.
//
// Wire format (docs/wire.md): the connecting (sending) daemon writes a Hello, the accepting
// daemon answers with a HelloReply; then a stream of frames, each a SlotMeta followed by
// meta.bytes of payload, ends with a frame whose bytes == kByeBytes (orderly end of the job).
// A connection that ends without Bye means the peer daemon died or the network failed.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "channel/channel.h"
#include "channel/shared_memory.h"
#include "common/fd.h"

namespace gradsync {

constexpr uint32_t kProxyMagic = 0x47535058;  // "GSPX"
constexpr uint32_t kProxyVersion = 3;
constexpr uint32_t kByeBytes = 0xFFFFFFFFu;

// How a cross-node channel moves its slots once the handshake is done.
enum class ChannelTransport : uint32_t {
  kTcp = 0,    // frames on this connection
  kVerbs = 1,  // RDMA writes on an RC QP; this connection only bootstraps and says Bye
  kTcpRank = 2,  // frames on this connection, but both daemons hand it to their rank after
                 // the handshake: the ranks move the slots (transport/tcp/socket_driver.h)
};
const char* to_string(ChannelTransport t);

struct ProxyHello {
  std::string job;
  ChannelTransport transport = ChannelTransport::kTcp;
  uint64_t generation = 0;
  uint32_t tag = 0;  // which channel between the two ranks (collectives/topology.h)
  uint32_t src_rank = 0;
  uint32_t dst_rank = 0;
};

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

// Client side of the handshake; kUnavailable naming the address when nobody answers.
Result<Fd> proxy_connect(const std::string& endpoint, const ProxyHello& hello, Deadline deadline);
// Server side: reads the Hello of an accepted connection.
Result<ProxyHello> proxy_read_hello(int sock, Deadline deadline);
Status proxy_reply(int sock, const Status& status);
// Reads what proxy_reply wrote: the peer's status.
Status proxy_read_reply(int sock, Deadline deadline);

// Whether the bootstrap connection of a running channel has something to read (the peer's Bye,
// or EOF when its daemon died) without blocking.
bool proxy_readable(int sock);

// A listening TCP socket on `host:port` (port 0: any); returns the bound port.
Result<Fd> tcp_listen(const std::string& host, uint16_t port, uint16_t* bound_port);

}  // namespace gradsync
