// A node of the planner's job shape (shape.h) from the node's discovered GPU topology
// (runtime/topology/gpu_topology.h: NVML, CUDA peer access, sysfs, or a topology file): each
// rank's rail is its GPU's NIC, GPUDirect is possible where that NIC is within
// GRADSYNC_GDR_LEVEL of the GPU (docs/gpudirect.md), CUDA IPC where no pair of the node's GPUs
// refuses peer access, and the link figures come from the NVLink counts and NIC line rates.
#pragma once

#include <string>
#include <vector>

#include "gpu/plan/shape.h"
#include "gradsync/status.h"
#include "topology/gpu_topology.h"

namespace gradsync::plan {

struct NodeRanks {
  std::string name;
  std::vector<int> ranks;  // global ranks in local order
  std::vector<int> gpus;   // per local rank: its GPU, an index into the topology's gpus
};

// PCIe 4.0 x16 per direction, GB/s: what a PCIe pair of GPUs is taken to move (discovery does
// not measure PCIe).
constexpr double kPcieGBps = 24.0;
// Busbw of a NIC against its line rate: 46-48 GB/s for 400 Gb/s NDR (nccl-tests#290).
constexpr double kNicEfficiency = 0.96;

// The node: ranks, GPUs, rails (the topology's), NIC count, capabilities. kInvalidArgument
// naming the node and rank where a GPU index is outside the topology or the lists differ.
Result<NodeShape> node_shape(const topology::NodeTopology& topo, const NodeRanks& ranks,
                             topology::PciDistance gdr_level = topology::PciDistance::PXB);

// Link figures of the node's GPUs `gpus`: NVLink when every pair is NVLink or NVSwitch (per
// GPU: the switch bandwidth, or the sum of its direct links to the others), else PCIe at
// kPcieGBps; per NIC the slowest NIC's line rate x kNicEfficiency. Latencies stay NCCL's.
LinkFigures node_links(const topology::NodeTopology& topo, const std::vector<int>& gpus);

}  // namespace gradsync::plan
