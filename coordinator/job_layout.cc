#include "coordinator/job_layout.h"

#include <algorithm>

#include "collectives/topology.h"

namespace gradsync::coordinator {

std::vector<uint32_t> JobLayout::needed(uint32_t node) const {
  std::vector<size_t> positions;
  for (uint32_t p = node_begin[node]; p < node_begin[node + 1]; ++p) positions.push_back(p);
  std::vector<uint32_t> out;
  for (size_t p : positions) out.push_back(ring[p]);
  // One ring tag is enough: every ring connects the same neighbours.
  for (const Edge& e : channel_edges_at(ring, positions, 1)) {
    out.push_back(e.src);
    out.push_back(e.dst);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

JobLayout build_layout(const std::vector<const std::string*>& rank_owner,
                       const std::unordered_map<std::string, const v1::GpuTopology*>& topology_of) {
  JobLayout l;
  const uint32_t world = uint32_t(rank_owner.size());
  // Nodes numbered by their smallest rank; each node's ranks ascending.
  std::vector<std::vector<uint32_t>> ranks_of;
  l.rank_node.resize(world);
  for (uint32_t r = 0; r < world; ++r) {
    auto [it, fresh] = l.node_number.emplace(*rank_owner[r], uint32_t(l.node_ids.size()));
    if (fresh) {
      l.node_ids.push_back(*rank_owner[r]);
      ranks_of.emplace_back();
    }
    ranks_of[it->second].push_back(r);
    l.rank_node[r] = it->second;
  }
  l.ring.reserve(world);
  std::unordered_map<std::string, uint32_t> shape_index;
  for (uint32_t n = 0; n < l.node_ids.size(); ++n) {
    l.node_begin.push_back(uint32_t(l.ring.size()));
    l.ring.insert(l.ring.end(), ranks_of[n].begin(), ranks_of[n].end());
    auto topo = topology_of.find(l.node_ids[n]);
    const v1::GpuTopology empty;
    const v1::GpuTopology& t = topo == topology_of.end() || !topo->second ? empty : *topo->second;
    auto [sit, fresh] = shape_index.emplace(t.SerializeAsString(), uint32_t(l.shapes.size()));
    if (fresh) l.shapes.push_back(t);
    l.node_shape.push_back(sit->second);
  }
  l.node_begin.push_back(uint32_t(l.ring.size()));

  // Runs: a node of one contiguous block of ranks extends the previous run where it has the
  // same size and shape and follows on; a node of several blocks takes a run per block.
  bool last_mergeable = false;
  for (uint32_t n = 0; n < l.node_ids.size(); ++n) {
    const auto& ranks = ranks_of[n];
    std::vector<std::pair<uint32_t, uint32_t>> blocks;  // first, count
    for (uint32_t r : ranks) {
      if (!blocks.empty() && blocks.back().first + blocks.back().second == r) ++blocks.back().second;
      else blocks.push_back({r, 1});
    }
    const bool single = blocks.size() == 1;
    if (single && last_mergeable) {
      v1::NodeRun& prev = l.runs.back();
      if (prev.ranks_per_node() == blocks[0].second && prev.shape() == l.node_shape[n] &&
          prev.first_rank() + prev.nodes() * prev.ranks_per_node() == blocks[0].first) {
        prev.set_nodes(prev.nodes() + 1);
        continue;
      }
    }
    for (size_t b = 0; b < blocks.size(); ++b) {
      v1::NodeRun run;
      run.set_first_rank(blocks[b].first);
      run.set_ranks_per_node(blocks[b].second);
      run.set_nodes(1);
      run.set_continues(b > 0);
      run.set_shape(l.node_shape[n]);
      l.runs.push_back(run);
    }
    last_mergeable = single;
  }
  return l;
}

}  // namespace gradsync::coordinator
