#include "common/tcp_socket.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace gradsync {

void set_data_keepalive(int fd) {
  int on = 1;
  int idle = static_cast<int>(kDataIdleBeforeProbe.count());
  int every = static_cast<int>(kDataProbeEvery.count());
  int probes = kDataProbes;
  // Failures are ignored: a socket that is not TCP (a test's socketpair) has no keepalive.
  (void)::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &every, sizeof(every));
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
}

bool unanswered_sends(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return false;
  const bool waiting = info.tcpi_unacked > 0 || info.tcpi_probes > 1;
  return waiting && std::chrono::milliseconds(info.tcpi_last_ack_recv) >= kDataSilenceLimit;
}

bool is_silence_error(const std::string& message) {
  // errno_string() writes strerror(errno): the one text ETIMEDOUT has.
  return message.find(std::strerror(ETIMEDOUT)) != std::string::npos;
}

std::string silence_cause() {
  return "its host answered nothing for " + std::to_string(kDataSilenceLimit.count()) +
         " s: the network between the two nodes drops their traffic (a cut or a "
         "firewall), or that host is down; which side is at fault is not known here";
}

Dialed tcp_dial(const addrinfo& addr, Deadline deadline, void (*prepare)(int fd)) {
  Dialed out;
  out.fd.reset(::socket(addr.ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!out.fd.valid()) {
    out.err = errno;
    return out;
  }
  if (prepare) prepare(out.fd.get());
  if (::connect(out.fd.get(), addr.ai_addr, addr.ai_addrlen) != 0) {
    out.err = errno;
    if (out.err == EINPROGRESS) {
      pollfd pfd{out.fd.get(), POLLOUT, 0};
      int rc;
      do {
        rc = ::poll(&pfd, 1, poll_timeout_ms(deadline, 1000));
      } while ((rc < 0 && errno == EINTR) || (rc == 0 && Clock::now() < deadline));
      if (rc <= 0) {
        out.err = ETIMEDOUT;
      } else {
        socklen_t len = sizeof(out.err);
        if (::getsockopt(out.fd.get(), SOL_SOCKET, SO_ERROR, &out.err, &len) != 0) out.err = errno;
      }
    }
  }
  if (out.err != 0) {
    out.fd.reset();
    return out;
  }
  int flags = ::fcntl(out.fd.get(), F_GETFL);
  if (flags >= 0) (void)::fcntl(out.fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  return out;
}

}  // namespace gradsync
