// How the memory a rank's communicator holds reads in gradsyncd's log and in
// `gradsyncctl describe`: "; GPU memory 296.0 MiB, pinned host memory 16.0 MiB", or nothing
// for a communicator that holds none (host tensors).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace gradsync {

inline std::string memory_text(uint64_t gpu_bytes, uint64_t pinned_host_bytes) {
  if (gpu_bytes == 0 && pinned_host_bytes == 0) return {};
  char text[96];
  std::snprintf(text, sizeof text, "; GPU memory %.1f MiB, pinned host memory %.1f MiB",
                double(gpu_bytes) / (1 << 20), double(pinned_host_bytes) / (1 << 20));
  return text;
}

}  // namespace gradsync
