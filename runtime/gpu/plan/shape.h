// The input of the GPU planning layer (runtime/gpu/plan): a job's shape. Which ranks sit on
// which node, in which local order, on which GPU and behind which NIC (its rail), what each
// node can do (CUDA IPC between its GPUs, verbs, GPUDirect RDMA per GPU), and the figures of
// its links. Plain data: discovery (NVML, sysfs, a topology file) fills it elsewhere; the
// planning functions only read it, so every rank that holds the same shape plans the same.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gradsync::plan {

// How the GPUs of one node reach each other.
enum class LinkClass : uint8_t { kNVLink = 0, kPCIe = 1 };
const char* to_string(LinkClass c);

// Per-hop latency of the two protocols the cost model knows (cost_model.h): low-latency
// (a flag per 8 bytes, NCCL's LL) and bulk (payload, fence, then a counter: NCCL's Simple).
struct HopLatency {
  double ll_us = 0;
  double bulk_us = 0;
};

// Declared link figures, the same for every node of a job.
struct LinkFigures {
  LinkClass intra_class = LinkClass::kNVLink;
  // Inside a node: GB/s (1e9 bytes/s) one GPU can send, per direction, to the other GPUs of
  // its node (NVLink 4 on H100/H200: 450), and the latency of one hop.
  double intra_gbps = 450;
  HopLatency intra_lat{0.6, 3.4};  // NCCL's NVLink per-hop ring figures (nccl.md §1, tuning.cc)
  // Between nodes, per NIC: GB/s per direction (400 Gb/s NDR moves 46-48 GB/s busbw,
  // nccl-tests#290) and the latency of one network hop.
  double nic_gbps = 48;
  HopLatency nic_lat{2.7, 14.0};  // NCCL's NET per-hop ring figures (same source)
};

// What a node offers to the transports (docs/gpudirect.md's rules, per node and per GPU).
struct NodeCaps {
  bool peer_ipc = true;  // CUDA IPC opens the other local GPUs' memory (else host staging)
  bool verbs = true;     // gradsyncd runs verbs channels (else TCP between daemons)
  bool gdr = true;       // GPUDirect RDMA not switched off (GRADSYNC_GDR=0 clears it)
  // Per local rank: its NIC can read and write its GPU's memory (distance within
  // GRADSYNC_GDR_LEVEL, dma-buf or peermem). Empty: every GPU can.
  std::vector<bool> gpu_reachable;
};

struct NodeShape {
  std::string name;
  std::vector<int> ranks;  // global ranks in local order (local rank i is ranks[i])
  std::vector<int> gpus;   // per local rank: its GPU ordinal on the node
  std::vector<int> nics;   // per local rank: its rail, the NIC index it uses (0 .. nic_count-1)
  int nic_count = 1;
  NodeCaps caps;
};

struct JobShape {
  std::vector<NodeShape> nodes;
  LinkFigures links;

  int world_size() const;
  int node_count() const { return int(nodes.size()); }
  // Node index and local index of `rank`; -1 for a rank that is in no node.
  int node_of(int rank) const;
  int local_of(int rank) const;
  // Empty when the shape is usable, else what is wrong: ranks 0..world-1 each exactly once,
  // per-rank vectors of equal length, rails within nic_count, at least one rank per node.
  std::string validate() const;
};

// The usual shape: `nodes` nodes of `gpus` GPUs, ranks numbered node-major (node i holds
// i*gpus .. i*gpus+gpus-1), GPU = local rank, rail = local rank * nics / gpus (one NIC per GPU
// when nics == gpus), default figures and capabilities.
JobShape uniform_shape(int nodes, int gpus, int nics);

}  // namespace gradsync::plan
