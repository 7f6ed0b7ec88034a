// Length-prefixed frames over a stream socket, with file descriptors attached (SCM_RIGHTS).
// Used between trainers and their daemon; docs/wire.md has the format. A frame's body is one
// serialized message: the library encodes its own with client/daemon_wire.h (nanopb), the
// daemon with protobuf (common/framing_proto.h). Nothing here needs a protobuf library.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/fd.h"

namespace gradsync {

// A frame larger than this is a protocol error, not a message: 16 MiB.
constexpr uint32_t kMaxFrameBytes = 16u << 20;

// Descriptors one frame can carry (the job's shared memory and a rank's channel sockets).
constexpr size_t kMaxPassedFds = 64;

// Sends `body` as one frame, the descriptors travelling with its first byte.
Status send_frame(int sock, std::string_view body, const std::vector<int>& pass_fds = {});

// Reads one frame's body, keeping every attached descriptor in order in `*passed` (closing
// them when `passed` is null). kUnavailable on EOF,
// kDeadlineExceeded when `deadline` passes first. A frame longer than `max_bytes` is refused
// before anything is allocated for it.
Status recv_frame(int sock, std::string* body, Deadline deadline, std::vector<Fd>* passed,
                  uint32_t max_bytes = kMaxFrameBytes);

// Writes/reads exactly `len` bytes (retrying on EINTR and short transfers).
Status write_all(int sock, const void* data, size_t len);
// Writes a header and a payload with one sendmsg where the socket takes both at once.
Status write_two(int sock, const void* head, size_t head_len, const void* body, size_t body_len);
Status read_all(int sock, void* data, size_t len, Deadline deadline);

}  // namespace gradsync
