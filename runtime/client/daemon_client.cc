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
  auto reply = c.call(wire::AttachRequest{static_cast<uint32_t>(::getpid()), kDaemonProtocolVersion}, deadline);
  if (!reply.ok()) return reply.status();
  auto* attach = std::get_if<wire::AttachResponse>(&reply.value());
  if (attach == nullptr) return Status(Code::kInternal, "gradsyncd at " + socket_path + " answered attach with junk");
  c.attach_ = std::move(*attach);
  return c;
}

Result<wire::DaemonMessage> DaemonClient::call(const wire::ClientMessage& request, Deadline deadline,
                                               Fd* passed) {
  std::vector<Fd> fds;
  auto reply = call(request, deadline, &fds);
  if (passed && !fds.empty()) *passed = std::move(fds.front());
  return reply;
}

Status DaemonClient::send(const wire::ClientMessage& request) {
  auto bytes = wire::encode(request);
  if (!bytes.ok()) return bytes.status();
  return send_frame(sock_.get(), *bytes);
}

Result<wire::DaemonMessage> DaemonClient::call(const wire::ClientMessage& request, Deadline deadline,
                                               std::vector<Fd>* passed) {
  GS_RETURN_IF_ERROR(send(request));
  std::string body;
  Status s = recv_frame(sock_.get(), &body, deadline, passed);
  if (!s.ok()) {
    if (s.code() == Code::kUnavailable) {
      return Status(Code::kUnavailable, "gradsyncd at " + path_ + " closed the connection (" +
                                            s.message() + "); did the daemon die?");
    }
    return s;
  }
  auto reply = wire::decode(body);
  if (!reply.ok()) return Status(reply.status().code(), "gradsyncd at " + path_ + ": " + reply.status().message());
  if (const auto* error = std::get_if<wire::ErrorResponse>(&reply.value())) {
    // An error with no code, or one this library does not know, is still an error.
    const bool known = error->code > uint32_t(Code::kOk) && error->code <= uint32_t(Code::kUnimplemented);
    return Status(known ? static_cast<Code>(error->code) : Code::kInternal, error->message);
  }
  return reply;
}

}  // namespace gradsync
