#include "common/fd.h"

#include <limits.h>
#include <string.h>

#include <algorithm>
#include <cerrno>

namespace gradsync {

int poll_timeout_ms(Deadline deadline, int cap_ms) {
  if (deadline == Deadline::max()) return cap_ms;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  // Round up so a wait never wakes a hair before its deadline and spins.
  return static_cast<int>(std::clamp<long long>(left + 1, 0, cap_ms));
}

std::string errno_string(const char* what) {
  int err = errno;
  return std::string(what) + ": " + strerror(err);
}

std::string hostname() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

}  // namespace gradsync
