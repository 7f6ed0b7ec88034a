#include "transport/tcp/socket_driver.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <stdexcept>
#include <thread>

#include "common/tcp_socket.h"

namespace gradsync {
namespace {

// A rank asleep in poll() looks at its abort flags and deadline at least this often.
constexpr int kSliceMs = 100;
// How long a rank whose socket broke waits for the job's abort flag before it reports the
// socket (progress_until).
constexpr std::chrono::milliseconds kAbortGrace{500};
// The frame a rank sends on each of its send sockets when it leaves the job healthy (goodbye):
// a meta whose byte count no slot can have. A receiver still waiting then knows the peer left
// after its last call (a mismatch in the number of calls), not that it died.
constexpr uint32_t kByeBytes = 0xFFFFFFFFu;
// The frame a rank sends on each of its sockets, both ways, when the job ended for it
// (tell_abort): a meta with this byte count, seq = the rank it names (uint32_t(-1): none) and
// count = the length of the reason that follows it.
constexpr uint32_t kAbortBytes = 0xFFFFFFFEu;
// How long a rank reads the rest of an abort frame once its first bytes came.
constexpr std::chrono::milliseconds kToldReadTimeout{200};
// poke() (a rank waiting on shared memory) looks for abort frames on send sockets this often.
constexpr std::chrono::milliseconds kLookBackEvery{1};
// A waiting rank looks this often for send sockets whose peer host went silent with data
// in flight (check_silent_sends): a tenth of the limit it enforces (about 5 s).
constexpr std::chrono::milliseconds kSilenceCheckEvery{500};
constexpr size_t kMetaBytes = sizeof(SlotMeta);
// Channel ends one rank can own: rings x 2 plus 2 trees x 6 is far below.
constexpr size_t kMaxPorts = 256;

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

bool would_block(int err) { return err == EAGAIN || err == EWOULDBLOCK; }

// Reads up to `n` bytes from non-blocking `fd` until `deadline`; how many came (fewer when the
// peer closed it, it broke, or the deadline passed).
size_t read_until(int fd, void* dst, size_t n, Deadline deadline) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd, static_cast<char*>(dst) + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += size_t(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && would_block(errno)) {
      pollfd pfd{fd, POLLIN, 0};
      int timeout = poll_timeout_ms(deadline, 50);
      if (timeout == 0 && Clock::now() >= deadline) break;
      (void)::poll(&pfd, 1, timeout);
      continue;
    }
    break;
  }
  return got;
}

// "10.0.0.2:41234" or "[::1]:41234": the far end of a connected socket, for errors.
std::string peer_address(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  return "a local socket";
}

// The lane of the calling thread in the driver whose lanes it entered.
thread_local const void* t_lanes_of = nullptr;
thread_local int t_lane = 0;
// When the calling thread next looks for silent send sockets (Clock ticks).
thread_local int64_t t_next_silence_check = 0;

}  // namespace

SocketDriver::SocketDriver(std::string who) : who_(std::move(who)) {
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
}

bool SocketDriver::mine(const Port& p) const {
  if (!lanes_) return true;
  const int lane = t_lanes_of == this ? t_lane : 0;
  return p.lane == lane || (p.lane < 0 && lane == 0);
}

Status SocketDriver::failure() const {
  if (!has_failed_.load(std::memory_order_acquire)) return Status::Ok();
  std::lock_guard<std::mutex> lock(failed_mu_);
  return failed_;
}

Status SocketDriver::fail(Status s) {
  std::lock_guard<std::mutex> lock(failed_mu_);
  if (failed_.ok()) {
    failed_ = std::move(s);
    has_failed_.store(true, std::memory_order_release);
  }
  return failed_;
}

bool SocketDriver::begin_lanes() {
  lanes_ = true;  // every port's lane is -1 here: set so at add(), and again by end_lanes()
  enter_lane(0);
  return true;
}

void SocketDriver::assign_lane(bool send, uint32_t channel, int lane) {
  for (Port& p : ports_) {
    if (p.send == send && p.ch.index() == channel) p.lane = lane;
  }
}

void SocketDriver::enter_lane(int lane) {
  t_lanes_of = this;
  t_lane = lane;
}

void SocketDriver::end_lanes() {
  lanes_ = false;
  for (Port& p : ports_) p.lane = -1;
  t_lanes_of = nullptr;
  t_lane = 0;
}

void SocketDriver::add(Channel ch, Fd sock, bool send, std::string peer, int peer_rank) {
  if (ports_.size() >= kMaxPorts) throw std::length_error("SocketDriver: too many channel ends");
  int flags = ::fcntl(sock.get(), F_GETFL);
  if (flags >= 0) ::fcntl(sock.get(), F_SETFL, flags | O_NONBLOCK);
  // gradsyncd set it when it connected the socket; set here too, so that a peer host gone
  // silent fails this connection in seconds however the socket was made.
  set_data_keepalive(sock.get());
  Port p;
  p.ch = ch;
  p.ch.set_driver(nullptr, false);  // the driver's own view: plain counters
  // The peer's name with the far end of this very connection: "rank 1 (host b) at 10.0.0.2:41234".
  p.peer = std::move(peer) + " at " + peer_address(sock.get());
  p.peer_rank = peer_rank;
  p.sock = std::move(sock);
  p.send = send;
  ports_.push_back(std::move(p));
}

void SocketDriver::add_sender(Channel ch, Fd sock, std::string peer, int peer_rank) {
  add(ch, std::move(sock), true, std::move(peer), peer_rank);
}

void SocketDriver::add_receiver(Channel ch, Fd sock, std::string peer, int peer_rank) {
  add(ch, std::move(sock), false, std::move(peer), peer_rank);
}

Status SocketDriver::broken(const Port& p, const std::string& what) const {
  const std::string conn = who_ + ": the TCP connection " + (p.send ? "to " : "from ") + p.peer + " " + what;
  if (is_silence_error(what)) {
    // The keepalive gave up: that host is silent, which a cut of the network between the two
    // nodes looks like from either side. Neither rank failed, so none is recorded as the
    // culprit (not even by a socket that breaks later); the message names the peer across.
    int none = -1;
    broken_peer_.compare_exchange_strong(none, kCulpritNotKnown, std::memory_order_acq_rel);
    return {Code::kUnavailable, conn + ": " + silence_cause()};
  }
  int none = -1;
  broken_peer_.compare_exchange_strong(none, p.peer_rank, std::memory_order_acq_rel);
  return {Code::kUnavailable, conn + ": that rank's process exited, or its node or the network failed"};
}

Status SocketDriver::pump_send(Port& p, bool* moved) {
  // Frames of published slots, oldest first: the driver is the staging channel's consumer.
  if (p.closed && p.ch.consumed() != p.ch.published()) return broken(p, "was closed");
  while (p.ch.consumed() != p.ch.published()) {
    const uint32_t seq = p.ch.consumed();
    const SlotMeta* meta = p.ch.slot_meta(seq);
    const size_t total = kMetaBytes + meta->bytes;
    const uint8_t* payload = p.external[seq % p.ch.slots()] ? p.external[seq % p.ch.slots()] : p.ch.slot_data(seq);
    iovec iov[2];
    int n = 0;
    if (p.done < kMetaBytes) {
      iov[n++] = {reinterpret_cast<char*>(const_cast<SlotMeta*>(meta)) + p.done, kMetaBytes - p.done};
      iov[n++] = {const_cast<uint8_t*>(payload), meta->bytes};
    } else {
      iov[n++] = {const_cast<uint8_t*>(payload) + (p.done - kMetaBytes), total - p.done};
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = n;
    ssize_t w = ::sendmsg(p.sock.get(), &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (would_block(errno)) return Status::Ok();
      return broken(p, std::string("failed (") + errno_string("send") + ")");
    }
    *moved = true;
    p.done += size_t(w);
    if (p.done < total) return Status::Ok();  // the kernel took part of it: its buffer is full
    p.done = 0;
    p.external[seq % p.ch.slots()] = nullptr;
    p.ch.release();  // the slot is in the kernel: its credit goes back to the rank
  }
  return Status::Ok();
}

Status SocketDriver::pump_recv(Port& p, bool* moved) {
  // Frames into free slots of the incoming channel: the driver is its producer.
  while (p.ch.published() - p.ch.consumed() < p.ch.slots()) {
    const uint32_t seq = p.ch.published();
    ssize_t r;
    if (p.done < kMetaBytes) {
      r = ::recv(p.sock.get(), reinterpret_cast<char*>(&p.meta) + p.done, kMetaBytes - p.done, MSG_DONTWAIT);
    } else {
      r = ::recv(p.sock.get(), p.dest + (p.done - kMetaBytes), kMetaBytes + p.meta.bytes - p.done, MSG_DONTWAIT);
    }
    if (r == 0) {
      // At a frame boundary the peer may simply be done (its last call needed nothing more
      // from this rank); it is an error only for a rank that waits on this channel.
      if (p.done != 0) return broken(p, "was closed in the middle of a slot");
      p.closed = true;
      return Status::Ok();
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (would_block(errno)) return Status::Ok();
      return broken(p, std::string("failed (") + errno_string("recv") + ")");
    }
    *moved = true;
    p.done += size_t(r);
    if (p.done == kMetaBytes && p.meta.bytes == kByeBytes) {
      p.done = 0;
      p.closed = p.left = true;
      return Status::Ok();
    }
    if (p.done == kMetaBytes && p.meta.bytes == kAbortBytes) {
      p.done = 0;
      p.closed = true;  // nothing follows an abort
      return read_told(p, p.meta);
    }
    if (p.done == kMetaBytes && p.meta.bytes > p.ch.slot_bytes()) {
      return {Code::kInternal, who_ + ": protocol error: " + p.peer + " sent a slot of " +
                                   std::to_string(p.meta.bytes) + " bytes into slots of " +
                                   std::to_string(p.ch.slot_bytes()) + " (peers of different versions?)"};
    }
    if (p.done == kMetaBytes) {
      // The payload starts: straight into the caller's buffer when the rank asked for this
      // very frame there, else into the slot.
      const bool direct = p.direct && p.direct_seq == seq && std::memcmp(&p.meta, &p.direct_meta, kMetaBytes) == 0;
      p.dest = direct ? p.direct : p.ch.slot_data(seq);
      p.landed[seq % p.ch.slots()] = direct ? p.direct : nullptr;
      if (direct) p.direct = nullptr;
    }
    if (p.done < kMetaBytes + p.meta.bytes) continue;
    p.done = 0;
    p.ch.publish(p.meta);
  }
  return Status::Ok();
}

Status SocketDriver::pump(bool* moved, int focus) {
  GS_RETURN_IF_ERROR(failure());
  for (Port& p : ports_) {
    if ((p.closed && !p.send) || !mine(p)) continue;
    // Sends with nothing queued cost no system call; receives do, so a focused pass reads
    // only the channel waited on.
    if (!p.send && focus >= 0 && int(p.ch.index()) != focus) continue;
    Status s = p.send ? pump_send(p, moved) : pump_recv(p, moved);
    if (!s.ok()) return fail(std::move(s));
  }
  return Status::Ok();
}

Status SocketDriver::poke(const WaitContext& ctx) {
  bool moved = false;
  Status s = pump(&moved);
  // A rank waiting on shared memory reads no send socket otherwise: a peer's abort told there
  // would wait for its next wait on a socket.
  const int64_t now = Clock::now().time_since_epoch().count();
  if (s.ok() && now >= next_look_back_.load(std::memory_order_relaxed)) {
    next_look_back_.store(now + std::chrono::duration_cast<Clock::duration>(kLookBackEvery).count(),
                          std::memory_order_relaxed);
    s = wait_sockets(0, true);
  }
  if (s.ok()) s = check_silent_sends();
  return after_break(std::move(s), ctx);
}

void SocketDriver::send_from(uint32_t channel, uint32_t seq, const void* data) {
  for (Port& p : ports_) {
    if (p.send && p.ch.index() == channel) p.external[seq % p.ch.slots()] = static_cast<const uint8_t*>(data);
  }
}

void SocketDriver::recv_into(uint32_t channel, uint32_t seq, const SlotMeta& expect, void* dst) {
  for (Port& p : ports_) {
    if (p.send || p.ch.index() != channel) continue;
    p.direct = static_cast<uint8_t*>(dst);
    p.direct_seq = seq;
    p.direct_meta = expect;
    return;
  }
}

const uint8_t* SocketDriver::landed_at(uint32_t channel, uint32_t seq) {
  for (Port& p : ports_) {
    if (p.send || p.ch.index() != channel) continue;
    p.direct = nullptr;  // whatever landed, the request is spent
    return std::exchange(p.landed[seq % p.ch.slots()], nullptr);
  }
  return nullptr;
}

void SocketDriver::abandon(const Status& why) {
  (void)fail(why);
  for (Port& p : ports_) {
    p.external.fill(nullptr);
    p.landed.fill(nullptr);
    p.direct = nullptr;
  }
}

void SocketDriver::published(uint32_t channel) {
  if (has_failed_.load(std::memory_order_acquire)) return;
  for (Port& p : ports_) {
    if (!p.send || p.ch.index() != channel) continue;
    if (!mine(p)) return;  // its lane's thread sends it
    bool moved = false;
    Status s = pump_send(p, &moved);
    if (!s.ok()) (void)fail(std::move(s));  // reported by the rank's next wait or flush
    return;
  }
}

Status SocketDriver::wait_sockets(int timeout_ms, bool send_only) {
  pollfd fds[kMaxPorts + 1];
  Port* of[kMaxPorts + 1];
  nfds_t n = 0;
  for (Port& p : ports_) {
    if (p.closed || !mine(p)) continue;
    short events = 0;
    // Nothing ever comes back on a send socket: readable means the peer closed it or it broke,
    // which a rank waiting for some other peer must hear too.
    if (p.send) events = POLLIN | (!send_only && p.ch.consumed() != p.ch.published() ? POLLOUT : 0);
    else if (!send_only && p.ch.published() - p.ch.consumed() < p.ch.slots()) events = POLLIN;
    if (!events) continue;
    fds[n] = {p.sock.get(), events, 0};
    of[n++] = &p;
  }
  if (wake_.valid()) {
    fds[n] = {wake_.get(), POLLIN, 0};  // interrupt(): never read, so it wakes every sleeper
    of[n++] = nullptr;
  }
  int rc = ::poll(fds, n, timeout_ms);
  if (rc < 0 && errno != EINTR) return {Code::kInternal, who_ + ": " + errno_string("poll")};
  for (nfds_t i = 0; rc > 0 && i < n; ++i) {
    if (!of[i] || !of[i]->send || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    char byte;
    ssize_t r = ::recv(fds[i].fd, &byte, 1, MSG_DONTWAIT | MSG_PEEK);
    if (r == 0) {
      // The peer closed it: fine when nothing more is owed to it (it finished its last call).
      of[i]->closed = true;
      if (of[i]->ch.consumed() != of[i]->ch.published()) return fail(broken(*of[i], "was closed"));
    } else if (r < 0 && !would_block(errno) && errno != EINTR) {
      return fail(broken(*of[i], "failed (" + errno_string("recv") + ")"));
    } else if (r > 0) {
      return fail(read_back(*of[i]));  // only an abort comes back
    }
  }
  return Status::Ok();
}

Status SocketDriver::check_silent_sends() {
  const int64_t now = Clock::now().time_since_epoch().count();
  if (now < t_next_silence_check) return Status::Ok();
  t_next_silence_check = now + std::chrono::duration_cast<Clock::duration>(kSilenceCheckEvery).count();
  for (Port& p : ports_) {
    if (!p.send || p.closed || !mine(p) || !unanswered_sends(p.sock.get())) continue;
    // Worded as the kernel's own timeout, which is what it stands in for.
    return fail(broken(p, std::string("failed (send: ") + std::strerror(ETIMEDOUT) + ")"));
  }
  return Status::Ok();
}

Status SocketDriver::read_back(Port& p) {
  SlotMeta meta{};
  const size_t got = read_until(p.sock.get(), &meta, kMetaBytes, deadline_after(kToldReadTimeout));
  if (got != kMetaBytes || meta.bytes != kAbortBytes) {
    return {Code::kInternal, who_ + ": protocol error: " + p.peer + " sent data on a send-only channel"};
  }
  p.closed = true;  // nothing follows an abort
  return read_told(p, meta);
}

Status SocketDriver::read_told(Port& p, const SlotMeta& meta) {
  if (meta.count > kAbortReasonBytes) {
    return {Code::kInternal, who_ + ": protocol error: " + p.peer + " sent an abort reason of " +
                                 std::to_string(meta.count) + " bytes"};
  }
  std::string reason(size_t(meta.count), '\0');
  // A reason cut short (the peer gave up writing it) is still the best there is.
  reason.resize(read_until(p.sock.get(), reason.data(), reason.size(), deadline_after(kToldReadTimeout)));
  for (char& c : reason) {
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';  // one line in logs
  }
  ToldAbort told{true, reason, static_cast<int32_t>(meta.seq), p.peer};
  Status s(Code::kAborted, who_ + ": " + p.peer + " ended the job: " + reason);
  std::lock_guard<std::mutex> lock(failed_mu_);
  if (!told_.told) told_ = std::move(told);
  // A socket found closed just before is most likely the echo of this very abort: the reason
  // the peer told names the cause, the closed socket does not.
  if (failed_.ok() || failed_.code() == Code::kUnavailable) {
    failed_ = std::move(s);
    has_failed_.store(true, std::memory_order_release);
  }
  return failed_;
}

bool SocketDriver::write_until(Port& p, const void* data, size_t n, Deadline deadline) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::send(p.sock.get(), static_cast<const char*>(data) + done, n - done, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r > 0) {
      done += size_t(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && would_block(errno)) {
      pollfd pfd{p.sock.get(), POLLOUT, 0};
      int timeout = poll_timeout_ms(deadline, 100);
      if (timeout == 0 && Clock::now() >= deadline) return false;
      (void)::poll(&pfd, 1, timeout);
      continue;
    }
    return false;  // the peer is gone already: nothing to tell it
  }
  return true;
}

void SocketDriver::tell_abort(const std::string& reason, int culprit, Deadline deadline) {
  const std::string text = reason.substr(0, kAbortReasonBytes);
  SlotMeta meta{};
  meta.bytes = kAbortBytes;
  meta.seq = static_cast<uint32_t>(culprit);
  meta.count = text.size();
  std::string frame(reinterpret_cast<const char*>(&meta), kMetaBytes);
  frame += text;
  for (Port& p : ports_) {
    // A send socket in the middle of a frame cannot carry another one: that peer finds it
    // closed mid-slot, and hears the reason from the other direction or from its node.
    if (p.closed || (p.send && p.done != 0)) continue;
    (void)write_until(p, frame.data(), frame.size(), deadline);
  }
}

ChannelDriver::ToldAbort SocketDriver::told_abort() const {
  std::lock_guard<std::mutex> lock(failed_mu_);
  return told_;
}

void SocketDriver::interrupt() {
  uint64_t one = 1;
  if (wake_.valid() && ::write(wake_.get(), &one, sizeof(one)) < 0) { /* already readable */ }
}

Status SocketDriver::progress_until(const std::function<bool()>& ready, const WaitContext& ctx, int channel) {
  return after_break(progress(ready, ctx, channel), ctx);
}

Status SocketDriver::after_break(Status s, const WaitContext& ctx) {
  if (s.code() != Code::kUnavailable) return s;
  // A socket broke. When the job was aborted (a rank gave up, a node was lost), the peer's
  // process usually closed it on the way out, and the abort's reason, which gradsyncd brings
  // a moment later, names the cause better than the closed socket does: wait a little for it.
  // A peer may also tell the reason on another of this rank's sockets (tell_abort).
  const auto until = Clock::now() + kAbortGrace;
  while (Clock::now() < until && Clock::now() < ctx.deadline) {
    if (told_abort().told) return failure();
    if (wait_stopped(ctx)) return aborted_status(ctx);
    (void)wait_sockets(2, true);
  }
  if (told_abort().told) return failure();
  return wait_stopped(ctx) ? aborted_status(ctx) : s;
}

Status SocketDriver::progress(const std::function<bool()>& ready, const WaitContext& ctx, int channel) {
  const auto spin_until = Clock::now() + ctx.spin, yield_until = spin_until + ctx.yield_spin;
  // Every socket is read on the first pass and after every sleep; while spinning, only the
  // channel waited on (and queued sends): a spin pass is then one or two system calls.
  bool full = true;
  for (;;) {
    if (ready()) return Status::Ok();
    bool moved = false;
    GS_RETURN_IF_ERROR(pump(&moved, full ? -1 : channel));
    full = false;
    if (ready()) return Status::Ok();
    if (moved) continue;
    if (channel >= 0) {
      for (const Port& p : ports_) {
        if (p.closed && int(p.ch.index()) == channel && mine(p)) {
          // A peer that said goodbye left the job after its last call: this rank made more.
          return p.left ? Status(Code::kMismatch, kPeerLeftMessage) : broken(p, "was closed");
        }
      }
    }
    if (wait_stopped(ctx)) return aborted_status(ctx);
    const auto now = Clock::now();
    if (now < spin_until) {
      for (int i = 0; i < 16; ++i) cpu_relax();
      continue;
    }
    if (now < yield_until) {
      sched_yield();
      continue;
    }
    int timeout = poll_timeout_ms(ctx.deadline, kSliceMs);
    if (timeout == 0 && Clock::now() >= ctx.deadline) return {Code::kDeadlineExceeded, "deadline passed"};
    GS_RETURN_IF_ERROR(check_silent_sends());
    GS_RETURN_IF_ERROR(wait_sockets(timeout));
    full = true;
  }
}

Status SocketDriver::flush(const WaitContext& ctx) {
  return progress_until(
      [&] {
        return std::all_of(ports_.begin(), ports_.end(), [&](const Port& p) {
          return !p.send || !mine(p) || p.ch.consumed() == p.ch.published();
        });
      },
      ctx, -1);
}

void SocketDriver::goodbye(Deadline deadline) {
  SlotMeta bye{};
  bye.bytes = kByeBytes;
  for (Port& p : ports_) {
    if (!p.send || p.closed || failure().code() != Code::kOk) continue;
    (void)write_until(p, &bye, kMetaBytes, deadline);  // false: past the deadline, or the peer is gone
  }
}

}  // namespace gradsync
