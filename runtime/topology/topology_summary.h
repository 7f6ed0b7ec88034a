// A node's GPU topology as it travels: gradsyncd summarizes it into its registration
// (v1::GpuTopology), the coordinator checks the bounds before it keeps it, and
// `gradsyncctl describe` prints it the way `nvidia-smi topo -m` does.
#pragma once

#include <string>

#include "coordinator.pb.h"
#include "gradsync/status.h"
#include "topology/gpu_topology.h"

namespace gradsync::topology {

v1::GpuTopology summarize(const NodeTopology& topo);

// kInvalidArgument naming the field when the summary breaks a bound (more than kMaxTopoGpus
// GPUs or kMaxTopoNics NICs, a matrix of the wrong size, an unknown label, a rail out of
// range, an overlong string). An empty summary (an older daemon) is fine.
Status check_summary(const v1::GpuTopology& summary);

// The topology back from a summary, for planning with another node's (the peer table's
// topologies): kinds, NVLink counts and bandwidths, PCIe letters, NICs, distances and rails.
// What the summary does not carry stays unknown: CUDA devices (-1), peer access (-1), the PCIe
// path of an NVLink pair. The summary is checked first (check_summary's error).
Result<NodeTopology> from_summary(const v1::GpuTopology& summary);

// The lines `gradsyncctl describe` prints for one node, each starting with `indent`:
//   GPUs (nvml): 0 0000:19:00.0 NVIDIA H200, ...
//          GPU0  GPU1  mlx5_0  rail
//   GPU0   X     NV18  PIX     mlx5_0
std::string render_summary(const v1::GpuTopology& summary, const std::string& indent);

}  // namespace gradsync::topology
