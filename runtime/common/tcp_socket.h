// TCP helpers of the data path between nodes (gradsyncd's channel connections, which are also
// the rank sockets once handed to the ranks): a connect bounded by a deadline, and the
// keepalive and send check that fail a connection whose peer host stopped answering.
#pragma once

#include <netdb.h>

#include <chrono>
#include <string>

#include "common/fd.h"

namespace gradsync {

// A data connection on which nothing was received for kDataIdleBeforeProbe sends a keepalive
// probe every kDataProbeEvery; after kDataProbes unanswered ones the kernel fails it with
// ETIMEDOUT. So a connection whose peer host went silent (a cut of the data network, a
// firewall that starts dropping, a host that froze) fails within kDataSilenceLimit, about 5 s,
// instead of waiting for the op timeout (300 s by default). Whole seconds: TCP_KEEPIDLE and
// TCP_KEEPINTVL count seconds. A peer that is merely slow still answers probes from its kernel
// (a rank that computes for minutes, a receiver whose buffer is full), so this never fails a
// healthy connection; probes go only while nothing is queued to send (the kernel's rule).
//
// Not TCP_USER_TIMEOUT: it also fails a connection whose data waits behind a zero window,
// i.e. a healthy receiver that stopped reading (a rank still computing while its peer already
// sends the next allreduce). Measured on this VM's kernel: a 2 s TCP_USER_TIMEOUT killed such
// a connection (ETIMEDOUT) after 2-3 s although the receiver's kernel answered every probe.
constexpr std::chrono::seconds kDataIdleBeforeProbe{1};
constexpr std::chrono::seconds kDataProbeEvery{1};
constexpr int kDataProbes = 4;
constexpr std::chrono::seconds kDataSilenceLimit = kDataIdleBeforeProbe + kDataProbes * kDataProbeEvery;

// Sets the keepalive above on a connected (or about to connect) TCP socket; a no-op on others.
void set_data_keepalive(int fd);

// Whether the sending end `fd` has had data in flight (or window probes out) that its peer's
// host has not answered for kDataSilenceLimit: the keepalive does not probe while data is
// queued, so a sender blocked on a silent peer checks this itself. A receiver that only
// stopped reading acknowledges what it got and answers window probes, so it never counts.
// False for a socket that is not TCP.
bool unanswered_sends(int fd);

// Whether a data connection's error is the kernel's ETIMEDOUT (keepalive or retransmissions
// unanswered), from the errno text that the framing and driver errors carry.
bool is_silence_error(const std::string& message);

// What an ETIMEDOUT on a data connection means, for errors: the peer host is silent, and
// which side of the network is at fault cannot be known from here.
std::string silence_cause();

// A TCP socket connected to `addr`, or the errno of the failure: ETIMEDOUT when nothing
// answered by `deadline` (a firewall drops the connection, or the host is down),
// ECONNREFUSED when nothing listens there. The socket is close-on-exec and blocking.
// `prepare` (optional) sets options that must precede the connect (buffer sizes, which the
// window scale offered in the SYN follows).
struct Dialed {
  Fd fd;
  int err = 0;
};
Dialed tcp_dial(const addrinfo& addr, Deadline deadline, void (*prepare)(int fd) = nullptr);

}  // namespace gradsync
