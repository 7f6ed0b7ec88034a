#include "gpu/plan/channels.h"

#include <algorithm>

namespace gradsync::plan {
namespace {

// Local ranks on one node beyond which the one-node CUDA IPC kernels do not run
// (docs/status.md: such a world uses the host-staged path).
constexpr size_t kMaxIpcRanks = 8;

bool gpu_reachable(const NodeShape& node, int local) {
  return node.caps.gpu_reachable.empty() || node.caps.gpu_reachable[size_t(local)];
}

// The local index of the node's exit for a channel on `rail`: its first rank on that NIC, or,
// where no rank uses it (fewer GPUs than NICs), rail mod local ranks.
int exit_local(const NodeShape& node, int rail) {
  const int nic = rail % node.nic_count;
  for (size_t l = 0; l < node.nics.size(); ++l)
    if (node.nics[l] == nic) return int(l);
  return rail % int(node.ranks.size());
}

// The node's ranks chained from local index `first`, cyclic in local order.
std::vector<int> chain_from(const NodeShape& node, int first) {
  const int n = int(node.ranks.size());
  std::vector<int> chain;
  for (int i = 0; i < n; ++i) chain.push_back(node.ranks[size_t((first + i) % n)]);
  return chain;
}

// Node and local index of every rank (JobShape::node_of is a scan; channels of thousands of
// ranks ask for every hop).
struct Where {
  std::vector<int> node, local;
  explicit Where(const JobShape& shape)
      : node(size_t(shape.world_size()), -1), local(size_t(shape.world_size()), -1) {
    for (size_t x = 0; x < shape.nodes.size(); ++x)
      for (size_t l = 0; l < shape.nodes[x].ranks.size(); ++l) {
        node[size_t(shape.nodes[x].ranks[l])] = int(x);
        local[size_t(shape.nodes[x].ranks[l])] = int(l);
      }
  }
};

Transport transport_of(const JobShape& shape, int sn, int sl, int dn, int dl) {
  const NodeShape& s = shape.nodes[size_t(sn)];
  if (sn == dn) {
    return s.caps.peer_ipc && s.ranks.size() <= kMaxIpcRanks ? Transport::kPeerIpc
                                                             : Transport::kHostStaged;
  }
  const NodeShape& d = shape.nodes[size_t(dn)];
  if (!s.caps.verbs || !d.caps.verbs || !s.caps.gdr || !d.caps.gdr) return Transport::kHostStaged;
  return gpu_reachable(s, sl) && gpu_reachable(d, dl) ? Transport::kGpuDirectRdma
                                                      : Transport::kRdmaHostMemory;
}

Hop make_hop(const JobShape& shape, const Where& w, int src, int dst) {
  Hop h;
  h.src = src;
  h.dst = dst;
  const int sn = w.node[size_t(src)], dn = w.node[size_t(dst)];
  h.inter_node = sn != dn;
  if (h.inter_node) {
    h.nic = shape.nodes[size_t(sn)].nics[size_t(w.local[size_t(src)])];
    h.recv_nic = h.nic % shape.nodes[size_t(dn)].nic_count;
  }
  h.transport = transport_of(shape, sn, w.local[size_t(src)], dn, w.local[size_t(dst)]);
  return h;
}

// Every ordered pair of ranks inside each node, as hops of `ch` (direct pushes).
void add_node_pairs(const JobShape& shape, const Where& w, Channel* ch) {
  for (const NodeShape& node : shape.nodes) {
    for (int a : node.ranks) {
      ch->order.push_back(a);
      for (int b : node.ranks)
        if (a != b) ch->hops.push_back(make_hop(shape, w, a, b));
    }
  }
}

uint64_t key(int c, int src, int dst) {
  return (uint64_t(uint32_t(c)) << 42) | (uint64_t(uint32_t(src)) << 21) | uint64_t(uint32_t(dst));
}

}  // namespace

const char* to_string(Transport t) {
  switch (t) {
    case Transport::kPeerIpc: return "cuda-ipc";
    case Transport::kGpuDirectRdma: return "gpudirect-rdma";
    case Transport::kRdmaHostMemory: return "rdma-host-memory";
    case Transport::kHostStaged: return "host-staged";
  }
  return "?";
}

const char* to_string(ChannelKind k) {
  switch (k) {
    case ChannelKind::kRing: return "ring";
    case ChannelKind::kTree: return "tree";
    case ChannelKind::kDirect: return "direct";
    case ChannelKind::kHierarchical: return "hierarchical";
  }
  return "?";
}

Transport hop_transport(const JobShape& shape, int src, int dst) {
  return transport_of(shape, shape.node_of(src), shape.local_of(src), shape.node_of(dst),
                      shape.local_of(dst));
}

ChannelSet::ChannelSet(std::vector<Channel> channels) : channels_(std::move(channels)) {
  for (size_t c = 0; c < channels_.size(); ++c)
    for (size_t i = 0; i < channels_[c].hops.size(); ++i) {
      const Hop& h = channels_[c].hops[i];
      index_[key(int(c), h.src, h.dst)] = uint32_t(i);
    }
}

const Hop* ChannelSet::hop(int c, int src, int dst) const {
  auto it = index_.find(key(c, src, dst));
  return it == index_.end() ? nullptr : &channels_[size_t(c)].hops[it->second];
}

int default_ring_channels(const JobShape& shape) {
  int rails = shape.nodes.empty() ? 1 : shape.nodes[0].nic_count;
  for (const auto& node : shape.nodes) rails = std::min(rails, node.nic_count);
  return std::max(rails, 1);
}

int default_tree_channels(const JobShape& shape) { return 2 * default_ring_channels(shape); }

int btree_parent(int p, int n) {
  if (p <= 0 || p >= n) return -1;
  const int b = p & -p;
  const int up = (p | (b << 1)) & ~b;  // bit b cleared, bit 2b set: p + b or p - b
  return up < n ? up : p & ~b;
}

int dtree_position(int x, int n, int t) {
  if (t == 0) return x;
  return n % 2 == 0 ? n - 1 - x : (x + 1) % n;
}

ChannelSet ring_channels(const JobShape& shape, int count) {
  const Where w(shape);
  std::vector<Channel> out;
  for (int c = 0; c < count; ++c) {
    Channel ch;
    ch.kind = ChannelKind::kRing;
    ch.rail = c;
    for (const NodeShape& node : shape.nodes) {
      const int first = (exit_local(node, c) + 1) % int(node.ranks.size());
      for (int r : chain_from(node, first)) ch.order.push_back(r);
    }
    const size_t n = ch.order.size();
    if (n > 1)
      for (size_t i = 0; i < n; ++i) ch.hops.push_back(make_hop(shape, w, ch.order[i], ch.order[(i + 1) % n]));
    out.push_back(std::move(ch));
  }
  return ChannelSet(std::move(out));
}

ChannelSet tree_channels(const JobShape& shape, int count, int root) {
  const Where w(shape);
  const int nn = shape.node_count();
  const int root_node = root >= 0 ? shape.node_of(root) : 0;
  std::vector<std::vector<int>> child_pos(static_cast<size_t>(nn));  // in position order
  for (int k = 1; k < nn; ++k) child_pos[size_t(btree_parent(k, nn))].push_back(k);
  std::vector<Channel> out;
  for (int c = 0; c < count; ++c) {
    Channel ch;
    ch.kind = ChannelKind::kTree;
    ch.rail = c / 2;  // channels 2j and 2j+1: both trees on rail j, so each NIC carries both
    ch.tree = c % 2;
    ch.links.resize(size_t(shape.world_size()));
    // Node x's position in this tree, and the node at each position.
    std::vector<int> node_at(static_cast<size_t>(nn));
    for (int x = 0; x < nn; ++x) {
      const int q = (x - root_node + nn) % nn;
      const int pos = root < 0 ? dtree_position(q, nn, ch.tree) : ch.tree == 0 ? q : (nn - q) % nn;
      node_at[size_t(pos)] = x;
    }
    std::vector<std::vector<int>> chains(static_cast<size_t>(nn));
    for (int x = 0; x < nn; ++x) {
      const NodeShape& node = shape.nodes[size_t(x)];
      const int head = root >= 0 && x == root_node ? shape.local_of(root) : exit_local(node, ch.rail);
      chains[size_t(x)] = chain_from(node, head);
    }
    auto add_child = [&](int parent, int child) {
      TreeLinks& l = ch.links[size_t(parent)];
      l.children[l.nchildren++] = child;
      ch.links[size_t(child)].parent = parent;
    };
    for (int pos = 0; pos < nn; ++pos) {
      const auto& chain = chains[size_t(node_at[size_t(pos)])];
      for (int k : child_pos[size_t(pos)])  // the child nodes' heads
        add_child(chain[0], chains[size_t(node_at[size_t(k)])][0]);
      for (size_t i = 1; i < chain.size(); ++i) add_child(chain[i - 1], chain[i]);
      for (int r : chain) ch.order.push_back(r);
    }
    for (int r : ch.order) {
      const int p = ch.links[size_t(r)].parent;
      if (p < 0) continue;
      ch.hops.push_back(make_hop(shape, w, r, p));
      ch.hops.push_back(make_hop(shape, w, p, r));
    }
    out.push_back(std::move(ch));
  }
  return ChannelSet(std::move(out));
}

ChannelSet direct_channels(const JobShape& shape, int count) {
  const Where w(shape);
  std::vector<Channel> out;
  for (int c = 0; c < count; ++c) {
    Channel ch;
    ch.kind = ChannelKind::kDirect;
    ch.rail = c;
    add_node_pairs(shape, w, &ch);
    out.push_back(std::move(ch));
  }
  return ChannelSet(std::move(out));
}

ChannelSet hierarchical_channels(const JobShape& shape, int count) {
  const Where w(shape);
  std::vector<Channel> out;
  const size_t k = shape.nodes.size();
  for (int c = 0; c < count; ++c) {
    Channel ch;
    ch.kind = ChannelKind::kHierarchical;
    ch.rail = c;
    add_node_pairs(shape, w, &ch);
    size_t g = shape.nodes.empty() ? 0 : shape.nodes[0].ranks.size();
    for (const NodeShape& node : shape.nodes) g = std::min(g, node.ranks.size());
    for (size_t l = 0; k > 1 && l < g; ++l)
      for (size_t x = 0; x < k; ++x)
        ch.hops.push_back(make_hop(shape, w, shape.nodes[x].ranks[l], shape.nodes[(x + 1) % k].ranks[l]));
    out.push_back(std::move(ch));
  }
  return ChannelSet(std::move(out));
}

}  // namespace gradsync::plan
