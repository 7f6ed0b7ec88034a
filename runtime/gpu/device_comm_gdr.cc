// The step channels of the GPU communicator's set-up (gpu/device_comm.h, gpu/gdr_channels.h):
// across nodes the flat ring and trees of every rank over the daemons' RDMA devices, and the
// threshold below which calls stay host-staged, measured at set-up when GRADSYNC_GDR_MIN_BYTES
// does not give it; on one node the same channels with every hop by CUDA IPC.
#include <algorithm>
#include <cstring>
#include <map>

#include "common/log.h"
#include "gpu/device_comm.h"
#include "gpu/device_comm_impl.h"
#if GRADSYNC_HAVE_GDR
#include "kernels/cuda_step.cuh"
#include "topology/gpudirect.h"
#endif

namespace gradsync {

using namespace device_comm_detail;

#if GRADSYNC_HAVE_GDR
// GPUDirect RDMA channels (a ring and two trees) of every rank, on this rank's RDMA device,
// with the slots of GRADSYNC_GDR_SLOT_BYTES and GRADSYNC_GDR_SLOTS.
GdrConfig DeviceComm::gdr_config() const {
  Impl& m = *impl_;
  GdrConfig g;
  g.device = cfg_.device;
  {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, cfg_.device) != cudaSuccess) {
      (void)cudaGetLastError();
      sms = 1;
    }
    // GRADSYNC_GPU_STEP_BLOCKS sets the cap (to compare; at most kStepMaxBlocks), and
    // GRADSYNC_GPU_STEP_BLOCK_BYTES the bulk bytes per block.
    const int cap = int(std::min<long>(env_positive("GRADSYNC_GPU_STEP_BLOCKS", kernels::kStepDefaultBlocks),
                                       kernels::kStepMaxBlocks));
    g.max_blocks = unsigned(std::clamp(sms / std::max(1, m.gpu_shares), 1, cap));
    g.block_bytes = uint32_t(std::clamp<long>(
        env_positive("GRADSYNC_GPU_STEP_BLOCK_BYTES", kernels::kStepDefaultBlockBytes), 4096, 1L << 24));
  }
  GdrLinkConfig& l = g.link;
  l.who = who();
  l.rank = cfg_.rank;
  l.world_size = cfg_.world_size;
  l.hosts = cfg_.hosts;
  if (cfg_.rank_nodes.size() == size_t(cfg_.world_size)) g.nodes = cfg_.rank_nodes;
  l.verbs_device = cfg_.verbs_device;
  l.verbs_port = cfg_.verbs_port;
  l.gid_index = cfg_.gid_index;
  l.verbs_api = cfg_.verbs_api;
  l.slot_bytes = size_t(env_positive("GRADSYNC_GDR_SLOT_BYTES", 1 << 20)) / 256 * 256;
  // Ranks of several processes on one GPU (tests and benches; NCCL refuses the shape) take
  // turns on it, a time slice each: a rank runs ahead of a peer that is not running by its
  // window of slots (one-shot and two-shot send a window of chunks before they receive them,
  // plan::PlanRequest::window), so they get 64 where 4 keep a GPU of its own busy.
  l.slots = uint32_t(std::max(2L, env_positive("GRADSYNC_GDR_SLOTS", m.most_gpu_shares > 1 ? 64 : 4)));
  // GRADSYNC_PROTO=ll|bulk forces a protocol on the step channels (agreed at their set-up);
  // unset or auto: the cost model's per call.
  if (const char* p = std::getenv("GRADSYNC_PROTO"); p != nullptr && *p != '\0' && std::strcmp(p, "auto") != 0) {
    if (std::strcmp(p, "ll") == 0 || std::strcmp(p, "LL") == 0) {
      g.protocol = plan::Protocol::kLowLatency;
    } else if (std::strcmp(p, "bulk") == 0 || std::strcmp(p, "simple") == 0) {
      g.protocol = plan::Protocol::kBulk;
    } else {
      log::get("gpu")->warn("{}: GRADSYNC_PROTO={} is none of ll, bulk, auto; GPU calls choose for themselves",
                            who(), p);
    }
  }
  // Low-latency slots beside each direct peer's receive slots and each RDMA peer's send and
  // receive slots (none where bulk is forced; TCP peers have none):
  // up to 64 KiB of payload a message, as lines of twice its bytes.
  l.ll_bytes = g.protocol == plan::Protocol::kBulk ? 0 : std::min<size_t>(l.slot_bytes, size_t(128) << 10) / 16 * 16;
  // The RDMA peers' only where GRADSYNC_PROTO=ll forces the protocol (the model keeps the hops
  // between nodes bulk).
  l.ll_queue_pairs = g.protocol == plan::Protocol::kLowLatency;
  l.op_timeout = cfg_.op_timeout;
  // The hops inside a node by CUDA IPC unless GRADSYNC_GDR_DIRECT=0 (then through the NIC).
  const char* direct = std::getenv("GRADSYNC_GDR_DIRECT");
  g.direct = direct == nullptr || std::strcmp(direct, "0") != 0;
  g.abort_dev = &m.words_dev->abort;
  g.error_dev = &m.words_dev->error;
  g.abort_host = &m.words->abort;
  return g;
}

// Non-empty when the channels of `g`'s slots (GPU memory) would take this communicator past
// GRADSYNC_GPU_MEMORY_MAX with what it holds already (memory()): why.
std::string DeviceComm::slots_over_budget(const GdrConfig& g) const {
  const uint64_t slots = GdrChannels::slot_region_bytes(g), limit = gpu_memory_budget();
  if (memory().gpu_bytes + slots <= limit) return {};
  return "its slots (" + std::to_string(slots) + " bytes: " + std::to_string(g.link.slots) + " x " +
         std::to_string(g.link.slot_bytes) + " bytes per peer and direction, and " + std::to_string(g.link.slots) +
         " x " + std::to_string(g.link.ll_bytes) + " low-latency bytes per peer and direction) with the " +
         std::to_string(memory().gpu_bytes >> 20) + " MiB held do not fit GRADSYNC_GPU_MEMORY_MAX = " +
         std::to_string(limit >> 20) + " MiB";
}

// Collective: the window of ranks that share a GPU (gdr_config's 64 slots) halved, down to 4,
// until the slots (with each node's pairs where `pairs`) fit GRADSYNC_GPU_MEMORY_MAX; then
// agreed, the fewest of any rank. GRADSYNC_GDR_SLOTS keeps its count.
Status DeviceComm::fit_slots(GdrConfig& g, bool pairs) const {
  const bool had = g.pairs;
  g.pairs = pairs;
  while (std::getenv("GRADSYNC_GDR_SLOTS") == nullptr && g.link.slots > 4 && !slots_over_budget(g).empty())
    g.link.slots /= 2;
  g.pairs = had;
  int64_t slots = g.link.slots;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&slots, &slots, 1, DataType::kInt64, ReduceOp::kMin));
  g.link.slots = uint32_t(slots);
  return Status::Ok();
}
#endif

#if GRADSYNC_HAVE_GDR
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

// Collective over the whole world (setup_gdr): sets g.pairs when the step channels also get
// the hierarchical channels, and otherwise *why_not. Every input is the same on every rank
// but the memory budget and GRADSYNC_GPU_HIERARCHICAL, whose outcome is agreed.
Status DeviceComm::plan_hierarchical(GdrConfig& g, std::string* why_not) const {
  const std::vector<std::vector<int>> nodes = nodes_of(cfg_);
  const size_t per = nodes.empty() ? 0 : nodes[0].size();
  std::string why;
  if (nodes.size() < 2) {
    why = nodes.empty() ? "the nodes of the ranks are not known" : "one node";
  } else if (!std::all_of(nodes.begin(), nodes.end(), [&](const auto& n) { return n.size() == per; })) {
    why = "the nodes hold different numbers of ranks";
  } else if (per < 2) {
    why = "one rank per node";
  } else if (per > size_t(plan::kMaxPeers) + 1) {
    why = std::to_string(per) + " ranks per node, above " + std::to_string(plan::kMaxPeers + 1);
  } else if (!g.direct) {
    why = "GRADSYNC_GDR_DIRECT=0 (the pairs inside a node need CUDA IPC)";
  }
  const char* h = std::getenv("GRADSYNC_GPU_HIERARCHICAL");
  const bool off = h != nullptr && std::strcmp(h, "0") == 0;
  if (why.empty() && off) why = "GRADSYNC_GPU_HIERARCHICAL=0";
  if (why.empty()) {
    g.pairs = true;
    if (std::string over = slots_over_budget(g); !over.empty()) why = "with the pairs of each node " + over;
    g.pairs = false;
  }
  // Agreed: one rank without them (off, over its budget) leaves them out on every rank.
  int32_t want = why.empty() ? 1 : 0;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&want, &want, 1, DataType::kInt32, ReduceOp::kMin));
  if (want == 0 && why.empty()) why = "some rank left them out (GRADSYNC_GPU_HIERARCHICAL=0 or its memory budget)";
  g.pairs = want != 0;
  *why_not = g.pairs ? std::string() : why;
  return Status::Ok();
}
#endif

// GPUDirect RDMA between the nodes, where every rank's daemon has an RDMA device and every
// rank can register GPU memory with it (gpu/gdr_channels.h); else the host-staged path alone.
// Collective: every rank of a multi-node communicator calls it.
Status DeviceComm::setup_gdr() {
  Impl& m = *impl_;
#if GRADSYNC_HAVE_GDR
  auto log = log::get("gpu");
  // GRADSYNC_GDR_MIN_BYTES checked now (a typo fails the join); measured below when unset.
  const char* min_env = std::getenv("GRADSYNC_GDR_MIN_BYTES");
  const bool measure = min_env == nullptr || *min_env == '\0';
  auto min_bytes = topology::gdr_min_bytes_from_env(0);
  if (!min_bytes.ok()) return Status(min_bytes.status().code(), who() + ": " + min_bytes.status().message());
  m.gdr_min_bytes = *min_bytes;
  // On unless GRADSYNC_GDR=0 (or GRADSYNC_GPU_STAGED) says otherwise.
  const char* on = std::getenv("GRADSYNC_GDR");
  const bool asked = on == nullptr || std::strcmp(on, "0") != 0;
  const char* staged_env = std::getenv("GRADSYNC_GPU_STAGED");
  const bool steps = staged_env != nullptr && std::strcmp(staged_env, "steps") == 0;
  const bool staged = staged_env != nullptr && !steps;
  // Where some node's daemon runs no verbs, the step channels with every hop between nodes
  // over TCP (the link's worker moving the slots) rather than the host-staged schedule: 3-5.7x
  // faster from 64 KiB on the H200, ranks as threads of one process (docs/benchmarks.md);
  // GRADSYNC_GPU_STAGED=1 keeps the host-staged schedule. Agreed: every rank wants it (on
  // several nodes), some rank has no RDMA device; then every rank takes TCP, with or without
  // a device.
  int32_t want_tcp = !staged && cfg_.local_world_size != cfg_.world_size ? 1 : 0;
  int32_t no_verbs = cfg_.verbs_device.empty() ? 1 : 0;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&want_tcp, &want_tcp, 1, DataType::kInt32, ReduceOp::kMin));
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&no_verbs, &no_verbs, 1, DataType::kInt32, ReduceOp::kMax));
  const bool tcp = want_tcp != 0 && no_verbs != 0;
  std::string off = !asked ? "GRADSYNC_GDR=0 is set" : staged ? "GRADSYNC_GPU_STAGED is set" : "";
  GdrConfig g = gdr_config();
  if (g.link.slot_bytes == 0) return {Code::kInvalidArgument, who() + ": GRADSYNC_GDR_SLOT_BYTES below 256"};
  GS_RETURN_IF_ERROR(fit_slots(g, cfg_.local_world_size != cfg_.world_size));
  if (tcp) {
    g.tcp = g.link.tcp = true;
    g.link.verbs_device.clear();
    g.link.tcp_address = cfg_.data_address;
    g.link.tcp_token = cfg_.token;
  }
  // The hierarchical channels beside the ring and trees: every pair of each node and a ring
  // per local index across the nodes (RdmaChannels::hier), for allreduce where the cost
  // model predicts them faster or GRADSYNC_ALGO=hierarchical forces them.
  std::string no_hier;
  GS_RETURN_IF_ERROR(plan_hierarchical(g, &no_hier));
  if (off.empty()) off = slots_over_budget(g);
  // Still collective when this rank does not want it: the others may. It takes part and
  // fails locally, and then every rank keeps the host-staged path.
  if (!off.empty()) g.link.refuse = off;
  std::string why;
  auto ring = GdrChannels::create(g, ops_, &why);
  if (!ring.ok()) return Status(ring.status().code(), who() + ": " + ring.status().message());
  m.gdr = std::move(ring).value();
  if (m.gdr) {
    if (measure) GS_RETURN_IF_ERROR(measure_gdr_min_bytes());
    m.why = m.gdr->describe() + "; calls of " + std::to_string(m.gdr_min_bytes) +
            " bytes and more per segment take it, smaller ones host-staged (GRADSYNC_GDR_MIN_BYTES)";
    if (!m.gdr->hierarchical()) m.why += "; not hierarchical: " + (no_hier.empty() ? "not planned" : no_hier);
    log->info("{}: {}", who(), m.why);
  } else {
    const std::string& no = off.empty() ? why : off;
    const char* what = tcp ? "no TCP steps" : "no GPUDirect RDMA";
    m.why += std::string("; ") + what + ": " + no;
    log->info("{}: {}: {}; GPU collectives are host-staged", who(), what, no);
  }
#else
  (void)m;  // built without the verbs headers: host-staged only
#endif
  return Status::Ok();
}

// One node: the planner's ring and trees with every hop a direct peer (CUDA IPC, no NIC),
// for the calls that ask for ring or tree (CallOptions::algorithm, GRADSYNC_ALGO); the
// kernels' one-shot and two-shot stay the default (with GRADSYNC_GPU_NODE_STEPS=1 on every rank
// the channels also get every pair of the node, and every call runs on them instead of the
// kernels: forced oneshot and twoshot as the planner's steps, unforced ones as the channels'
// cost model chooses among ring, trees, one-shot and two-shot). Collective: every rank of a one-node
// communicator calls it after setup_ipc. Left out on every rank, with the reason in the path's
// why, over GRADSYNC_GPU_MEMORY_MAX or where a rank cannot map its neighbours' memory; calls
// that ask for ring or tree then take the kernels.
Status DeviceComm::setup_node_steps() {
  Impl& m = *impl_;
#if GRADSYNC_HAVE_GDR
  GdrConfig g = gdr_config();
  if (g.link.slot_bytes == 0) return {Code::kInvalidArgument, who() + ": GRADSYNC_GDR_SLOT_BYTES below 256"};
  g.link.verbs_device.clear();  // no hop leaves the node: without CUDA IPC there is no channel
  // GRADSYNC_GPU_NODE_STEPS=1 (on every rank: agreed): the direct pairs too, for one-shot and
  // two-shot as steps (a slot region per other rank of the node).
  const char* steps_env = std::getenv("GRADSYNC_GPU_NODE_STEPS");
  int32_t pairs = steps_env != nullptr && std::strcmp(steps_env, "1") == 0 ? 1 : 0;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&pairs, &pairs, 1, DataType::kInt32, ReduceOp::kMin));
  g.pairs = pairs != 0;
  GS_RETURN_IF_ERROR(fit_slots(g, g.pairs));
  std::string off = !g.direct ? "GRADSYNC_GDR_DIRECT=0 is set (one node's hops have no NIC to take)"
                              : slots_over_budget(g);
  if (!off.empty()) g.link.refuse = off;
  std::string why;
  auto ch = GdrChannels::create(g, ops_, &why);
  if (!ch.ok()) return Status(ch.status().code(), who() + ": " + ch.status().message());
  m.gdr = std::move(ch).value();
  m.node_pair_steps = g.pairs && m.gdr != nullptr;
  const char* which = g.pairs ? "ring, tree, oneshot and twoshot" : "ring and tree";
  if (m.gdr) {
    m.why += std::string("; ") + which + " when a call asks for them: " + m.gdr->describe();
    if (g.pairs) m.why += " (GRADSYNC_GPU_NODE_STEPS=1: every call on these steps, not the node kernels)";
  } else {
    m.why += std::string("; ") + which + " calls take the kernels (no step channels: " + (off.empty() ? why : off) + ")";
    log::get("gpu")->info("{}: no {} steps on this node: {}", who(), which, off.empty() ? why : off);
  }
  if (g.pairs) {
    log::get("gpu")->info("{}: GRADSYNC_GPU_NODE_STEPS=1: every call takes {}", who(),
                          m.node_pair_steps ? "the step runner over every pair" : "the node kernels (no step channels)");
  }
#else
  (void)m;  // built without the verbs headers: the kernels alone
#endif
  return Status::Ok();
}

#if GRADSYNC_HAVE_GDR
// The small-message threshold (design §3 rule 4), measured once at set-up on every rank in
// the same order: per size from 256 bytes, the best of three float32 sum allreduces on the step
// channels, as an unforced call takes them (the cost model's ring or trees, or GRADSYNC_ALGO's
// ring or tree), against the host-staged path's work for a one-piece call (copy to pinned
// memory, the host allreduce, copy back). Every rank takes the slowest rank's times, so all
// pick one threshold (topology::gdr_min_bytes_from_times): 0 where the steps are no slower even
// at 256 bytes, and then no call is host-staged.
Status DeviceComm::measure_gdr_min_bytes() {
  Impl& m = *impl_;
  std::vector<size_t> sizes;
  for (size_t b = 256; b <= (size_t(1) << 20) && b <= m.slot_bytes; b *= 4) sizes.push_back(b);
  const std::optional<plan::Algo> forced = plan::forced_algo(Algorithm::kAuto, m.env_algo);
  const Algorithm algo = forced == plan::Algo::kTree ? Algorithm::kTree
                         : forced == plan::Algo::kRing ? Algorithm::kRing
                                                       : Algorithm::kAuto;
  if (sizes.empty()) return Status::Ok();
  const size_t n = sizes.size(), biggest = sizes.back();
  void* dev = nullptr;
  cudaStream_t st = nullptr;
  GS_CUDA(cudaMalloc(&dev, biggest), "cudaMalloc (GPUDirect threshold)");
  Status s = Status::Ok();
  auto fail = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess && s.ok()) s = {Code::kInternal, who() + ": " + what + ": " + cudaGetErrorString(e)};
  };
  fail(cudaMemset(dev, 0, biggest), "cudaMemset");
  fail(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<double> us(2 * n, 1e30);  // GPUDirect, then host-staged
  for (size_t i = 0; i < n && s.ok(); ++i) {
    const size_t bytes = sizes[i], count = bytes / 4;
    const CollectiveCall c{CollectiveKind::kAllreduce, dev, dev, count, DataType::kFloat32, ReduceOp::kSum, 0,
                           algo, 0};
    for (int rep = 0; rep < 3 && s.ok(); ++rep) {
      auto t0 = Clock::now();
      s = m.gdr->enqueue(c, st);
      fail(cudaStreamSynchronize(st), "cudaStreamSynchronize");
      us[i] = std::min(us[i], std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (s.ok()) s = async_error();
      if (!s.ok()) break;
      t0 = Clock::now();
      fail(cudaMemcpyAsync(m.staging, dev, bytes, cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync");
      fail(cudaStreamSynchronize(st), "cudaStreamSynchronize");
      if (s.ok()) s = ops_.allreduce_now(m.staging, m.staging, count, DataType::kFloat32, ReduceOp::kSum);
      fail(cudaMemcpyAsync(dev, m.staging, bytes, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync");
      fail(cudaStreamSynchronize(st), "cudaStreamSynchronize");
      us[n + i] = std::min(us[n + i], std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  if (st) (void)cudaStreamDestroy(st);
  (void)cudaFree(dev);
  if (!s.ok()) return Status(s.code(), who() + ": measuring GRADSYNC_GDR_MIN_BYTES: " + s.message());
  GS_RETURN_IF_ERROR(ops_.allreduce_now(us.data(), us.data(), us.size(), DataType::kFloat64, ReduceOp::kMax));
  m.gdr_min_bytes = topology::gdr_min_bytes_from_times(sizes, std::vector<double>(us.begin(), us.begin() + n),
                                                       std::vector<double>(us.begin() + n, us.end()));
  std::string table;
  for (size_t i = 0; i < n; ++i) {
    table += (i ? ", " : "") + std::to_string(sizes[i]) + " B " + std::to_string(int(us[i])) + "/" +
             std::to_string(int(us[n + i])) + " us";
  }
  log::get("gpu")->info("{}: GRADSYNC_GDR_MIN_BYTES measured: {} bytes ({}/host-staged, slowest rank: {})", who(),
                        m.gdr_min_bytes, m.gdr->tcp() ? "TCP steps" : "GPUDirect", table);
  return Status::Ok();
}
#endif

}  // namespace gradsync
