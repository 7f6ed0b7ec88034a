// Which transport gradsyncd uses between nodes, and why (design §3), decided once at start.
#pragma once

#include <string>

#include "gradsync/status.h"

namespace gradsync {

struct TransportChoice {
  std::string name;  // "tcp"
  std::string why;   // for the start-up log line and gradsyncctl
};

// `requested` is GRADSYNC_TRANSPORT / --transport: "" or "auto" (pick), "tcp", or "verbs".
// Forcing "verbs" where it cannot run is an error at start, never a silent fallback.
Result<TransportChoice> choose_transport(const std::string& requested);

}  // namespace gradsync
