#include "gpu/plan/cost_model.h"

#include <algorithm>
#include <string_view>

#include "gpu/plan/executor.h"

namespace gradsync::plan {
namespace {

using Kind = CollectiveKind;

// Tree depth of channel 0: the most hops inside nodes and between nodes on a way to the root.
void tree_depth(const JobShape& shape, const Channel& ch, int* intra, int* inter) {
  std::vector<int> node(size_t(shape.world_size()));
  for (size_t x = 0; x < shape.nodes.size(); ++x)
    for (int r : shape.nodes[x].ranks) node[size_t(r)] = int(x);
  *intra = *inter = 0;
  for (int r = 0; r < shape.world_size(); ++r) {
    int a = 0, b = 0;
    for (int q = r; ch.links[size_t(q)].parent >= 0; q = ch.links[size_t(q)].parent) {
      const int p = ch.links[size_t(q)].parent;
      (node[size_t(p)] == node[size_t(q)] ? a : b)++;
    }
    *intra = std::max(*intra, a);
    *inter = std::max(*inter, b);
  }
}

}  // namespace

// Nodes whose ranks carry the most bytes. Rings and direct pushes treat every node alike:
// node 0. Trees differ per node (root, interior, leaf): every node up to 64, else the first
// four (interior with two child nodes in one tree and a leaf in the other among them), the
// middle and the last ones.
std::vector<int> sample_nodes(const JobShape& shape, Algo algo) {
  const int k = shape.node_count();
  std::vector<int> nodes;
  if (algo != Algo::kTree || k <= 64) {
    for (int x = 0; x < (algo == Algo::kTree ? k : 1); ++x) nodes.push_back(x);
    return nodes;
  }
  for (int x : {0, 1, 2, 3, k / 2 - 1, k / 2, k / 2 + 1, k - 2, k - 1}) nodes.push_back(x);
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  return nodes;
}

const char* to_string(Protocol p) { return p == Protocol::kLowLatency ? "LL" : "bulk"; }

ScheduleFigures schedule_hops(const JobShape& shape, const PlanRequest& req, const ChannelSet& channels) {
  ScheduleFigures f;
  const int n = shape.world_size(), k = shape.node_count();
  const Algo algo = effective_algo(req.kind, req.algo);
  const bool allreduce = req.kind == Kind::kAllreduce;
  switch (algo) {
    case Algo::kRing: {
      const int steps = allreduce ? 2 * (n - 1) : n - 1;
      f.inter_hops = k == 1 ? 0 : allreduce ? 2 * (k - 1) : k - 1;
      f.intra_hops = steps - f.inter_hops;
      break;
    }
    case Algo::kTree:
      if (channels.size() > 0 && n > 1) tree_depth(shape, channels[0], &f.intra_hops, &f.inter_hops);
      if (allreduce) f.intra_hops *= 2, f.inter_hops *= 2;
      break;
    case Algo::kOneShot: f.intra_hops = 1; break;
    case Algo::kTwoShot:
      f.intra_hops = allreduce || req.kind == Kind::kBroadcast ? 2 : 1;
      break;
    case Algo::kHierarchical:
      f.intra_hops = shape.nodes[0].ranks.size() > 1 ? 2 : 0;
      f.inter_hops = 2 * (k - 1);
      break;
  }
  return f;
}

ScheduleFigures schedule_figures(const JobShape& shape, const PlanRequest& req) {
  const Algo algo = effective_algo(req.kind, req.algo);
  const ChannelSet channels = plan_channels(shape, req);
  ScheduleFigures f = schedule_hops(shape, req, channels);
  LinkBytes bytes(shape);
  std::vector<int> ranks;
  for (int x : sample_nodes(shape, algo))
    for (int r : shape.nodes[size_t(x)].ranks) {
      count_bytes(shape, channels, r, rank_steps(shape, channels, req, r), req.esize, &bytes);
      ranks.push_back(r);
    }
  for (int r : ranks)
    f.max_intra_bytes = std::max({f.max_intra_bytes, bytes.intra_sent[size_t(r)], bytes.intra_recv[size_t(r)]});
  f.max_nic_bytes = bytes.max_nic();
  return f;
}

double predict_us(const LinkFigures& links, const ScheduleFigures& fig, Algo algo, Protocol proto,
                  const CostParams& params) {
  const bool ll = proto == Protocol::kLowLatency;
  double eff = ll ? params.ll_efficiency : 1.0;
  if (algo == Algo::kTree) eff *= params.tree_efficiency;
  const double lat = params.base_us[int(algo)][int(proto)] +
                     fig.intra_hops * (ll ? links.intra_lat.ll_us : links.intra_lat.bulk_us) +
                     fig.inter_hops * (ll ? links.nic_lat.ll_us : links.nic_lat.bulk_us);
  // GB/s = 1e3 bytes per microsecond.
  const double intra = double(fig.max_intra_bytes) / (links.intra_gbps * eff * 1e3);
  const double nic = double(fig.max_nic_bytes) / (links.nic_gbps * eff * 1e3);
  return lat + std::max(intra, nic);
}

std::vector<Algo> candidates(const JobShape& shape, CollectiveKind kind) {
  const int n = shape.world_size();
  std::vector<Algo> out = {Algo::kRing};
  if (n < 2) return out;
  if (kind == Kind::kAllreduce || kind == Kind::kBroadcast) out.push_back(Algo::kTree);
  if (shape.node_count() == 1 && n - 1 <= kMaxPeers) {
    out.push_back(Algo::kOneShot);
    if (kind == Kind::kAllreduce || kind == Kind::kBroadcast) out.push_back(Algo::kTwoShot);
  }
  PlanRequest hier;
  hier.algo = Algo::kHierarchical;
  if (kind == Kind::kAllreduce && check_request(shape, hier).empty()) out.push_back(Algo::kHierarchical);
  return out;
}

Choice choose(const JobShape& shape, CollectiveKind kind, size_t count, size_t esize, int root,
              std::optional<Algo> forced, const CostParams& params) {
  Choice c;
  std::vector<Algo> algos = candidates(shape, kind);
  if (forced) {
    const Algo want = effective_algo(kind, *forced);
    if (std::find(algos.begin(), algos.end(), want) != algos.end()) {
      algos = {want};
      c.forced = std::string("forced to ") + to_string(want);
    } else {
      c.forced = std::string(to_string(*forced)) + " was asked for, but " + to_string(kind) + " on " +
                 std::to_string(shape.node_count()) + " node(s) of " + std::to_string(shape.world_size()) +
                 " ranks cannot run it: the model chose";
    }
  }
  bool first = true;
  for (Algo a : algos) {
    PlanRequest req;
    req.kind = kind;
    req.algo = a;
    req.count = count;
    req.esize = esize;
    req.root = root;
    const ScheduleFigures fig = schedule_figures(shape, req);
    for (Protocol p : {Protocol::kLowLatency, Protocol::kBulk}) {
      Estimate e{a, p, predict_us(shape.links, fig, a, p, params), fig};
      c.all.push_back(e);
      if (first || e.us < c.best.us) c.best = e, first = false;
    }
  }
  return c;
}

std::optional<Algo> algo_from_env(const char* value, std::string* error) {
  if (!value || !*value) return std::nullopt;
  const std::string_view v = value;
  if (v == "auto") return std::nullopt;
  if (v == "ring") return Algo::kRing;
  if (v == "tree") return Algo::kTree;
  if (v == "oneshot" || v == "one-shot") return Algo::kOneShot;
  if (v == "twoshot" || v == "two-shot") return Algo::kTwoShot;
  if (v == "hierarchical") return Algo::kHierarchical;
  if (error) *error = "GRADSYNC_ALGO=" + std::string(v) + " is not ring, tree, oneshot, twoshot, hierarchical or auto";
  return std::nullopt;
}

std::optional<Algo> forced_algo(Algorithm call, std::optional<Algo> env) {
  if (call == Algorithm::kRing) return Algo::kRing;
  if (call == Algorithm::kTree) return Algo::kTree;
  return env;
}

}  // namespace gradsync::plan
