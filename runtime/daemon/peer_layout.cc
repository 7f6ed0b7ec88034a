#include "daemon/peer_layout.h"

#include <string>

namespace gradsync {

Result<PeerLayout> expand_layout(const v1::PeerTableResponse& table) {
  const uint32_t world = table.world_size();
  auto bad = [&](const std::string& why) {
    return Status(Code::kInternal, "the coordinator sent a malformed job layout (" + why + ")");
  };
  PeerLayout l;
  l.position.assign(world, UINT32_MAX);
  l.rank_node.assign(world, UINT32_MAX);
  l.ring.reserve(world);
  for (int i = 0; i < table.runs_size(); ++i) {
    const v1::NodeRun& run = table.runs(i);
    const uint64_t count = uint64_t(run.nodes()) * run.ranks_per_node();
    if (run.nodes() == 0 || run.ranks_per_node() == 0 || l.ring.size() + count > world ||
        uint64_t(run.first_rank()) + count > world) {
      return bad("run " + std::to_string(i) + " goes past world size " + std::to_string(world));
    }
    if (run.continues() && (l.node_shape.empty() || run.nodes() != 1)) {
      return bad("run " + std::to_string(i) + " continues no node");
    }
    if (run.shape() >= uint32_t(table.shapes_size())) return bad("run " + std::to_string(i) + " names no shape");
    for (uint32_t k = 0; k < run.nodes(); ++k) {
      if (!(run.continues() && k == 0)) l.node_shape.push_back(run.shape());
      const uint32_t node = uint32_t(l.node_shape.size() - 1);
      for (uint32_t j = 0; j < run.ranks_per_node(); ++j) {
        const uint32_t rank = run.first_rank() + k * run.ranks_per_node() + j;
        if (l.position[rank] != UINT32_MAX) return bad("rank " + std::to_string(rank) + " appears twice");
        l.position[rank] = uint32_t(l.ring.size());
        l.rank_node[rank] = node;
        l.ring.push_back(rank);
      }
    }
  }
  if (l.ring.size() != world) {
    return bad(std::to_string(l.ring.size()) + " ranks in the runs for world size " + std::to_string(world));
  }
  if (l.node_shape.size() != table.node_count()) {
    return bad(std::to_string(l.node_shape.size()) + " nodes in the runs, " + std::to_string(table.node_count()) +
               " in the table");
  }
  return l;
}

}  // namespace gradsync
