#include "daemon/transport_choice.h"

#if GRADSYNC_HAVE_VERBS
#include "transport/verbs/ibv_api.h"
#include "transport/verbs/verbs.h"
#endif

namespace gradsync {
namespace {

// Why the verbs transport cannot carry this node's traffic; "" if an RDMA port is usable, and
// then `*usable` names it.
std::string verbs_unusable(const verbs::IbvApi* api, const std::string& device, std::string* usable) {
#if GRADSYNC_HAVE_VERBS
  std::string lib = api ? api->name : "libibverbs.so.1";
  if (api == nullptr) {
    auto loaded = verbs::load_libibverbs();
    if (!loaded.ok()) return loaded.status().message();
    api = *loaded;
  }
  auto devices = verbs::list_devices(api);
  if (!devices.ok()) return "cannot list RDMA devices: " + devices.status().message();
  if (devices->empty()) return "no RDMA device (" + lib + " loaded, 0 devices)";
  std::string seen;
  for (const auto& d : *devices) {
    if (!device.empty() && d.name != device) continue;
    for (size_t p = 0; p < d.ports.size(); ++p) {
      if (d.ports[p].state == IBV_PORT_ACTIVE) {
        *usable = d.name + " port " + std::to_string(p + 1) + " is ACTIVE (" +
                  (d.ports[p].is_ethernet() ? "RoCE" : "InfiniBand") + ", " + lib + ")";
        return "";
      }
      seen += (seen.empty() ? "" : ", ") + d.name + " port " + std::to_string(p + 1) + " not ACTIVE";
    }
  }
  if (seen.empty()) return "no RDMA device named " + device + " (GRADSYNC_IB_HCA)";
  return "no ACTIVE RDMA port (" + seen + ")";
#else
  (void)api;
  (void)device;
  (void)usable;
  return "built without infiniband/verbs.h (GRADSYNC_WITH_VERBS)";
#endif
}

}  // namespace

Result<TransportChoice> choose_transport(const std::string& requested, const verbs::IbvApi* api,
                                         const std::string& device) {
  if (requested == "tcp") return TransportChoice{"tcp", "GRADSYNC_TRANSPORT=tcp"};
  if (!requested.empty() && requested != "auto" && requested != "verbs") {
    return Status(Code::kInvalidArgument,
                  "GRADSYNC_TRANSPORT=" + requested + " is not one of auto, tcp, verbs");
  }
  std::string usable;
  std::string why = verbs_unusable(api, device, &usable);
  if (why.empty()) {
    return TransportChoice{"verbs", (requested == "verbs" ? "GRADSYNC_TRANSPORT=verbs: " : "") + usable};
  }
  if (requested == "verbs") {
    return Status(Code::kFailedPrecondition,
                  "GRADSYNC_TRANSPORT=verbs but verbs cannot run here: " + why +
                      "; unset it (or set tcp) to use TCP");
  }
  return TransportChoice{"tcp", why};
}

}  // namespace gradsync
