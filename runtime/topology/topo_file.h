// The topology file (GRADSYNC_TOPO_FILE, gradsyncd --topo-file): a node's GPUs, links and NICs
// declared instead of discovered. Tests use it to give ranks that share one physical GPU the
// shape of several GPUs per node (local rank i uses declared GPU i, and every declared GPU may
// be CUDA device 0). Production never needs it. Examples: tests/data/topo/*.topo.
//
// One item per line, fields separated by blanks, '#' starts a comment:
//
//   gpu BUS-ID [device=N] [name=WORD]       GPU i is the i-th gpu line; device: its CUDA device
//   nic NAME [gbits=N] [bus=BUS-ID]         NIC j is the j-th nic line; gbits: line rate, Gb/s
//   nvswitch LINKS [gbps=N]                 every GPU pair joined through NVSwitch, LINKS each
//   nvlink A B LINKS [gbps=N]               GPUs A and B joined directly by LINKS NVLinks
//   pcie A B DIST                           GPUs A and B over PCIe, DIST one of PIX PXB PHB NODE SYS
//   distance GPU NIC DIST                   PCIe distance from a GPU to a NIC (by NIC name)
//   rail GPU NIC|none                       the GPU's own NIC (default: the nearest, spread);
//                                           none: it has no NIC of its own
//
// gbps is per link and direction (default 25, NVLink 4). Items name GPUs and NICs declared on
// earlier lines. Undeclared GPU pairs and GPU-NIC distances are SYS. Every error names the
// file, the line number and what is wrong with it.
#pragma once

#include <string>

#include "gradsync/status.h"
#include "topology/gpu_topology.h"

namespace gradsync::topology {

// At most this many GPUs and NICs per file (a node of today has 8 of each; the summary sent
// to the coordinator is bounded by it too).
constexpr size_t kMaxTopoGpus = 64;
constexpr size_t kMaxTopoNics = 64;

// Reads and checks the file; `source` becomes "file PATH".
Result<NodeTopology> parse_topo_file(const std::string& path);
// The same for text already read; `name` is used in errors and `source`.
Result<NodeTopology> parse_topo_text(const std::string& text, const std::string& name);

}  // namespace gradsync::topology
