// Channels over a job shape (shape.h): who sends to whom, through which link and transport.
// Pure functions: every rank that holds the same shape computes the same channels.
//
// Ring channel c: an order of all ranks in which each node's ranks are contiguous, chained
// inside the node, and the node is left through rail c mod nics: the node's exit is its first
// rank whose rail is that NIC, and the chain starts at the rank after it (local order, cyclic),
// so the next node's chain is entered through the same rail. C channels spread over the
// node's rails (NCCL: "each channel enters each node once, through one NIC", connect.cc;
// traffic stays on one rail, multinode_ops.md §1).
//
// Tree channel c: tree c mod 2 of a double binary tree across nodes, a chain inside each
// node, the node's head (its rank on rail c/2 mod nics) linked to the heads of its parent and
// child nodes. Channels 2j and 2j+1 share rail j, so every NIC carries both trees: a node
// interior in one (three halves of its channel's share) and a leaf in the other (one) moves
// the same on each of its NICs. Tree 0 is the in-order binary tree over node positions whose leaves are the
// odd positions; tree 1 puts node x at position N-1-x (N even: the mirror) or x+1 mod N (N
// odd: the shift), so that a node interior in one tree is a leaf in the other (NCCL's
// ncclGetDtree, trees.cc; nccl.md §1). Each tree carries half of the data.
//
// Direct channels (one node only): every rank reaches every other rank in one hop (one-shot
// and two-shot). Hierarchical channels: direct inside every node, and one ring per local
// index across the nodes, each on the rail of the ranks it joins.
//
// Each hop's transport follows docs/gpudirect.md: inside a node, CUDA IPC where the node
// allows it (at most 8 ranks, peer access), else host staging through gradsyncd; between
// nodes, GPUDirect RDMA where both daemons run verbs, neither has GPUDirect switched off and
// both GPUs are reachable from their NIC; RDMA into pinned host memory where one GPU is not;
// host staging through the daemons (verbs or TCP) otherwise.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpu/plan/shape.h"

namespace gradsync::plan {

enum class Transport : uint8_t {
  kPeerIpc = 0,         // a kernel stores into the peer GPU's memory (CUDA IPC)
  kGpuDirectRdma = 1,   // the NIC writes GPU memory on both ends
  kRdmaHostMemory = 2,  // RDMA, with one end's slots in pinned host memory
  kHostStaged = 3,      // copies to host memory, moved by gradsyncd (shared memory, verbs, TCP)
};
const char* to_string(Transport t);

// The transport of a hop from `src` to `dst` (ranks of `shape`), by the rules above.
Transport hop_transport(const JobShape& shape, int src, int dst);

enum class ChannelKind : uint8_t { kRing = 0, kTree = 1, kDirect = 2, kHierarchical = 3 };
const char* to_string(ChannelKind k);

struct Hop {
  int src = -1;
  int dst = -1;
  bool inter_node = false;
  int nic = -1;       // between nodes: the sending node's NIC (rail); -1 inside a node
  int recv_nic = -1;  // between nodes: the receiving node's NIC
  Transport transport = Transport::kPeerIpc;
};

// A rank's place in a tree channel: its parent (-1 at the root) and up to three children
// (two child nodes' heads and the next rank of its node's chain).
struct TreeLinks {
  int parent = -1;
  int nchildren = 0;
  int children[3] = {-1, -1, -1};
};

struct Channel {
  ChannelKind kind = ChannelKind::kRing;
  int rail = 0;            // ring: c, tree: c/2; its hops leave nodes through NIC rail mod count
  int tree = 0;            // tree: 0 or 1
  std::vector<int> order;  // ring: ranks in ring order; tree: ranks, root first, node by node
  std::vector<TreeLinks> links;  // tree: indexed by rank
  std::vector<Hop> hops;         // every directed hop it uses
};

class ChannelSet {
 public:
  ChannelSet() = default;
  explicit ChannelSet(std::vector<Channel> channels);
  const std::vector<Channel>& channels() const { return channels_; }
  int size() const { return int(channels_.size()); }
  const Channel& operator[](int c) const { return channels_[size_t(c)]; }
  // The hop of channel `c` from src to dst; null where the channel has none.
  const Hop* hop(int c, int src, int dst) const;

 private:
  std::vector<Channel> channels_;
  std::unordered_map<uint64_t, uint32_t> index_;  // (channel, src, dst) -> hop index
};

// Channel counts when the caller does not choose: one ring per rail (the fewest rails of any
// node, at least 1); two tree channels per rail, one of each tree.
int default_ring_channels(const JobShape& shape);
int default_tree_channels(const JobShape& shape);

ChannelSet ring_channels(const JobShape& shape, int count);
// root < 0: the allreduce trees (rooted at node 0). root >= 0: both trees rooted at that
// rank's node, and the rank is its node's head in every channel (broadcast).
ChannelSet tree_channels(const JobShape& shape, int count, int root = -1);
// One node: every ordered pair of its ranks, in `count` channels.
ChannelSet direct_channels(const JobShape& shape, int count);
// Every ordered pair inside each node, and per local index l a ring over the nodes' l-th
// ranks (node order), leaving each node through that rank's NIC; `count` channels.
ChannelSet hierarchical_channels(const JobShape& shape, int count);

// The binary tree over positions 0..n-1 used for both trees: the parent of position p (-1 for
// 0). Position p whose lowest set bit is b hangs below p + b or p - b, whichever has bit 2b
// set (p - b when p + b >= n); so odd positions are leaves and the depth is about log2(n).
int btree_parent(int p, int n);
// Node x's position in tree t (0 or 1) of n nodes, before any rotation.
int dtree_position(int x, int n, int t);

}  // namespace gradsync::plan
