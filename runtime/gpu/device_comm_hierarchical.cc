// The hierarchical path of the GPU communicator (gpu/device_comm.h): several nodes with the
// same number L >= 2 of GPU ranks each. An allreduce runs in three steps on the caller's
// stream, each over the link that suits it:
//   1. inside the node, the CUDA IPC kernels reduce_scatter the buffer (NVLink): local rank l
//      holds the node's sum of shard l (count / L elements);
//   2. between nodes, rail l (the ranks of local index l, one per node, in node order) runs a
//      GPUDirect RDMA ring allreduce of shard l (gpu/gdr_channels.h): each NIC carries 2 (N-1)/N of
//      a shard, not of the whole buffer;
//   3. inside the node, the IPC kernels all_gather the shards.
// The count % L elements past the shards: a node allreduce, then every rail allreduces them
// (each rail gets the same node sums in the same ring order, so every rank gets the same bits).
// avg sums in steps 1 and 3 and divides by the world's rank count in the ring's last step.
// Bytes per rank: 2 (L-1)/L S over NVLink and 2 (N-1)/(N L) S over its NIC, as NCCL's tree of
// rings across nodes (docs/architecture.md). The other collectives, and allreduces below
// the GPUDirect threshold, take the flat paths.
#include <algorithm>
#include <cstring>
#include <map>

#include "common/log.h"
#include "gpu/device_comm_impl.h"

namespace gradsync {

using namespace device_comm_detail;

namespace {

// The world's ranks by node: nodes in the order of their lowest rank, each node's ranks in
// rank order. Empty when the configuration does not say where every rank is.
std::vector<std::vector<int>> nodes_of(const DeviceCommConfig& cfg) {
  const std::vector<std::string>& ids = cfg.rank_nodes.size() == size_t(cfg.world_size) ? cfg.rank_nodes : cfg.hosts;
  if (ids.size() != size_t(cfg.world_size)) return {};
  std::vector<std::vector<int>> nodes;
  std::map<std::string, size_t> index;
  for (int r = 0; r < cfg.world_size; ++r) {
    auto [it, fresh] = index.emplace(ids[size_t(r)], nodes.size());
    if (fresh) nodes.emplace_back();
    nodes[it->second].push_back(r);
  }
  return nodes;
}

}  // namespace

// Collective: every rank of a multi-node communicator calls it after setup_gdr. Every input
// of the decision is the same on every rank (the node table, the flat ring's outcome, the
// agreed switch), and each set-up step agrees on its own outcome.
Status DeviceComm::setup_hierarchical() {
#if GRADSYNC_HAVE_GDR
  Impl& m = *impl_;
  const std::vector<std::vector<int>> nodes = nodes_of(cfg_);
  std::string not_why;
  const size_t per = nodes.empty() ? 0 : nodes[0].size();
  if (nodes.size() < 2) {
    not_why = "the nodes of the ranks are not known";
  } else if (!std::all_of(nodes.begin(), nodes.end(), [&](const auto& n) { return n.size() == per; })) {
    not_why = "the nodes hold different numbers of ranks";
  } else if (per < 2) {
    not_why = "one rank per node";
  } else if (per > size_t(kernels::kMaxNodeRanks)) {
    not_why = std::to_string(per) + " ranks per node, above " + std::to_string(kernels::kMaxNodeRanks);
  } else if (!m.gdr) {
    not_why = "no GPUDirect RDMA ring between the nodes";
  }
  // On unless GRADSYNC_GPU_HIERARCHICAL=0 (or GRADSYNC_GPU_STAGED) on some rank: agreed, as
  // every rank must run the same steps.
  int32_t on = 1;
  if (const char* h = std::getenv("GRADSYNC_GPU_HIERARCHICAL"); h != nullptr && std::strcmp(h, "0") == 0) on = 0;
  if (std::getenv("GRADSYNC_GPU_STAGED") != nullptr) on = 0;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&on, &on, 1, DataType::kInt32, ReduceOp::kMin));
  if (not_why.empty() && on == 0) not_why = "off (GRADSYNC_GPU_HIERARCHICAL=0 or GRADSYNC_GPU_STAGED on some rank)";
  if (!not_why.empty()) {
    m.why += "; not hierarchical: " + not_why;
    return Status::Ok();
  }

  const std::vector<int>* mine = nullptr;
  for (const auto& n : nodes) {
    if (std::find(n.begin(), n.end(), cfg_.rank) != n.end()) mine = &n;
  }
  const size_t local = size_t(std::find(mine->begin(), mine->end(), cfg_.rank) - mine->begin());
  // The rail's ring first, then the IPC region in what GRADSYNC_GPU_MEMORY_MAX leaves.
  GdrConfig g = gdr_config();
  for (const auto& n : nodes) g.members.push_back(n[local]);
  // Over GRADSYNC_GPU_MEMORY_MAX: the ring's set-up still runs (collective) and fails here.
  std::string why, over = slots_over_budget(g);
  if (!over.empty()) g.link.refuse = over;
  auto ring = GdrChannels::create(g, ops_, &why);
  if (!ring.ok()) return Status(ring.status().code(), who() + ": " + ring.status().message());
  if (!*ring) {
    m.why += "; not hierarchical: the rails' rings: " + (over.empty() ? why : over);
    return Status::Ok();
  }
  m.rail = std::move(ring).value();
  bool ipc = false;
  if (Status s = setup_ipc(*mine, &ipc); !s.ok() || !ipc) {
    m.rail->quiesce();
    m.rail.reset();
    if (!s.ok()) return s;
    m.why += "; not hierarchical: " + (m.ipc_why.empty() ? "no CUDA IPC between the GPUs of a node" : m.ipc_why);
    return Status::Ok();
  }
  m.path = Impl::Path::kHierarchical;
  std::string members;
  for (int r : g.members) members += (members.empty() ? "" : ", ") + std::to_string(r);
  m.why = std::to_string(nodes.size()) + " nodes x " + std::to_string(per) +
          " GPUs: allreduce from " + std::to_string(m.gdr_min_bytes) +
          " bytes hierarchical: inside the node CUDA IPC kernels (reduce_scatter, all_gather), between the nodes rail " +
          std::to_string(local) + " (ranks " + members + ") over " + m.rail->describe() +
          "; other collectives and smaller allreduces: " + m.gdr->describe() + " or host-staged "
          "(GRADSYNC_GPU_HIERARCHICAL=0 turns it off)";
  log::get("gpu")->info("{}: {}", who(), m.why);
  return Status::Ok();
#else
  return Status::Ok();
#endif
}

Status DeviceComm::run_hierarchical(const CollectiveCall& c, cudaStream_t stream) {
#if GRADSYNC_HAVE_GDR
  Impl& m = *impl_;
  const size_t L = m.group.size();
  const size_t es = element_size(c.type);
  const ReduceOp inner = c.op == ReduceOp::kAvg ? ReduceOp::kSum : c.op;
  const size_t shard = c.count / L, head = shard * L, tail = c.count - head;
  const auto* send = static_cast<const uint8_t*>(c.send);
  auto* recv = static_cast<uint8_t*>(c.recv);
  auto node = [&](kernels::NodeCollective kind, const void* in, void* out, size_t count) -> Status {
    const kernels::NodeCall nc{kind, c.type, inner, 0, in, out, count};
    GS_CUDA(kernels::launch_node_collective(m.layout, m.args, nc, stream), "launching a node kernel (hierarchical)");
    return Status::Ok();
  };
  auto rail = [&](uint8_t* at, size_t count) -> Status {
    CollectiveCall r = c;
    r.kind = CollectiveKind::kAllreduce;
    r.send = at;
    r.recv = at;
    r.count = count;
    r.root = 0;
    return m.rail->enqueue(r, stream, cfg_.world_size);
  };
  if (shard > 0) {
    // The host API's in-place layouts: shard l of the buffer is local rank l's segment.
    uint8_t* own = recv + size_t(m.args.me) * shard * es;
    GS_RETURN_IF_ERROR(node(kernels::NodeCollective::kReduceScatter, send, own, shard));
    GS_RETURN_IF_ERROR(rail(own, shard));
    GS_RETURN_IF_ERROR(node(kernels::NodeCollective::kAllGather, own, recv, shard));
  }
  if (tail > 0) {
    GS_RETURN_IF_ERROR(node(kernels::NodeCollective::kAllreduce, send + head * es, recv + head * es, tail));
    GS_RETURN_IF_ERROR(rail(recv + head * es, tail));
  }
  return Status::Ok();
#else
  (void)c;
  (void)stream;
  return Status(Code::kInternal, who() + ": built without GPUDirect RDMA");
#endif
}

}  // namespace gradsync
