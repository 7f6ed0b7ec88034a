#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>

namespace gradsync::log {
namespace {

std::mutex g_mu;
spdlog::level::level_enum g_level = spdlog::level::info;
bool g_level_from_env = false;

spdlog::level::level_enum initial_level() {
  if (!g_level_from_env) {
    g_level_from_env = true;
    if (const char* env = std::getenv("GRADSYNC_LOG_LEVEL")) {
      g_level = spdlog::level::from_str(env);
    }
  }
  return g_level;
}

}  // namespace

std::shared_ptr<spdlog::logger> get(const std::string& component) {
  std::lock_guard lock(g_mu);
  if (auto existing = spdlog::get(component)) return existing;
  auto logger = spdlog::stderr_color_mt(component);
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n] %v");
  logger->set_level(initial_level());
  return logger;
}

void set_level(const std::string& level) {
  std::lock_guard lock(g_mu);
  g_level_from_env = true;
  g_level = spdlog::level::from_str(level);
  spdlog::set_level(g_level);
  spdlog::apply_all([](const std::shared_ptr<spdlog::logger>& l) { l->set_level(g_level); });
}

bool RateLimit::allow(uint64_t* held_back) {
  std::lock_guard lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (any_ && now - last_ < period_) {
    ++held_;
    return false;
  }
  any_ = true;
  last_ = now;
  *held_back = held_;
  held_ = 0;
  return true;
}

}  // namespace gradsync::log
