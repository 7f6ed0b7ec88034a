// Length-prefixed protobuf frames over a stream socket, with an optional file descriptor
// attached (SCM_RIGHTS). Used between trainers and their daemon; docs/wire.md has the format.
#pragma once

#include <google/protobuf/message_lite.h>

#include <cstdint>
#include <vector>

#include "common/fd.h"

namespace gradsync {

// A frame larger than this is a protocol error, not a message: 16 MiB.
constexpr uint32_t kMaxFrameBytes = 16u << 20;

// Descriptors one frame can carry (the job's shared memory and a rank's channel sockets).
constexpr size_t kMaxPassedFds = 64;

Status send_frame(int sock, const google::protobuf::MessageLite& msg, int pass_fd = -1);
Status send_frame(int sock, const google::protobuf::MessageLite& msg, const std::vector<int>& pass_fds);

// Reads one frame; fills `*passed` when the sender attached a descriptor. kUnavailable on EOF,
// kDeadlineExceeded when `deadline` passes first.
// A frame longer than `max_bytes` is refused before anything is allocated for it.
Status recv_frame(int sock, google::protobuf::MessageLite* msg, Deadline deadline,
                  Fd* passed = nullptr, uint32_t max_bytes = kMaxFrameBytes);
// The same, keeping every attached descriptor in order.
Status recv_frame(int sock, google::protobuf::MessageLite* msg, Deadline deadline, std::vector<Fd>* passed,
                  uint32_t max_bytes = kMaxFrameBytes);

// Writes/reads exactly `len` bytes (retrying on EINTR and short transfers).
Status write_all(int sock, const void* data, size_t len);
// Writes a header and a payload with one sendmsg where the socket takes both at once.
Status write_two(int sock, const void* head, size_t head_len, const void* body, size_t body_len);
Status read_all(int sock, void* data, size_t len, Deadline deadline);

}  // namespace gradsync
