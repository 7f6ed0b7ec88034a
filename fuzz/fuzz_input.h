// What every fuzz target starts with: the fuzzer's bytes waiting on a socket, then EOF, as
// a peer that wrote them and hung up would leave them, so the readers under test run their
// real socket code.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "channel/channel.h"
#include "channel/shared_memory.h"
#include "common/fd.h"

namespace gradsync::fuzz {

// Inputs larger than this are skipped: they must fit the socket's buffer at once.
constexpr size_t kMaxInput = 60 << 10;

// A connected pair: `reader` holds `data` then EOF; `writer` stays open for replies (a
// challenge) that nobody reads. Invalid Fds when the input is too large.
struct Fed {
  Fd reader;
  Fd writer;
};

inline Fed feed(const uint8_t* data, size_t size, int type = SOCK_STREAM) {
  Fed f;
  if (size > kMaxInput) return f;
  int sv[2];
  if (::socketpair(AF_UNIX, type | SOCK_CLOEXEC, 0, sv) != 0) return f;
  f.reader.reset(sv[0]);
  f.writer.reset(sv[1]);
  int buf = 256 << 10;
  ::setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  ::setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  // Replies from the reader side must never block: the writer end's buffer is large too.
  ::setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  size_t off = 0;
  while (off < size) {
    ssize_t n = ::write(sv[1], data + off, size - off);
    if (n <= 0) return Fed{};
    off += static_cast<size_t>(n);
  }
  ::shutdown(sv[1], SHUT_WR);
  return f;
}

// A job region of one channel, made once per target process; `shm` is null when it could not be.
struct Region {
  Region(uint32_t slots, uint32_t slot_bytes) {
    layout.num_channels = 1;
    layout.slots = slots;
    layout.slot_bytes = slot_bytes;
    auto m = SharedMemory::create("fuzz", layout.total_bytes());
    if (m.ok()) shm = std::make_unique<SharedMemory>(std::move(m).value());
  }
  ShmLayout layout;
  std::unique_ptr<SharedMemory> shm;
};

}  // namespace gradsync::fuzz
