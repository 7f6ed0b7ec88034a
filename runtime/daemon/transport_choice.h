// Which transport gradsyncd uses between nodes, and why (design §3), decided once at start.
#pragma once

#include <string>

#include "gradsync/status.h"

namespace gradsync {
namespace verbs {
struct IbvApi;
}

struct TransportChoice {
  std::string name;  // "tcp" or "verbs"
  std::string why;   // for the start-up log line and gradsyncctl
};

// `requested` is GRADSYNC_TRANSPORT / --transport: "" or "auto" (verbs where an RDMA port is
// ACTIVE, else TCP), "tcp", or "verbs". Forcing "verbs" where it cannot run is an error at
// start, never a silent fallback. `api` replaces libibverbs (tests: the emulated fabric);
// `device` restricts the search to one RDMA device (GRADSYNC_IB_HCA).
Result<TransportChoice> choose_transport(const std::string& requested, const verbs::IbvApi* api = nullptr,
                                         const std::string& device = "");

}  // namespace gradsync
