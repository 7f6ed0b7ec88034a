#include "client/daemon_client.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <cstdlib>
#include <cstring>

#include "common/framing.h"
#include "common/socket_path.h"

namespace gradsync {

std::string default_daemon_socket() { return client_daemon_socket(); }

Result<DaemonClient> DaemonClient::connect(const std::string& socket_path, Deadline deadline) {
  sockaddr_un addr{};
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    return Status(Code::kInvalidArgument, "daemon socket path too long: " + socket_path);
  }
  DaemonClient c;
  c.path_ = socket_path;
  c.sock_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!c.sock_.valid()) return Status(Code::kInternal, errno_string("socket"));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  if (::connect(c.sock_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Status(Code::kUnavailable, "cannot reach gradsyncd at " + socket_path + " (" +
                                          errno_string("connect") +
                                          "); is the daemon running? (systemctl start gradsyncd, or gradsyncd for your own) "
                                          "set GRADSYNC_DAEMON to its socket");
  }
  v1::ClientMessage hello;
  hello.mutable_attach()->set_pid(static_cast<uint32_t>(::getpid()));
  hello.mutable_attach()->set_protocol_version(kDaemonProtocolVersion);
  auto reply = c.call(hello, deadline);
  if (!reply.ok()) return reply.status();
  if (!reply->has_attach()) return Status(Code::kInternal, "gradsyncd answered attach with junk");
  c.attach_ = reply->attach();
  return c;
}

Result<v1::DaemonMessage> DaemonClient::call(const v1::ClientMessage& request, Deadline deadline,
                                             Fd* passed) {
  std::vector<Fd> fds;
  auto reply = call(request, deadline, &fds);
  if (passed && !fds.empty()) *passed = std::move(fds.front());
  return reply;
}

Result<v1::DaemonMessage> DaemonClient::call(const v1::ClientMessage& request, Deadline deadline,
                                             std::vector<Fd>* passed) {
  GS_RETURN_IF_ERROR(send_frame(sock_.get(), request));
  v1::DaemonMessage reply;
  Status s = recv_frame(sock_.get(), &reply, deadline, passed);
  if (!s.ok()) {
    if (s.code() == Code::kUnavailable) {
      return Status(Code::kUnavailable, "gradsyncd at " + path_ + " closed the connection (" +
                                            s.message() + "); did the daemon die?");
    }
    return s;
  }
  if (reply.has_error()) {
    return Status(static_cast<Code>(reply.error().code()), reply.error().message());
  }
  return reply;
}

}  // namespace gradsync
