#include "gpu/plan/shape.h"

#include <algorithm>

namespace gradsync::plan {

const char* to_string(LinkClass c) { return c == LinkClass::kNVLink ? "nvlink" : "pcie"; }

int JobShape::world_size() const {
  int n = 0;
  for (const auto& node : nodes) n += int(node.ranks.size());
  return n;
}

int JobShape::node_of(int rank) const {
  for (size_t i = 0; i < nodes.size(); ++i) {
    const auto& r = nodes[i].ranks;
    if (std::find(r.begin(), r.end(), rank) != r.end()) return int(i);
  }
  return -1;
}

int JobShape::local_of(int rank) const {
  for (const auto& node : nodes) {
    auto it = std::find(node.ranks.begin(), node.ranks.end(), rank);
    if (it != node.ranks.end()) return int(it - node.ranks.begin());
  }
  return -1;
}

std::string JobShape::validate() const {
  const int n = world_size();
  if (nodes.empty()) return "no nodes";
  std::vector<int> seen(size_t(n), 0);
  for (size_t i = 0; i < nodes.size(); ++i) {
    const auto& node = nodes[i];
    const std::string where = "node " + std::to_string(i) + " (" + node.name + ")";
    if (node.ranks.empty()) return where + " has no ranks";
    if (node.gpus.size() != node.ranks.size() || node.nics.size() != node.ranks.size())
      return where + ": gpus and nics need one entry per rank";
    if (!node.caps.gpu_reachable.empty() && node.caps.gpu_reachable.size() != node.ranks.size())
      return where + ": caps.gpu_reachable needs one entry per rank or none";
    if (node.nic_count < 1) return where + " has no NIC";
    for (size_t l = 0; l < node.ranks.size(); ++l) {
      const int r = node.ranks[l];
      if (r < 0 || r >= n) return where + ": rank " + std::to_string(r) + " is outside 0.." + std::to_string(n - 1);
      if (seen[size_t(r)]++) return "rank " + std::to_string(r) + " appears twice";
      if (node.nics[l] < 0 || node.nics[l] >= node.nic_count)
        return where + ": rank " + std::to_string(r) + " uses NIC " + std::to_string(node.nics[l]) +
               " of " + std::to_string(node.nic_count);
    }
  }
  if (links.intra_gbps <= 0 || links.nic_gbps <= 0) return "link bandwidths must be positive";
  return {};
}

JobShape uniform_shape(int nodes, int gpus, int nics) {
  JobShape s;
  nics = std::max(nics, 1);
  for (int i = 0; i < nodes; ++i) {
    NodeShape node;
    node.name = "node" + std::to_string(i);
    node.nic_count = nics;
    for (int l = 0; l < gpus; ++l) {
      node.ranks.push_back(i * gpus + l);
      node.gpus.push_back(l);
      node.nics.push_back(l * nics / gpus);
    }
    s.nodes.push_back(std::move(node));
  }
  return s;
}

}  // namespace gradsync::plan
