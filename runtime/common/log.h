// One logging facade on spdlog: a logger per component ("coordinator", "daemon", "client",
// "proxy"), level from GRADSYNC_LOG_LEVEL or a flag. Messages carry object ids
// ("job=train gen=2 rank=3 peer=4").
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace gradsync::log {

// Returns the logger of a component, creating it (stderr, shared format) on first use.
std::shared_ptr<spdlog::logger> get(const std::string& component);

// Sets the level of every logger: trace|debug|info|warn|error|off. Unknown names are ignored.
void set_level(const std::string& level);

}  // namespace gradsync::log
