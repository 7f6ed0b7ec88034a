// A completed generation's layout, built once when its last rank joins: the ring (nodes by
// their smallest rank, ranks ascending within a node), node numbers in ring order, the ring in
// runs (v1::NodeRun), the distinct GPU topologies, and per node the ranks it needs (its own and
// the other ends of its channels). Every peer-table request then reads it without copying it.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "coordinator.pb.h"

namespace gradsync::coordinator {

struct JobLayout {
  std::vector<uint32_t> ring;          // ranks in ring order
  std::vector<uint32_t> rank_node;     // rank -> node number
  std::vector<uint32_t> node_begin;    // node number -> its first ring position; one past the end last
  std::vector<std::string> node_ids;   // node number -> node id
  std::unordered_map<std::string, uint32_t> node_number;
  std::vector<v1::NodeRun> runs;
  std::vector<v1::GpuTopology> shapes;  // distinct
  std::vector<uint32_t> node_shape;     // node number -> index into shapes

  // The ranks node `node` needs: its own and the other ends of every ring and tree channel
  // with an end on it; ascending. O(its ranks).
  std::vector<uint32_t> needed(uint32_t node) const;
};

// `rank_owner[r]` is the node id holding rank r (every rank held); `topology_of` gives a
// node's GPU topology. O(world + nodes).
JobLayout build_layout(const std::vector<const std::string*>& rank_owner,
                       const std::unordered_map<std::string, const v1::GpuTopology*>& topology_of);

}  // namespace gradsync::coordinator
