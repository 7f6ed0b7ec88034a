// RAII for file descriptors and small POSIX helpers shared by every process.
#pragma once

#include <unistd.h>

#include <chrono>
#include <string>
#include <utility>

#include "gradsync/status.h"

namespace gradsync {

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_after(std::chrono::milliseconds ms) {
  // Saturate: milliseconds::max() means "no deadline" without overflowing time_point.
  auto now = Clock::now();
  if (ms >= std::chrono::duration_cast<std::chrono::milliseconds>(Deadline::max() - now)) {
    return Deadline::max();
  }
  return now + ms;
}

// Milliseconds left until `deadline`, clamped to [0, cap_ms]; for poll() timeouts.
int poll_timeout_ms(Deadline deadline, int cap_ms);

// "errno text" helper: "connect: Connection refused".
std::string errno_string(const char* what);

std::string hostname();

}  // namespace gradsync
