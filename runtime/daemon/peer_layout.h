// The job's layout as a daemon receives it from the coordinator (v1::NodeRun runs, see
// proto/coordinator.proto), expanded and checked: the ring, each rank's node number and each
// node's GPU topology index. The coordinator is not trusted to send a well-formed one: runs
// that do not cover every rank exactly once, or claim more than the world, are refused.
#pragma once

#include <cstdint>
#include <vector>

#include "coordinator.pb.h"
#include "gradsync/status.h"

namespace gradsync {

struct PeerLayout {
  std::vector<uint32_t> ring;        // ranks in ring order
  std::vector<uint32_t> position;    // rank -> ring position
  std::vector<uint32_t> rank_node;   // rank -> node number
  std::vector<uint32_t> node_shape;  // node number -> index into the table's shapes
};

Result<PeerLayout> expand_layout(const v1::PeerTableResponse& table);

}  // namespace gradsync
