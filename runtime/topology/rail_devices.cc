#include "topology/rail_devices.h"

#include <algorithm>
#include <map>

namespace gradsync::topology {

RailDevices rail_devices(const NodeTopology& topo, const std::function<std::string(const std::string& nic)>& refusal) {
  RailDevices out;
  const size_t gpus = std::min(topo.gpus.size(), kMaxRailDevices);
  std::map<std::string, std::string> asked;  // NIC name -> refusal
  for (size_t g = 0; g < gpus; ++g) {
    const int rail = g < topo.rails.size() ? topo.rails[g] : -1;
    std::string why;
    std::string name;
    if (rail < 0 || size_t(rail) >= topo.nics.size()) {
      why = "no NIC is its rail";
    } else {
      name = topo.nics[size_t(rail)].name;
      if (name.empty()) {
        why = "its rail NIC has no name";
      } else if (name.size() > kMaxRailDeviceName) {
        why = "its rail NIC's name has " + std::to_string(name.size()) + " bytes, above the limit of " +
              std::to_string(kMaxRailDeviceName);
      } else {
        auto it = asked.find(name);
        if (it == asked.end()) it = asked.emplace(name, refusal(name)).first;
        why = it->second;
      }
    }
    out.devices.push_back(why.empty() ? name : std::string());
    out.why.push_back(why.empty() || name.empty() ? why : name + ": " + why);
  }
  return out;
}

std::string describe(const RailDevices& rails) {
  std::string out;
  for (size_t g = 0; g < rails.devices.size(); ++g) {
    out += (g ? ", GPU" : "GPU") + std::to_string(g) + " ";
    out += rails.devices[g].empty() ? "the daemon's (" + rails.why[g] + ")" : rails.devices[g];
  }
  return out.empty() ? "no GPUs" : out;
}

RankDevice rank_rdma_device(const std::vector<std::string>& rail_devices, int gpu, const std::string& daemon_device) {
  const std::string mine = "GPU " + std::to_string(gpu);
  if (gpu < 0 || size_t(gpu) >= rail_devices.size()) {
    return {daemon_device, "the daemon's device: gradsyncd lists rails for " + std::to_string(rail_devices.size()) +
                               " GPU(s), none for " + mine};
  }
  if (rail_devices[size_t(gpu)].empty()) {
    return {daemon_device, "the daemon's device: " + mine +
                               " has no rail NIC gradsyncd can use in its place (its log says why)"};
  }
  const std::string& rail = rail_devices[size_t(gpu)];
  return {rail, mine + "'s rail NIC" + (rail == daemon_device ? ", also the daemon's device" : "")};
}

}  // namespace gradsync::topology
