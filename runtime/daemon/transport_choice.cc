#include "daemon/transport_choice.h"

#if GRADSYNC_HAVE_VERBS
#include "transport/verbs/ibv_api.h"
#include "transport/verbs/verbs.h"
#endif

namespace gradsync {
namespace {

// Why the verbs transport cannot carry this node's traffic; "" if an RDMA port is usable.
std::string verbs_unusable() {
#if GRADSYNC_HAVE_VERBS
  auto api = verbs::load_libibverbs();
  if (!api.ok()) return api.status().message();
  auto devices = verbs::list_devices(*api);
  if (!devices.ok()) return "cannot list RDMA devices: " + devices.status().message();
  if (devices->empty()) return "no RDMA device (libibverbs.so.1 loaded, 0 devices)";
  std::string seen;
  for (const auto& d : *devices) {
    for (size_t p = 0; p < d.ports.size(); ++p) {
      if (d.ports[p].state == IBV_PORT_ACTIVE) return "";
      seen += (seen.empty() ? "" : ", ") + d.name + " port " + std::to_string(p + 1) + " not ACTIVE";
    }
  }
  return "no ACTIVE RDMA port (" + seen + ")";
#else
  return "built without infiniband/verbs.h (GRADSYNC_WITH_VERBS)";
#endif
}

}  // namespace

Result<TransportChoice> choose_transport(const std::string& requested) {
  if (requested == "tcp") return TransportChoice{"tcp", "GRADSYNC_TRANSPORT=tcp"};
  if (!requested.empty() && requested != "auto" && requested != "verbs") {
    return Status(Code::kInvalidArgument,
                  "GRADSYNC_TRANSPORT=" + requested + " is not one of auto, tcp, verbs");
  }
  std::string why = verbs_unusable();
  if (why.empty()) {
    // A usable RDMA port exists, but channels do not run over verbs yet (docs/status.md).
    why = "an RDMA port is ACTIVE, but the verbs data path is not built yet";
    if (requested == "verbs") {
      return Status(Code::kFailedPrecondition, "GRADSYNC_TRANSPORT=verbs: " + why);
    }
    return TransportChoice{"tcp", why};
  }
  if (requested == "verbs") {
    return Status(Code::kFailedPrecondition,
                  "GRADSYNC_TRANSPORT=verbs but verbs cannot run here: " + why +
                      "; unset it (or set tcp) to use TCP");
  }
  return TransportChoice{"tcp", why};
}

}  // namespace gradsync
