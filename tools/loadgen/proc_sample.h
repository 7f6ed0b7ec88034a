// CPU time, resident memory and thread count of a process, from /proc.
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace gradsync::loadgen {

struct ProcSample {
  double cpu_s = 0;      // user + system time so far
  uint64_t rss_bytes = 0;
  uint32_t threads = 0;
  bool ok = false;       // false when the process is gone or /proc unreadable
};

ProcSample sample_process(pid_t pid);  // pid 0: this process

}  // namespace gradsync::loadgen
