#include "gpu/plan/from_topology.h"

#include <algorithm>

namespace gradsync::plan {

using topology::GpuLinkKind;

Result<NodeShape> node_shape(const topology::NodeTopology& topo, const NodeRanks& in,
                             topology::PciDistance gdr_level) {
  const std::string where = "node " + in.name + " (topology " + topo.source + ")";
  if (in.ranks.size() != in.gpus.size())
    return Status(Code::kInvalidArgument, where + ": " + std::to_string(in.ranks.size()) + " ranks but " +
                                              std::to_string(in.gpus.size()) + " GPUs");
  NodeShape node;
  node.name = in.name;
  node.ranks = in.ranks;
  node.gpus = in.gpus;
  node.nic_count = std::max<int>(1, int(topo.nics.size()));
  for (size_t l = 0; l < in.gpus.size(); ++l) {
    const int g = in.gpus[l];
    if (g < 0 || size_t(g) >= topo.gpus.size())
      return Status(Code::kInvalidArgument, where + ": rank " + std::to_string(in.ranks[l]) + " is on GPU " +
                                                std::to_string(g) + ", the topology has " +
                                                std::to_string(topo.gpus.size()));
    const int rail = size_t(g) < topo.rails.size() ? topo.rails[size_t(g)] : -1;
    node.nics.push_back(std::max(rail, 0));
    bool reachable = rail >= 0 && size_t(g) < topo.nic_distance.size() &&
                     size_t(rail) < topo.nic_distance[size_t(g)].size();
    if (reachable) {
      const auto& d = topo.nic_distance[size_t(g)][size_t(rail)];
      reachable = d.has_value() && int(*d) <= int(gdr_level);
    }
    node.caps.gpu_reachable.push_back(reachable);
  }
  for (int a : in.gpus)
    for (int b : in.gpus)
      if (a != b && size_t(a) < topo.links.size() && size_t(b) < topo.links[size_t(a)].size() &&
          topo.links[size_t(a)][size_t(b)].p2p == 0)
        node.caps.peer_ipc = false;
  return node;
}

LinkFigures node_links(const topology::NodeTopology& topo, const std::vector<int>& gpus) {
  LinkFigures f;
  bool nvlink = gpus.size() > 1;
  double per_gpu = 0;  // the slowest GPU's GB/s to the others
  bool first = true;
  for (int a : gpus) {
    double sum = 0, sw = 0;
    for (int b : gpus) {
      if (a == b || size_t(a) >= topo.links.size() || size_t(b) >= topo.links[size_t(a)].size()) continue;
      const auto& link = topo.links[size_t(a)][size_t(b)];
      if (link.kind == GpuLinkKind::kNvLink) sum += link.gbps;
      else if (link.kind == GpuLinkKind::kNvSwitch) sw = std::max(sw, link.gbps);
      else nvlink = false;
    }
    const double mine = sw > 0 ? sw : sum;  // a switch port's bandwidth is shared by every peer
    if (first || mine < per_gpu) per_gpu = mine, first = false;
  }
  if (nvlink && per_gpu > 0) {
    f.intra_class = LinkClass::kNVLink;
    f.intra_gbps = per_gpu;
  } else if (gpus.size() > 1) {
    f.intra_class = LinkClass::kPCIe;
    f.intra_gbps = kPcieGBps;
  }
  double slowest = 0;
  for (const auto& nic : topo.nics)
    if (nic.gbits > 0 && (slowest == 0 || nic.gbits < slowest)) slowest = nic.gbits;
  if (slowest > 0) f.nic_gbps = slowest / 8 * kNicEfficiency;
  return f;
}

}  // namespace gradsync::plan
