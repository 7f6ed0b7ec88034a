// The trainer's connection to its local gradsyncd (proto/daemon.proto over a Unix socket,
// client/daemon_wire.h's messages).
#pragma once

#include <string>
#include <vector>

#include "common/fd.h"
#include "client/daemon_wire.h"

namespace gradsync {

constexpr uint32_t kDaemonProtocolVersion = 1;

std::string default_daemon_socket();  // common/socket_path.h: $GRADSYNC_DAEMON, else the first that exists

class DaemonClient {
 public:
  // Connects and attaches; fails with kUnavailable and the socket path when nobody listens.
  static Result<DaemonClient> connect(const std::string& socket_path, Deadline deadline);

  // Sends one request and waits for its reply; an ErrorResponse becomes a Status, so the
  // reply is one of the others.
  Result<wire::DaemonMessage> call(const wire::ClientMessage& request, Deadline deadline,
                                   Fd* passed = nullptr);
  // The same, keeping every descriptor the reply carried, in order.
  Result<wire::DaemonMessage> call(const wire::ClientMessage& request, Deadline deadline, std::vector<Fd>* passed);
  // Sends a request that has no reply (abort, path and trace-dump reports).
  Status send(const wire::ClientMessage& request);

  int fd() const { return sock_.get(); }
  const std::string& socket_path() const { return path_; }
  const wire::AttachResponse& attach() const { return attach_; }

 private:
  Fd sock_;
  std::string path_;
  wire::AttachResponse attach_;
};

}  // namespace gradsync
