// Protobuf messages in frames (common/framing.h): gradsyncd's side of the trainer protocol,
// which keeps libprotobuf's C++ classes. The library's side is client/daemon_wire.h (nanopb).
#pragma once

#include <google/protobuf/message_lite.h>

#include <string>
#include <vector>

#include "common/framing.h"

namespace gradsync {

inline Status send_frame(int sock, const google::protobuf::MessageLite& msg, const std::vector<int>& pass_fds = {}) {
  std::string body;
  if (!msg.SerializeToString(&body)) return {Code::kInternal, "cannot serialize message"};
  return send_frame(sock, std::string_view(body), pass_fds);
}

// Reads one frame into `msg` (recv_frame's limits and descriptors); kInternal if it does not parse.
inline Status recv_frame(int sock, google::protobuf::MessageLite* msg, Deadline deadline, std::vector<Fd>* passed,
                         uint32_t max_bytes = kMaxFrameBytes) {
  std::string body;
  GS_RETURN_IF_ERROR(recv_frame(sock, &body, deadline, passed, max_bytes));
  if (!msg->ParseFromString(body)) return {Code::kInternal, "malformed frame"};
  return Status::Ok();
}

}  // namespace gradsync
