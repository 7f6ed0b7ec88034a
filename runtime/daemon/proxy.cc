#include "daemon/proxy.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/framing.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/tcp_socket.h"

namespace gradsync {
namespace {

// How often a pump blocked on its socket looks at the stop flag.
constexpr int kPumpPollMs = 250;
// Pumps do not spin on channel counters: they share the cores with the ranks they serve, and a
// spinning pump steals the time slice of the rank it waits for.
constexpr std::chrono::microseconds kPumpSpin{0};
// Socket buffers: a few slots' worth, so the kernel keeps the loopback/NIC busy.
constexpr int kSocketBufferBytes = 4 << 20;

struct HelloWire {
  uint32_t magic;
  uint32_t version;
  uint32_t transport;
  uint32_t reserved;
  uint64_t generation;
  uint32_t tag;
  uint32_t src_rank;
  uint32_t dst_rank;
  uint32_t job_len;
  uint8_t nonce[16];
};

// What a proof covers, before the job id's bytes. Fixed layout, so both sides hash the same.
struct ProofHead {
  char label[16];  // "gradsync hello4"
  uint32_t role;
  uint32_t transport;
  uint64_t generation;
  uint32_t tag;
  uint32_t src_rank;
  uint32_t dst_rank;
  uint32_t job_len;
  uint8_t connector_nonce[16];
  uint8_t acceptor_nonce[16];
};

void tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = kSocketBufferBytes;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  // A peer host gone silent fails the connection in seconds (common/tcp_socket.h); the rank
  // sockets are these connections too, handed over after the handshake.
  set_data_keepalive(fd);
}

bool split_endpoint(const std::string& ep, std::string* host, std::string* port) {
  auto colon = ep.rfind(':');
  if (colon == std::string::npos) return false;
  *host = ep.substr(0, colon);
  *port = ep.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return true;
}

// What a pump's error adds when its connection timed out (the peer host went silent).
std::string lost_because(const Status& s) {
  return is_silence_error(s.message()) ? ": " + silence_cause() : "";
}

// Writes `head` then `body` to a sending pump's socket. While the kernel takes nothing (the
// peer's window or our buffer full), it looks every kPumpPollMs at the stop flag and at
// whether the peer host still answers: a silent peer is not found by the keepalive while
// data is queued (common/tcp_socket.h), and a blocking write would wait for minutes.
Status pump_write(int fd, const void* head, size_t head_len, const void* body, size_t body_len,
                  const std::atomic<bool>* stop) {
  const size_t total = head_len + body_len;
  size_t done = 0;
  while (done < total) {
    iovec iov[2];
    int n = 0;
    if (done < head_len) iov[n++] = {static_cast<char*>(const_cast<void*>(head)) + done, head_len - done};
    const size_t body_done = done > head_len ? done - head_len : 0;
    if (body_len > body_done) iov[n++] = {static_cast<char*>(const_cast<void*>(body)) + body_done, body_len - body_done};
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = size_t(n);
    ssize_t w = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      done += size_t(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (stop && stop->load(std::memory_order_acquire)) return {Code::kAborted, "stopped"};
      if (unanswered_sends(fd)) return {Code::kUnavailable, std::string("sendmsg: ") + std::strerror(ETIMEDOUT)};
      pollfd p{fd, POLLOUT, 0};
      (void)::poll(&p, 1, kPumpPollMs);
      continue;
    }
    return {Code::kUnavailable, errno_string("sendmsg")};
  }
  return Status::Ok();
}

// Waits until the socket is readable or the pump must stop.
Status wait_readable_or_stop(int fd, const std::atomic<bool>* stop) {
  for (;;) {
    if (stop && stop->load(std::memory_order_acquire)) return {Code::kAborted, "stopped"};
    pollfd p{fd, POLLIN, 0};
    int rc = ::poll(&p, 1, kPumpPollMs);
    if (rc > 0) return Status::Ok();
    if (rc < 0 && errno != EINTR) return {Code::kInternal, errno_string("poll")};
  }
}

}  // namespace

Result<Fd> tcp_listen(const std::string& host, uint16_t port, uint16_t* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string ps = std::to_string(port);
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), ps.c_str(), &hints, &res); rc != 0) {
    return Status(Code::kInvalidArgument, "cannot resolve listen address " + host + ": " + gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> guard(res, freeaddrinfo);
  Fd fd(::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Status(Code::kInternal, errno_string("socket"));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), res->ai_addr, res->ai_addrlen) != 0) {
    return Status(Code::kUnavailable, "cannot listen on " + host + ":" + ps + ": " + errno_string("bind"));
  }
  if (::listen(fd.get(), 128) != 0) return Status(Code::kInternal, errno_string("listen"));
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  *bound_port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return fd;
}

Mac hello_proof(const std::string& token, const ProxyHello& hello, const HelloNonce& acceptor_nonce, HelloRole role) {
  ProofHead head{};
  std::memcpy(head.label, "gradsync hello4", 16);
  head.role = static_cast<uint32_t>(role);
  head.transport = static_cast<uint32_t>(hello.transport);
  head.generation = hello.generation;
  head.tag = hello.tag;
  head.src_rank = hello.src_rank;
  head.dst_rank = hello.dst_rank;
  head.job_len = static_cast<uint32_t>(hello.job.size());
  std::memcpy(head.connector_nonce, hello.nonce.data(), 16);
  std::memcpy(head.acceptor_nonce, acceptor_nonce.data(), 16);
  std::string message(reinterpret_cast<const char*>(&head), sizeof(head));
  message += hello.job;
  return hmac_sha256(token, message.data(), message.size());
}

namespace {

using AddrInfo = std::unique_ptr<addrinfo, decltype(&freeaddrinfo)>;

// The addresses of a gradsyncd endpoint "host:port"; `unresolved` is the code of a name that
// does not resolve.
Result<AddrInfo> resolve_endpoint(const std::string& endpoint, int flags, Code unresolved) {
  std::string host, port;
  if (!split_endpoint(endpoint, &host, &port)) {
    return Status(Code::kInvalidArgument, "malformed peer endpoint '" + endpoint + "'");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Status(unresolved, "cannot resolve gradsyncd endpoint " + endpoint + ": " + gai_strerror(rc));
  }
  return AddrInfo(res, freeaddrinfo);
}

}  // namespace

namespace {

// "2.0 s": a span for errors.
std::string seconds_text(Clock::duration span) {
  const long long tenths = std::max<long long>(0, std::chrono::duration_cast<std::chrono::milliseconds>(span).count() / 100);
  return std::to_string(tenths / 10) + "." + std::to_string(tenths % 10) + " s";
}

// Why a connection to gradsyncd at `endpoint` failed with `err` after trying for `span`:
// kUnavailable when refused (nothing listens there) or unreachable, kDeadlineExceeded when
// nothing answered in time.
Status dial_failure(const std::string& endpoint, int err, Clock::duration span) {
  if (err == ETIMEDOUT) {
    return Status(Code::kDeadlineExceeded, "gradsyncd at " + endpoint + " did not answer a connection within " +
                                               seconds_text(span) + ": a firewall drops it, or its host is down");
  }
  if (err == ECONNREFUSED) {
    return Status(Code::kUnavailable, "gradsyncd at " + endpoint + " refuses connections: its process is gone (killed or crashed)");
  }
  return Status(Code::kUnavailable, "cannot connect to gradsyncd at " + endpoint + ": connect: " + std::strerror(err) +
                                        " (its host or the network down?)");
}

}  // namespace

Result<Fd> proxy_dial(const std::string& endpoint, Deadline deadline) {
  auto resolved = resolve_endpoint(endpoint, 0, Code::kUnavailable);
  if (!resolved.ok()) return resolved.status();
  const auto began = Clock::now();
  Dialed dialed = tcp_dial(*resolved->get(), deadline, tune);
  if (dialed.err != 0) return dial_failure(endpoint, dialed.err, Clock::now() - began);
  return std::move(dialed.fd);
}

Status probe_daemon(const std::string& endpoint, Deadline deadline) {
  auto resolved = resolve_endpoint(endpoint, AI_NUMERICSERV, Code::kDeadlineExceeded);
  if (!resolved.ok()) return resolved.status();
  const auto began = Clock::now();
  const int err = tcp_dial(*resolved->get(), deadline).err;
  if (err == 0) return Status::Ok();
  // Only a refusal proves the daemon gone; anything else may be its host or the network.
  Status s = dial_failure(endpoint, err, Clock::now() - began);
  return err == ECONNREFUSED ? s : Status(Code::kDeadlineExceeded, s.message());
}

Status hello_send(int sock, const ProxyHello& hello, uint32_t version) {
  HelloWire w{kProxyMagic, version, static_cast<uint32_t>(hello.transport), 0, hello.generation,
              hello.tag, hello.src_rank, hello.dst_rank, static_cast<uint32_t>(hello.job.size()), {}};
  std::memcpy(w.nonce, hello.nonce.data(), sizeof(w.nonce));
  return write_two(sock, &w, sizeof(w), hello.job.data(), hello.job.size());
}

Result<HelloNonce> hello_read_challenge(int sock, Deadline deadline) {
  HelloNonce n{};
  GS_RETURN_IF_ERROR(read_all(sock, n.data(), n.size(), deadline));
  return n;
}

Status hello_send_proof(int sock, const Mac& proof) { return write_all(sock, proof.data(), proof.size()); }

Result<Fd> proxy_connect(const std::string& endpoint, ProxyHello hello, const std::string& token, Deadline deadline) {
  auto fd = proxy_dial(endpoint, deadline);
  if (!fd.ok()) return fd.status();
  auto peer = [&](const Status& s) { return Status(s.code(), "gradsyncd at " + endpoint + ": " + s.message()); };
  GS_RETURN_IF_ERROR(random_bytes(hello.nonce.data(), hello.nonce.size()));
  if (Status s = hello_send(fd->get(), hello); !s.ok()) return peer(s);
  auto challenge = hello_read_challenge(fd->get(), deadline);
  if (!challenge.ok()) return peer({challenge.status().code(), "no challenge for the Hello (" +
                                                                   challenge.status().message() + "; not a gradsyncd of this version?)"});
  if (Status s = hello_send_proof(fd->get(), hello_proof(token, hello, *challenge, HelloRole::kConnector)); !s.ok()) {
    return peer(s);
  }
  if (Status s = proxy_read_reply(fd->get(), deadline); !s.ok()) return peer(s);
  Mac theirs{};
  if (Status s = read_all(fd->get(), theirs.data(), theirs.size(), deadline); !s.ok()) return peer(s);
  if (!same_mac(theirs, hello_proof(token, hello, *challenge, HelloRole::kAcceptor))) {
    return peer({Code::kPermissionDenied, "accepted the channel without proving the job token "
                                          "(not the job's gradsyncd: a wrong peer table, or an impostor at that address)"});
  }
  return fd;
}

Result<HelloNonce> hello_challenge(int sock) {
  HelloNonce n{};
  GS_RETURN_IF_ERROR(random_bytes(n.data(), n.size()));
  GS_RETURN_IF_ERROR(write_all(sock, n.data(), n.size()));
  return n;
}

Result<Mac> hello_read_proof(int sock, Deadline deadline) {
  Mac m{};
  GS_RETURN_IF_ERROR(read_all(sock, m.data(), m.size(), deadline));
  return m;
}

Status hello_accept(int sock, const Mac& acceptor_proof) {
  GS_RETURN_IF_ERROR(proxy_reply(sock, Status::Ok()));
  return write_all(sock, acceptor_proof.data(), acceptor_proof.size());
}

Result<ProxyHello> proxy_read_hello(int sock, Deadline deadline) {
  HelloWire w{};
  GS_RETURN_IF_ERROR(read_all(sock, &w, sizeof(w), deadline));
  if (w.magic != kProxyMagic) return Status(Code::kInvalidArgument, "not a gradsync data-port connection (bad magic)");
  if (w.version != kProxyVersion) {
    return Status(Code::kInvalidArgument, "a Hello of version " + std::to_string(w.version) + ", this gradsyncd speaks " +
                                              std::to_string(kProxyVersion) +
                                              " (an older gradsyncd, or a Hello without a proof of the job token)");
  }
  if (w.transport > static_cast<uint32_t>(ChannelTransport::kTcpRank)) {
    return Status(Code::kInvalidArgument, "unknown channel transport " + std::to_string(w.transport));
  }
  if (w.job_len > kMaxJobIdBytes) return Status(Code::kInvalidArgument, "job id too long");
  ProxyHello h;
  h.job.resize(w.job_len);
  GS_RETURN_IF_ERROR(read_all(sock, h.job.data(), w.job_len, deadline));
  h.transport = static_cast<ChannelTransport>(w.transport);
  h.generation = w.generation;
  h.tag = w.tag;
  h.src_rank = w.src_rank;
  h.dst_rank = w.dst_rank;
  std::memcpy(h.nonce.data(), w.nonce, h.nonce.size());
  tune(sock);
  return h;
}

Status proxy_reply(int sock, const Status& status) {
  uint32_t head[2] = {static_cast<uint32_t>(status.code()), static_cast<uint32_t>(status.message().size())};
  GS_RETURN_IF_ERROR(write_all(sock, head, sizeof(head)));
  return write_all(sock, status.message().data(), status.message().size());
}

Status proxy_read_reply(int sock, Deadline deadline) {
  uint32_t reply[2];
  Status s = read_all(sock, reply, sizeof(reply), deadline);
  if (!s.ok()) return Status(s.code(), "did not accept the channel: " + s.message());
  constexpr uint32_t kMaxReplyBytes = 64 << 10;
  if (reply[1] > kMaxReplyBytes) return Status(Code::kInternal, "malformed reply (not a gradsyncd?)");
  std::string msg(reply[1], '\0');
  GS_RETURN_IF_ERROR(read_all(sock, msg.data(), msg.size(), deadline));
  if (reply[0] != 0) return Status(static_cast<Code>(reply[0]), msg);
  return Status::Ok();
}

bool proxy_readable(int sock) {
  pollfd p{sock, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

std::string oversized_slot(const PumpContext& ctx, uint32_t bytes) {
  return "protocol error: " + ctx.local + " published a slot of " + std::to_string(bytes) +
         " bytes for " + ctx.peer + ", but slots hold " + std::to_string(ctx.layout.slot_bytes) +
         " (its memory corrupted, or a hostile trainer); nothing of it was sent";
}

const char* to_string(ChannelTransport t) {
  switch (t) {
    case ChannelTransport::kVerbs: return "verbs";
    case ChannelTransport::kTcpRank: return "tcp, on sockets the ranks move themselves";
    default: return "tcp";
  }
}

std::unique_ptr<Pump> Pump::start(PumpContext ctx, Fd sock, PumpFailure on_failure, bool sender) {
  std::unique_ptr<Pump> p(new Pump());
  p->ctx_ = std::move(ctx);
  p->sock_ = std::move(sock);
  p->sender_ = sender;
  p->thread_ = std::thread([raw = p.get(), on_failure] {
    if (raw->sender_) raw->send_loop(on_failure); else raw->recv_loop(on_failure);
    raw->finished_.store(true, std::memory_order_release);
  });
  return p;
}

std::unique_ptr<Pump> Pump::start_sender(PumpContext ctx, Fd sock, PumpFailure on_failure) {
  return start(std::move(ctx), std::move(sock), std::move(on_failure), true);
}

std::unique_ptr<Pump> Pump::start_receiver(PumpContext ctx, Fd sock, PumpFailure on_failure) {
  return start(std::move(ctx), std::move(sock), std::move(on_failure), false);
}

Pump::~Pump() { stop_and_join(); }

void Pump::stop_and_join() {
  if (!thread_.joinable()) return;
  // The thread watches ctx_.stop; shutting the socket down unblocks a send() stuck on a peer
  // that stopped reading.
  if (ctx_.stop && ctx_.stop->load()) ::shutdown(sock_.get(), SHUT_RDWR);
  thread_.join();
}

void Pump::send_loop(PumpFailure on_failure) {
  Channel ch(ctx_.shm->data(), ctx_.layout, ctx_.channel);
  WaitContext wait;
  wait.control = static_cast<const JobControl*>(ctx_.shm->data());
  wait.local_abort = ctx_.stop;
  wait.spin = kPumpSpin;
  auto log = log::get("proxy");
  for (;;) {
    if (ctx_.drain->load(std::memory_order_acquire) && ch.in_flight() == 0) {
      SlotMeta bye{};
      bye.bytes = kByeBytes;
      (void)pump_write(sock_.get(), &bye, sizeof(bye), nullptr, 0, ctx_.stop);
      log->debug("{} sender drained, closing", ctx_.ids);
      return;
    }
    // Wake up now and then to notice `drain`, which nobody signals on the channel.
    wait.deadline = deadline_after(std::chrono::milliseconds(kPumpPollMs));
    SlotMeta meta{};
    auto slot = ch.acquire_recv(wait, &meta);
    if (!slot.ok()) {
      if (slot.status().code() == Code::kDeadlineExceeded) continue;
      return;  // aborted or stopped: whoever stopped us reports why
    }
    // `meta` is our copy of what the trainer wrote: check the copy, send the copy.
    if (meta.bytes > ch.slot_bytes()) {
      if (!ctx_.stop->load()) on_failure(ctx_.local_rank, oversized_slot(ctx_, meta.bytes));
      return;
    }
    Status s = pump_write(sock_.get(), &meta, sizeof(meta), *slot, meta.bytes, ctx_.stop);
    if (!s.ok()) {
      if (!ctx_.stop->load()) on_failure(-1, "lost connection to " + ctx_.peer + ": " + s.message() + lost_because(s));
      return;
    }
    if (ctx_.pumped) ctx_.pumped->fetch_add(meta.bytes, std::memory_order_relaxed);
    ch.release();
  }
}

void Pump::recv_loop(PumpFailure on_failure) {
  Channel ch(ctx_.shm->data(), ctx_.layout, ctx_.channel);
  WaitContext wait;
  wait.control = static_cast<const JobControl*>(ctx_.shm->data());
  wait.local_abort = ctx_.stop;
  wait.spin = kPumpSpin;
  auto fail = [&](const std::string& why) {
    if (!ctx_.stop->load()) on_failure(-1, why);
  };
  for (;;) {
    SlotMeta meta{};
    if (!wait_readable_or_stop(sock_.get(), ctx_.stop).ok()) return;
    Status s = read_all(sock_.get(), &meta, sizeof(meta), Deadline::max());
    if (!s.ok()) {
      return fail("connection from " + ctx_.peer + " closed mid-job (" + s.message() + ")" +
                  (is_silence_error(s.message()) ? lost_because(s) : ": its gradsyncd died or the network failed"));
    }
    if (meta.bytes == kByeBytes) return;
    if (meta.bytes > ch.slot_bytes()) return fail("protocol error: oversized slot from " + ctx_.peer);
    auto slot = ch.acquire_send(wait);
    if (!slot.ok()) return;  // aborted
    s = read_all(sock_.get(), *slot, meta.bytes, Deadline::max());
    if (!s.ok()) return fail("connection from " + ctx_.peer + " closed mid-slot (" + s.message() + ")" + lost_because(s));
    if (ctx_.pumped) ctx_.pumped->fetch_add(meta.bytes, std::memory_order_relaxed);
    ch.publish(meta);
  }
}

}  // namespace gradsync
