// TCP peers of the step link (gpu/gdr_link.h): their connections and the worker that moves
// their messages.
//
// Set-up. Each rank with TCP peers listens on an ephemeral port of its data address
// (GdrLinkConfig::tcp_address); the addresses, ports and a fresh random nonce (rank 0's) travel
// through the set-up's host allreduce, which rides the job's authenticated channels. The lower
// rank of each pair connects (bounded, common/tcp_socket.h) and sends a hello: its rank, the
// rank it wants, and an HMAC-SHA256 over (nonce, from, to, role) under the link key. The
// acceptor checks it in constant time and answers with its own proof (the acceptor's role),
// which the connector checks: each end proves it belongs to this set-up. The link key is the
// HMAC of the nonce under the job token, so a nonce seen on the wire is not enough; without a
// token (tests) the nonce itself. A connection that cannot prove it is logged and closed, and
// the acceptor keeps waiting for the real peer; the listener is closed once every peer came.
//
// Data. One connection per peer carries both directions as frames (gdr_link_impl.h's
// TcpFrame): a message (its number, its length, the payload straight from the send slot into
// the receive slot) or a credit (the receiver's `consumed`). Every header is checked: the
// number must be the next one, the length at most a slot, and the sender must hold a credit
// for that slot; a credit may not free more than was sent. The worker moves every TCP peer
// with non-blocking calls, resuming partial frames, so one slow peer never holds another, and
// sleeps in ppoll on the sockets (a few microseconds) only when nothing moved.
#include <fcntl.h>
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
#include "common/log.h"
#include "common/secret.h"
#include "common/tcp_socket.h"
#include "gpu/gdr_link_impl.h"

namespace gradsync {
namespace {

using namespace gdr_link_detail;

constexpr uint32_t kHelloMagic = 0x47535448;  // "GSTH"
constexpr uint32_t kHelloVersion = 1;
struct TcpHello {
  uint32_t magic = kHelloMagic;
  uint32_t version = kHelloVersion;
  int32_t from = -1;
  int32_t to = -1;
  uint8_t proof[32] = {};
};
struct TcpWelcome {
  uint32_t magic = kHelloMagic;
  uint32_t version = kHelloVersion;
  uint8_t proof[32] = {};
};

std::string link_key(const std::string& token, const uint8_t* nonce) {
  if (token.empty()) return std::string(reinterpret_cast<const char*>(nonce), kTcpNonceBytes);
  std::string msg = "gradsync tcp-steps key";
  msg.append(reinterpret_cast<const char*>(nonce), kTcpNonceBytes);
  const Mac k = hmac_sha256(token, msg.data(), msg.size());
  return std::string(reinterpret_cast<const char*>(k.data()), k.size());
}

Mac proof_of(const std::string& key, const uint8_t* nonce, int from, int to, bool acceptor) {
  struct {
    char label[16];
    uint8_t nonce[kTcpNonceBytes];
    int32_t from, to;
    uint32_t role;
  } m{};
  std::memcpy(m.label, "gradsync tcp1", 14);
  std::memcpy(m.nonce, nonce, kTcpNonceBytes);
  m.from = from;
  m.to = to;
  m.role = acceptor ? 2 : 1;
  return hmac_sha256(key, &m, sizeof(m));
}

Mac mac_from(const uint8_t* p) {
  Mac m{};
  std::memcpy(m.data(), p, m.size());
  return m;
}

std::string sockaddr_text(const sockaddr* sa) {
  char host[NI_MAXHOST] = {}, serv[NI_MAXSERV] = {};
  const socklen_t len = sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  if (getnameinfo(sa, len, host, sizeof(host), serv, sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) != 0) return "?";
  return std::string(host) + ":" + serv;
}

void data_socket(int fd) {
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  set_data_keepalive(fd);
}

}  // namespace

Status GdrLink::Impl::tcp_listen() {
  if (cfg.tcp_address.empty()) {
    return {Code::kUnavailable, "no data address is known for this rank's node (the TCP step channels listen there)"};
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(cfg.tcp_address.c_str(), "0", &hints, &res); rc != 0) {
    return {Code::kUnavailable, "cannot resolve this node's data address " + cfg.tcp_address + ": " + gai_strerror(rc)};
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> guard(res, freeaddrinfo);
  listener.reset(::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!listener.valid()) return {Code::kInternal, errno_string("socket")};
  if (::bind(listener.get(), res->ai_addr, res->ai_addrlen) != 0 || ::listen(listener.get(), 64) != 0) {
    return {Code::kUnavailable, "cannot listen on " + cfg.tcp_address + " for the TCP step channels: " +
                                    errno_string("bind/listen") + " (not an address of this host?)"};
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&ss), &len);
  port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ops.tcp_listening) ops.tcp_listening(cfg.tcp_address, port);
  return Status::Ok();
}

Status GdrLink::Impl::tcp_connect(const std::vector<TcpEndpoint>& ends, const uint8_t* nonce) {
  const Deadline deadline = deadline_after(cfg.op_timeout);
  const std::string key = link_key(cfg.tcp_token, nonce);
  const int me = cfg.rank;
  auto at = [&](int r) {
    const TcpEndpoint& e = ends[size_t(r)];
    return std::string(e.address, strnlen(e.address, sizeof(e.address))) + ":" + std::to_string(e.port);
  };
  // A: dial every higher peer and send the hello (no answer awaited yet: the acceptor may be
  // dialing its own higher peers first).
  for (PeerLink& l : peers) {
    if (!l.peer.tcp || l.peer.rank < me) continue;
    const TcpEndpoint& e = ends[size_t(l.peer.rank)];
    const std::string to = peer_name(l.peer.rank) + " at " + at(l.peer.rank);
    if (e.port == 0 || e.address[0] == '\0') return {Code::kInternal, to + " does not listen for TCP step channels"};
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    const std::string host(e.address, strnlen(e.address, sizeof(e.address)));
    if (int rc = getaddrinfo(host.c_str(), std::to_string(e.port).c_str(), &hints, &res); rc != 0) {
      return {Code::kUnavailable, "cannot resolve " + to + ": " + gai_strerror(rc)};
    }
    std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> guard(res, freeaddrinfo);
    Dialed d = tcp_dial(*res, deadline, data_socket);
    if (d.err != 0) {
      return {d.err == ETIMEDOUT ? Code::kDeadlineExceeded : Code::kUnavailable,
              "connecting to " + to + ": " + std::strerror(d.err) +
                  (d.err == ECONNREFUSED ? " (nothing listens there: its process died, or that address is not its node's)"
                   : d.err == ETIMEDOUT  ? " (nothing answered in time: a firewall drops it, or its host is unreachable "
                                           "from this node's network)"
                                         : "")};
    }
    TcpHello h;
    h.from = me;
    h.to = l.peer.rank;
    const Mac p = proof_of(key, nonce, me, l.peer.rank, false);
    std::memcpy(h.proof, p.data(), p.size());
    if (Status s = write_all(d.fd.get(), &h, sizeof(h)); !s.ok()) return {s.code(), to + ": " + s.message()};
    l.tcp.fd = std::move(d.fd);
    l.tcp.where = at(l.peer.rank);
  }
  // B: accept every lower peer; a connection that cannot prove itself is refused and logged.
  auto waiting = [&] {
    std::string who;
    for (const PeerLink& l : peers) {
      if (l.peer.tcp && l.peer.rank < me && !l.tcp.fd.valid()) who += (who.empty() ? "" : ", ") + peer_name(l.peer.rank);
    }
    return who;
  };
  while (!waiting().empty()) {
    pollfd pfd{listener.get(), POLLIN, 0};
    const int rc = ::poll(&pfd, 1, poll_timeout_ms(deadline, 100));
    if (rc < 0 && errno != EINTR) return {Code::kInternal, errno_string("poll")};
    if (rc <= 0) {
      if (Clock::now() >= deadline) {
        return {Code::kDeadlineExceeded, waiting() + " never connected to this rank's TCP port " + cfg.tcp_address +
                                             ":" + std::to_string(port) + " within " +
                                             std::to_string(cfg.op_timeout.count()) +
                                             " ms (its set-up failed, or a firewall drops connections to this port)"};
      }
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    Fd c(::accept4(listener.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC));
    if (!c.valid()) continue;
    const std::string from = sockaddr_text(reinterpret_cast<sockaddr*>(&ss));
    TcpHello h;
    Status s = read_all(c.get(), &h, sizeof(h), std::min(deadline, deadline_after(std::chrono::seconds(5))));
    PeerLink* l = nullptr;
    for (PeerLink& q : peers) {
      if (q.peer.tcp && q.peer.rank == h.from && h.from < me && !q.tcp.fd.valid()) l = &q;
    }
    std::string why = !s.ok()                                                  ? "no hello: " + s.message()
                      : h.magic != kHelloMagic || h.version != kHelloVersion ? "not a TCP step channel hello"
                      : h.to != me || l == nullptr ? "it claims rank " + std::to_string(h.from) + " to rank " +
                                                         std::to_string(h.to) + ", not a peer this rank waits for"
                      : !same_mac(mac_from(h.proof), proof_of(key, nonce, h.from, me, false))
                          ? "its proof does not match this job's set-up (not a rank of this job, or another set-up)"
                          : "";
    if (!why.empty()) {
      log::get(cfg.log_name)->warn("{}: refused a TCP step connection from {}: {}", cfg.who, from, why);
      continue;
    }
    TcpWelcome w;
    const Mac p = proof_of(key, nonce, h.from, me, true);
    std::memcpy(w.proof, p.data(), p.size());
    data_socket(c.get());
    if (Status ws = write_all(c.get(), &w, sizeof(w)); !ws.ok()) {
      return {ws.code(), peer_name(h.from) + " at " + from + ": " + ws.message()};
    }
    l->tcp.fd = std::move(c);
    l->tcp.where = from;
  }
  listener.reset();
  // C: every acceptor's proof.
  for (PeerLink& l : peers) {
    if (!l.peer.tcp) continue;
    const std::string to = peer_name(l.peer.rank) + " at " + l.tcp.where;
    if (l.peer.rank > me) {
      TcpWelcome w;
      if (Status s = read_all(l.tcp.fd.get(), &w, sizeof(w), deadline); !s.ok()) {
        return {s.code(), to + " did not accept this rank's TCP connection (" + s.message() +
                              "; it could not verify it: a different set-up, or not that rank at this address)"};
      }
      if (w.magic != kHelloMagic || !same_mac(mac_from(w.proof), proof_of(key, nonce, me, l.peer.rank, true))) {
        return {Code::kPermissionDenied, to + " accepted the TCP connection without proving this job's set-up "
                                              "(a stale address, or an impostor listening there)"};
      }
    }
    const int flags = ::fcntl(l.tcp.fd.get(), F_GETFL);
    if (flags < 0 || ::fcntl(l.tcp.fd.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
      return {Code::kInternal, errno_string("fcntl O_NONBLOCK")};
    }
  }
  return Status::Ok();
}

namespace {

// One non-blocking call's outcome: bytes moved, or 0 with *again (nothing now), or 0 with
// *closed set (the peer closed or reset the connection).
ssize_t io_result(ssize_t n, const char* what, bool* again, std::string* closed) {
  if (n > 0) return n;
  if (n == 0) {
    *closed = "the peer closed the connection";
    return 0;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
    *again = true;
    return 0;
  }
  *closed = errno_string(what);
  return 0;
}

}  // namespace

// The worker of TCP peers (gdr_link.h's words and plan, as run() for queue pairs).
void GdrLink::Impl::run_tcp() {
  auto last_progress = Clock::now();
  int idle = 0;
  const std::string label = "TCP steps";
  std::vector<uint64_t> planned_s(peers.size()), planned_r(peers.size());
  std::vector<pollfd> pfds;
  auto broken = [&](PeerLink& l, const std::string& what) {
    fail({Code::kAborted, label + ": the connection with " + peer_name(l.peer.rank) + " at " + l.tcp.where + " " +
                              what + ": " + stall(l, planned_s[size_t(&l - peers.data())],
                                                   planned_r[size_t(&l - peers.data())])});
  };
  while (!stop.load(std::memory_order_acquire)) {
    bool progress = false, pending = false;
    snapshot_planned(planned_s, planned_r);
    for (size_t i = 0; i < peers.size(); ++i) {
      PeerLink& l = peers[i];
      TcpConn& t = l.tcp;
      if (!l.peer.tcp) continue;
      // In: headers, checked before any payload lands; payloads into their receive slots.
      for (int frames = 0; !t.closed && frames < 64;) {
        bool again = false;
        if (t.in_done < sizeof(TcpFrame)) {
          const ssize_t n = io_result(::recv(t.fd.get(), reinterpret_cast<uint8_t*>(&t.in) + t.in_done,
                                             sizeof(TcpFrame) - t.in_done, MSG_DONTWAIT),
                                      "recv", &again, &t.closed_why);
          if (n == 0) {
            t.closed = !again;
            break;
          }
          t.in_done += size_t(n);
          progress = true;
          if (t.in_done < sizeof(TcpFrame)) continue;
          const uint64_t expect = l.arrived + l.landed.size();
          if (t.in.magic == kTcpCredit) {
            if (t.in.bytes != 0 || t.in.number < load(&l.credit->credit) || t.in.number > l.completed) {
              return broken(l, "carried a credit for " + std::to_string(t.in.number) + " messages, " +
                                   std::to_string(l.completed) + " sent (a corrupt or forged frame)");
            }
            __atomic_store_n(&l.credit->credit, t.in.number, __ATOMIC_RELEASE);
            t.in_done = 0;
            ++frames;
            continue;
          }
          if (t.in.magic != kTcpData || !l.peer.recv || t.in.number != expect || t.in.bytes > cfg.slot_bytes ||
              t.in.number >= l.credit_sent + cfg.slots) {
            return broken(l, "carried a frame (magic " + std::to_string(t.in.magic) + ", message " +
                                 std::to_string(t.in.number) + ", " + std::to_string(t.in.bytes) +
                                 " bytes) where message " + std::to_string(expect) + " of at most " +
                                 std::to_string(cfg.slot_bytes) + " bytes within its " +
                                 std::to_string(cfg.slots) + " credits was due (a corrupt or forged frame)");
          }
          t.in_dest = slot(int(i), true, t.in.number);
        }
        const size_t want = sizeof(TcpFrame) + t.in.bytes;
        if (t.in_done < want) {
          const size_t got = t.in_done - sizeof(TcpFrame);
          const ssize_t n = io_result(::recv(t.fd.get(), t.in_dest + got, want - t.in_done, MSG_DONTWAIT), "recv",
                                      &again, &t.closed_why);
          if (n == 0) {
            t.closed = !again;
            break;
          }
          t.in_done += size_t(n);
          progress = true;
        }
        if (t.in_done == want) {
          l.landed.push_back(t.in.bytes);
          t.in_done = 0;
          ++frames;
        }
      }
      if (!publish_landed(i, planned_r[i], &progress)) return;
      // Out: a credit when the stream read more, else the next filled message the peer has a
      // free slot for.
      while (!t.closed) {
        if (!t.out_busy) {
          const uint64_t consumed = load(&l.words->consumed);
          if (l.peer.recv && consumed > l.credit_sent) {
            t.out = {kTcpCredit, 0, consumed};
            t.out_payload = nullptr;
          } else if (l.peer.send && l.posted < planned_s[i] && load(&l.words->ready) > l.posted &&
                     load(&l.credit->credit) + cfg.slots > l.posted) {
            std::lock_guard lock(mu);
            t.out = {kTcpData, l.send_len.front().bytes, l.posted};
            t.out_payload = slot(int(i), false, l.posted);
          } else {
            break;
          }
          t.out_busy = true;
          t.out_done = 0;
        }
        const size_t total = sizeof(TcpFrame) + (t.out_payload ? t.out.bytes : 0);
        iovec iov[2];
        int nio = 0;
        if (t.out_done < sizeof(TcpFrame)) {
          iov[nio++] = {reinterpret_cast<uint8_t*>(&t.out) + t.out_done, sizeof(TcpFrame) - t.out_done};
        }
        if (t.out_payload && t.out.bytes > 0) {
          const size_t off = t.out_done > sizeof(TcpFrame) ? t.out_done - sizeof(TcpFrame) : 0;
          iov[nio++] = {const_cast<uint8_t*>(t.out_payload) + off, t.out.bytes - off};
        }
        msghdr mh{};
        mh.msg_iov = iov;
        mh.msg_iovlen = size_t(nio);
        bool again = false;
        const ssize_t n = io_result(::sendmsg(t.fd.get(), &mh, MSG_NOSIGNAL | MSG_DONTWAIT), "send", &again,
                                    &t.closed_why);
        if (n == 0) {
          t.closed = !again;
          break;
        }
        t.out_done += size_t(n);
        progress = true;
        if (t.out_done < total) continue;
        t.out_busy = false;
        if (t.out.magic == kTcpCredit) {
          l.credit_sent = t.out.number;
          continue;
        }
        // The kernel has the payload: the send slot is free again.
        {
          std::lock_guard lock(mu);
          l.send_len.pop_front();
        }
        ++l.posted;
        ++l.completed;
        __atomic_fetch_add(&l.bytes_sent, uint64_t(t.out.bytes), __ATOMIC_RELAXED);
        __atomic_store_n(&l.words->send_free, l.completed, __ATOMIC_RELEASE);
      }
      const bool owed = l.completed < planned_s[i] || l.arrived + l.landed.size() < planned_r[i];
      if (l.completed < planned_s[i] || l.arrived < planned_r[i]) pending = true;
      if (t.closed && owed && ops.abort_reason().empty()) {
        return broken(l, "closed (" + t.closed_why + ") with messages outstanding: that rank's process died, or it "
                                                     "failed and left the call");
      }
    }
    if (!ops.abort_reason().empty()) return log_outstanding("stopped by the abort", planned_s, planned_r);
    if (draining.load(std::memory_order_acquire) && !pending &&
        std::all_of(peers.begin(), peers.end(), [](const PeerLink& l) {
          return !l.peer.tcp || l.tcp.closed || (!l.tcp.out_busy && load(&l.words->consumed) == l.credit_sent);
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
    if (++idle > 64) {
      // Sleep until a socket moves, or briefly: the stream's words do not wake a poll.
      pfds.clear();
      for (const PeerLink& l : peers) {
        if (l.peer.tcp && !l.tcp.closed) {
          pfds.push_back({l.tcp.fd.get(), short(POLLIN | (l.tcp.out_busy ? POLLOUT : 0)), 0});
        }
      }
      const timespec ts{0, idle > 4096 ? 200'000 : 5'000};
      (void)::ppoll(pfds.data(), pfds.size(), &ts, nullptr);
    }
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

}  // namespace gradsync
