// The trainer's connection to its local gradsyncd (proto/daemon.proto over a Unix socket).
#pragma once

#include <string>
#include <vector>

#include "common/fd.h"
#include "daemon.pb.h"

namespace gradsync {

constexpr uint32_t kDaemonProtocolVersion = 1;

std::string default_daemon_socket();  // common/socket_path.h: $GRADSYNC_DAEMON, else the first that exists

class DaemonClient {
 public:
  // Connects and attaches; fails with kUnavailable and the socket path when nobody listens.
  static Result<DaemonClient> connect(const std::string& socket_path, Deadline deadline);

  // Sends one request and waits for its reply; an ErrorResponse becomes a Status.
  Result<v1::DaemonMessage> call(const v1::ClientMessage& request, Deadline deadline,
                                 Fd* passed = nullptr);
  // The same, keeping every descriptor the reply carried, in order.
  Result<v1::DaemonMessage> call(const v1::ClientMessage& request, Deadline deadline, std::vector<Fd>* passed);

  int fd() const { return sock_.get(); }
  const std::string& socket_path() const { return path_; }
  const v1::AttachResponse& attach() const { return attach_; }

 private:
  Fd sock_;
  std::string path_;
  v1::AttachResponse attach_;
};

}  // namespace gradsync
