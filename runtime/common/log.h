// One logging facade on spdlog: a logger per component ("coordinator", "daemon", "client",
// "proxy"), level from GRADSYNC_LOG_LEVEL or a flag. Messages carry object ids
// ("job=train gen=2 rank=3 peer=4").
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace gradsync::log {

// Returns the logger of a component, creating it (stderr, shared format) on first use.
std::shared_ptr<spdlog::logger> get(const std::string& component);

// Sets the level of every logger: trace|debug|info|warn|error|off. Unknown names are ignored.
void set_level(const std::string& level);

// Lets a message through at most once per period and counts the ones held back: for warnings
// that a stranger can trigger at will, so that a flood of bad connections cannot flood the log.
class RateLimit {
 public:
  explicit RateLimit(std::chrono::milliseconds period = std::chrono::seconds(1)) : period_(period) {}
  // True when this occurrence may be logged; then *held_back is how many were not since the
  // last one that was.
  bool allow(uint64_t* held_back);

 private:
  std::mutex mu_;
  std::chrono::milliseconds period_;
  std::chrono::steady_clock::time_point last_{};
  bool any_ = false;
  uint64_t held_ = 0;
};

}  // namespace gradsync::log
