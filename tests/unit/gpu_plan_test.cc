// The GPU planning layer on the CPU (runtime/gpu/plan): channels over job shapes up to 16 nodes
// x 8 GPUs, every collective's steps run on host buffers by the executor and checked exactly
// against the host fold, and the bytes each rank and NIC moves against the formulas:
//   one node: one-shot (n-1)·S per rank, two-shot 2(n-1)·ceil(S/n) per rank (kernels/cuda_node.cu),
//             ring at most 2(n-1)/n·S·1.05;
//   between nodes, ring: 2(n-1)/n·S per node per direction, spread evenly over its rails:
//             every byte of a ring allreduce crosses each hop 2(n-1)/n times (nccl-tests
//             doc/PERFORMANCE.md: busbw = algbw·2(n-1)/n, shared/reference/multinode_ops.md §1,
//             nccl.md §4), and one hop per node per channel leaves through a NIC;
//   between nodes, tree: each tree edge carries its tree's half of S up and down, so a node
//             sends (parent + child nodes) · S/2 per tree: about 2·S per node, split over the two
//             trees (multinode_ops.md §1: on 2 nodes half the ring's network traffic, nccl#946).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>

#include "gpu/plan/executor.h"
#include "kernels/host_reduce.h"

namespace gradsync::plan {
namespace {

using Kind = CollectiveKind;

struct ShapeCase {
  int nodes, gpus, nics;
};
const ShapeCase kShapes[] = {{1, 2, 2}, {1, 3, 1}, {1, 4, 4}, {1, 8, 8}, {2, 1, 1}, {2, 2, 2},
                             {2, 4, 4}, {3, 2, 2}, {4, 1, 1}, {5, 3, 2}, {4, 8, 8}, {16, 8, 8}};

std::string shape_name(const ShapeCase& s) { return std::to_string(s.nodes) + "x" + std::to_string(s.gpus); }

// ---------------------------------------------------------------------------------------------
// Channels

TEST(GpuPlanChannels, BinaryTreeOverPositions) {
  for (int n = 1; n <= 1100; ++n) {
    std::vector<int> kids(size_t(n), 0);
    for (int p = 1; p < n; ++p) {
      const int up = btree_parent(p, n);
      ASSERT_GE(up, 0) << p << " of " << n;
      ASSERT_LT(up, n);
      kids[size_t(up)]++;
      // Depth bounded by log2: walking up ends at 0.
      int q = p, depth = 0;
      while (q != 0 && depth <= 12) q = btree_parent(q, n), ++depth;
      ASSERT_EQ(q, 0) << p << " of " << n;
    }
    ASSERT_EQ(btree_parent(0, n), -1);
    for (int p = 0; p < n; ++p) {
      ASSERT_LE(kids[size_t(p)], p == 0 ? 1 : 2) << p << " of " << n;
      if (p % 2 == 1) {
        ASSERT_EQ(kids[size_t(p)], 0) << "odd position " << p << " of " << n << " is not a leaf";
      }
    }
  }
}

TEST(GpuPlanChannels, RingsAreNodeContiguousAndSpreadOverRails) {
  for (const auto& sc : kShapes) {
    SCOPED_TRACE(shape_name(sc));
    JobShape shape = uniform_shape(sc.nodes, sc.gpus, sc.nics);
    const int C = default_ring_channels(shape);
    EXPECT_EQ(C, sc.nics);
    ChannelSet set = ring_channels(shape, C);
    std::vector<std::vector<int>> rail_use(size_t(sc.nodes), std::vector<int>(size_t(sc.nics), 0));
    for (int c = 0; c < C; ++c) {
      const auto& ch = set[c];
      std::set<int> ranks(ch.order.begin(), ch.order.end());
      ASSERT_EQ(int(ranks.size()), shape.world_size());
      ASSERT_EQ(int(ch.order.size()), shape.world_size());
      // Node boundaries: exactly one per node (none for a single node).
      int boundaries = 0;
      for (const Hop& h : ch.hops) {
        if (!h.inter_node) {
          EXPECT_EQ(shape.node_of(h.src), shape.node_of(h.dst));
          EXPECT_EQ(h.transport, Transport::kPeerIpc);
          continue;
        }
        ++boundaries;
        const int node = shape.node_of(h.src);
        EXPECT_EQ(h.nic, c % sc.nics) << "channel " << c << " leaves node " << node << " off its rail";
        EXPECT_EQ(shape.nodes[size_t(node)].nics[size_t(shape.local_of(h.src))], h.nic)
            << "the exit rank does not own the rail's NIC";
        EXPECT_EQ(h.recv_nic, h.nic);
        EXPECT_EQ(h.transport, Transport::kGpuDirectRdma);
        rail_use[size_t(node)][size_t(h.nic)]++;
      }
      EXPECT_EQ(boundaries, sc.nodes > 1 ? sc.nodes : 0);
    }
    if (sc.nodes > 1) {
      for (const auto& node : rail_use)
        for (int uses : node) EXPECT_EQ(uses, 1) << "each rail carries exactly one of the node's channels";
    }
  }
}

// Counts the nodes with a child node in tree t of channel c.
std::vector<bool> interior_nodes(const JobShape& shape, const Channel& ch) {
  std::vector<bool> interior(size_t(shape.node_count()), false);
  for (int r = 0; r < shape.world_size(); ++r) {
    const TreeLinks& l = ch.links[size_t(r)];
    for (int k = 0; k < l.nchildren; ++k)
      if (shape.node_of(l.children[k]) != shape.node_of(r)) interior[size_t(shape.node_of(r))] = true;
  }
  return interior;
}

TEST(GpuPlanChannels, TreesChainInsideNodesAndDoubleBinaryAcross) {
  for (const auto& sc : kShapes) {
    SCOPED_TRACE(shape_name(sc));
    JobShape shape = uniform_shape(sc.nodes, sc.gpus, sc.nics);
    const int C = default_tree_channels(shape);
    EXPECT_EQ(C % 2, 0);
    ChannelSet set = tree_channels(shape, C);
    for (int c = 0; c < C; ++c) {
      const auto& ch = set[c];
      EXPECT_EQ(ch.tree, c % 2);
      int roots = 0;
      for (int r = 0; r < shape.world_size(); ++r) {
        const TreeLinks& l = ch.links[size_t(r)];
        ASSERT_LE(l.nchildren, 3);
        if (l.parent < 0) ++roots;
        int intra_kids = 0;
        for (int k = 0; k < l.nchildren; ++k) {
          EXPECT_EQ(ch.links[size_t(l.children[k])].parent, r);
          intra_kids += shape.node_of(l.children[k]) == shape.node_of(r);
        }
        EXPECT_LE(intra_kids, 1) << "a chain inside the node";
        if (l.parent >= 0 && shape.node_of(l.parent) != shape.node_of(r)) {
          // A node's head talks to other nodes through its own NIC, on the channel's rail.
          const Hop* up = set.hop(c, r, l.parent);
          ASSERT_NE(up, nullptr);
          EXPECT_EQ(up->nic, (c / 2) % sc.nics);
        }
      }
      EXPECT_EQ(roots, 1);
      // Every rank reaches the root.
      for (int r = 0; r < shape.world_size(); ++r) {
        int q = r, steps = 0;
        while (ch.links[size_t(q)].parent >= 0 && steps <= shape.world_size()) q = ch.links[size_t(q)].parent, ++steps;
        EXPECT_EQ(ch.links[size_t(q)].parent, -1);
        EXPECT_LE(steps, sc.gpus - 1 + 2 * 5) << "chain plus about log2(nodes)";
      }
    }
    // Double binary tree: with an even node count no node is interior in both trees; with an
    // odd one at most one (NCCL's shift).
    if (sc.nodes > 2) {
      auto a = interior_nodes(shape, set[0]), b = interior_nodes(shape, set[1]);
      int both = 0;
      for (int x = 0; x < sc.nodes; ++x) both += a[size_t(x)] && b[size_t(x)];
      EXPECT_LE(both, sc.nodes % 2 == 0 ? 0 : 1);
    }
  }
}

TEST(GpuPlanChannels, TransportsFollowTheNodesCapabilities) {
  JobShape shape = uniform_shape(3, 2, 2);
  EXPECT_EQ(hop_transport(shape, 0, 1), Transport::kPeerIpc);
  EXPECT_EQ(hop_transport(shape, 1, 2), Transport::kGpuDirectRdma);
  shape.nodes[1].caps.gpu_reachable = {true, false};  // rank 3's GPU is too far from its NIC
  EXPECT_EQ(hop_transport(shape, 1, 2), Transport::kGpuDirectRdma);
  EXPECT_EQ(hop_transport(shape, 3, 4), Transport::kRdmaHostMemory);
  EXPECT_EQ(hop_transport(shape, 5, 3), Transport::kRdmaHostMemory);
  shape.nodes[2].caps.verbs = false;  // TCP between daemons
  EXPECT_EQ(hop_transport(shape, 3, 4), Transport::kHostStaged);
  EXPECT_EQ(hop_transport(shape, 0, 2), Transport::kGpuDirectRdma);
  shape.nodes[0].caps.gdr = false;  // GRADSYNC_GDR=0
  EXPECT_EQ(hop_transport(shape, 0, 2), Transport::kHostStaged);
  shape.nodes[0].caps.peer_ipc = false;
  EXPECT_EQ(hop_transport(shape, 0, 1), Transport::kHostStaged);
  JobShape wide = uniform_shape(1, 9, 1);  // more than 8 ranks: no one-node IPC kernels
  EXPECT_EQ(hop_transport(wide, 0, 1), Transport::kHostStaged);
}

TEST(GpuPlanChannels, ShapeValidation) {
  JobShape s = uniform_shape(2, 2, 2);
  EXPECT_EQ(s.validate(), "");
  s.nodes[1].ranks[0] = 0;
  EXPECT_NE(s.validate().find("appears twice"), std::string::npos) << s.validate();
  s = uniform_shape(2, 2, 2);
  s.nodes[0].nics[1] = 5;
  EXPECT_NE(s.validate().find("uses NIC 5"), std::string::npos) << s.validate();
  PlanRequest req;
  req.algo = Algo::kOneShot;
  EXPECT_NE(check_request(uniform_shape(2, 2, 2), req), "");
  EXPECT_EQ(check_request(uniform_shape(1, 8, 8), req), "");
  EXPECT_NE(check_request(uniform_shape(1, 9, 1), req), "");
}

// ---------------------------------------------------------------------------------------------
// Schedules run by the executor

struct TypeOp {
  DataType type;
  ReduceOp op;
};

// Input values whose folds are exact in any order for the type and op (small integers; +-1
// for prod), so that every algorithm must match the rank-order fold bit for bit.
void fill_exact(DataType type, ReduceOp op, int rank, size_t count, std::vector<unsigned char>* buf,
                std::mt19937* rng) {
  const size_t es = element_size(type);
  buf->assign(count * es, 0);
  std::uniform_int_distribution<int> small(-2, 2), sign(0, 1);
  for (size_t i = 0; i < count; ++i) {
    int v = op == ReduceOp::kProd ? (sign(*rng) ? 1 : -1) : small(*rng);
    if (op == ReduceOp::kMax || op == ReduceOp::kMin) v = (v * 37 + rank * 11 + int(i)) % 50;
    float f = float(v);
    unsigned char* p = buf->data() + i * es;
    switch (type) {
      case DataType::kFloat32: std::memcpy(p, &f, 4); break;
      case DataType::kFloat64: { double d = v; std::memcpy(p, &d, 8); break; }
      case DataType::kInt32: { int32_t x = v; std::memcpy(p, &x, 4); break; }
      case DataType::kInt64: { int64_t x = v; std::memcpy(p, &x, 8); break; }
      case DataType::kFloat16:
      case DataType::kBFloat16: {
        // Small integers are exact in both 16-bit types: build the bits directly.
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        uint16_t h;
        if (type == DataType::kBFloat16) {
          h = uint16_t(bits >> 16);
        } else {
          // float16: sign, exponent rebias 127 -> 15, 10-bit mantissa (exact for |v| < 2048).
          const uint16_t sgn = uint16_t((bits >> 16) & 0x8000);
          const int exp = int((bits >> 23) & 0xff);
          h = v == 0 ? 0 : uint16_t(sgn | uint16_t((exp - 127 + 15) << 10) | uint16_t((bits >> 13) & 0x3ff));
        }
        std::memcpy(p, &h, 2);
        break;
      }
      default: { int8_t x = int8_t(v); std::memcpy(p, &x, 1); break; }
    }
  }
}

void fill_random(DataType type, size_t count, std::vector<unsigned char>* buf, std::mt19937* rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  buf->resize(count * 4);
  ASSERT_EQ(type, DataType::kFloat32);
  for (size_t i = 0; i < count; ++i) {
    float f = u(*rng);
    std::memcpy(buf->data() + i * 4, &f, 4);
  }
}

// The host reference: allreduce/reduce_scatter fold the ranks' inputs in rank order with the
// same loops (kAvg divided once at the last fold).
std::vector<unsigned char> rank_order_fold(const std::vector<RankBuffers>& b, DataType type, ReduceOp op,
                                           size_t offset, size_t count) {
  const size_t es = element_size(type);
  const int n = int(b.size());
  std::vector<unsigned char> acc(b[0].in.begin() + long(offset * es), b[0].in.begin() + long((offset + count) * es));
  for (int r = 1; r < n; ++r) {
    const unsigned char* x = b[size_t(r)].in.data() + offset * es;
    if (r == n - 1) kernels::reduce_final(type, op, acc.data(), nullptr, acc.data(), x, count, n);
    else kernels::reduce(type, op, acc.data(), acc.data(), x, count);
  }
  return acc;
}

struct RunResult {
  std::vector<RankBuffers> bufs;
  LinkBytes bytes;
  Status status;
};

RunResult run_case(const JobShape& shape, const PlanRequest& req, DataType type, ReduceOp op, bool exact,
                   uint32_t seed, size_t slots = 2) {
  const int n = shape.world_size();
  const size_t es = element_size(type);
  size_t in_elems = req.count, out_elems = req.count;
  if (req.kind == Kind::kReduceScatter) in_elems = req.count * size_t(n);
  if (req.kind == Kind::kAllGather) out_elems = req.count * size_t(n);
  RunResult res{std::vector<RankBuffers>(size_t(n)), LinkBytes(shape), Status::Ok()};
  std::mt19937 rng(seed);
  for (int r = 0; r < n; ++r) {
    if (exact) fill_exact(type, op, r, in_elems, &res.bufs[size_t(r)].in, &rng);
    else fill_random(type, in_elems, &res.bufs[size_t(r)].in, &rng);
    res.bufs[size_t(r)].out.assign(out_elems * es, 0xEE);
  }
  ChannelSet channels = plan_channels(shape, req);
  std::vector<std::vector<Step>> steps;
  for (int r = 0; r < n; ++r) steps.push_back(rank_steps(shape, channels, req, r));
  ExecOptions opts;
  opts.slots = slots;
  res.status = execute(shape, channels, steps, type, op, opts, &res.bufs, &res.bytes);
  return res;
}

// Every rank's output against the host reference, byte for byte.
void expect_reference(const RunResult& res, const PlanRequest& req, DataType type, ReduceOp op) {
  const int n = int(res.bufs.size());
  const size_t es = element_size(type);
  for (int r = 0; r < n; ++r) {
    std::vector<unsigned char> want;
    switch (req.kind) {
      case Kind::kAllreduce: want = rank_order_fold(res.bufs, type, op, 0, req.count); break;
      case Kind::kReduceScatter: want = rank_order_fold(res.bufs, type, op, size_t(r) * req.count, req.count); break;
      case Kind::kAllGather:
        for (int s = 0; s < n; ++s) want.insert(want.end(), res.bufs[size_t(s)].in.begin(), res.bufs[size_t(s)].in.end());
        break;
      default: want = res.bufs[size_t(req.root)].in; break;
    }
    if (n == 1 && req.kind != Kind::kAllGather) want = res.bufs[0].in;
    ASSERT_EQ(res.bufs[size_t(r)].out.size(), want.size());
    if (std::memcmp(res.bufs[size_t(r)].out.data(), want.data(), want.size()) != 0) {
      size_t i = 0;
      while (res.bufs[size_t(r)].out[i] == want[i]) ++i;
      FAIL() << "rank " << r << " differs from the reference at element " << i / es;
    }
  }
}

TEST(GpuPlanSchedule, EveryShapeCollectiveAndAlgorithmIsExact) {
  const TypeOp kTypeOps[] = {{DataType::kFloat32, ReduceOp::kSum},  {DataType::kBFloat16, ReduceOp::kAvg},
                             {DataType::kInt32, ReduceOp::kMax},    {DataType::kFloat16, ReduceOp::kSum},
                             {DataType::kInt64, ReduceOp::kProd},   {DataType::kFloat64, ReduceOp::kMin}};
  int runs = 0;
  for (const auto& sc : kShapes) {
    const JobShape shape = uniform_shape(sc.nodes, sc.gpus, sc.nics);
    const int n = shape.world_size();
    const bool big = n > 16;
    std::vector<Algo> algos = {Algo::kRing, Algo::kTree};
    if (sc.nodes == 1) algos.insert(algos.end(), {Algo::kOneShot, Algo::kTwoShot});
    else algos.push_back(Algo::kHierarchical);
    for (Kind kind : {Kind::kAllreduce, Kind::kReduceScatter, Kind::kAllGather, Kind::kBroadcast}) {
      for (Algo algo : algos) {
        if (effective_algo(kind, algo) != algo) continue;  // runs as the ring, which is covered
        for (size_t count : big ? std::vector<size_t>{1, 301} : std::vector<size_t>{1, 7, 333, 1001}) {
          int t = 0;
          for (const TypeOp& to : kTypeOps) {
            if (big && t++ != 3) continue;  // 128 ranks: float16 sum only, to keep CI short
            if (kind == Kind::kAllGather || kind == Kind::kBroadcast) {
              if (to.op != ReduceOp::kSum) continue;  // no reduction: one op is enough
            }
            PlanRequest req;
            req.kind = kind;
            req.algo = algo;
            req.count = count;
            req.esize = element_size(to.type);
            req.root = kind == Kind::kBroadcast ? (int(count) * 7 + 3) % n : 0;
            // Many chunks per channel (the pipelining); fewer at 128 ranks, to keep CI short.
            req.chunk_bytes = big ? 400 : 40;
            ASSERT_EQ(check_request(shape, req), "");
            SCOPED_TRACE(shape_name(sc) + " " + to_string(kind) + " " + to_string(algo) + " count " +
                         std::to_string(count) + " " + to_string(to.type) + " " + to_string(to.op) + " root " +
                         std::to_string(req.root));
            RunResult res = run_case(shape, req, to.type, to.op, true, uint32_t(count * 131 + n));
            ASSERT_TRUE(res.status.ok()) << res.status.to_string();
            expect_reference(res, req, to.type, to.op);
            ++runs;
          }
        }
      }
    }
  }
  EXPECT_GT(runs, 500);
}

// Ranks need not be numbered node by node, nor nodes be alike: ranks dealt round-robin over
// three nodes of 3, 1 and 2 GPUs with 2, 1 and 2 NICs.
TEST(GpuPlanSchedule, UnevenShapesWithRanksDealtAcrossNodes) {
  JobShape shape;
  const std::vector<std::vector<int>> ranks = {{0, 3, 5}, {1}, {2, 4}};
  const std::vector<int> nics = {2, 1, 2};
  for (size_t x = 0; x < ranks.size(); ++x) {
    NodeShape node;
    node.name = "n" + std::to_string(x);
    node.ranks = ranks[x];
    node.nic_count = nics[x];
    for (size_t l = 0; l < ranks[x].size(); ++l) {
      node.gpus.push_back(int(l));
      node.nics.push_back(int(l) % nics[x]);
    }
    shape.nodes.push_back(node);
  }
  ASSERT_EQ(shape.validate(), "");
  EXPECT_EQ(default_ring_channels(shape), 1);
  for (Kind kind : {Kind::kAllreduce, Kind::kReduceScatter, Kind::kAllGather, Kind::kBroadcast}) {
    for (Algo algo : {Algo::kRing, Algo::kTree}) {
      for (int channels : {1, 2, 3}) {
        PlanRequest req;
        req.kind = kind;
        req.algo = algo;
        req.count = 517;
        req.chunk_bytes = 48;
        req.root = 4;
        req.channels = channels;
        SCOPED_TRACE(std::string(to_string(kind)) + " " + to_string(algo) + " channels " + std::to_string(channels));
        RunResult res = run_case(shape, req, DataType::kInt32, ReduceOp::kSum, true, 11);
        ASSERT_TRUE(res.status.ok()) << res.status.to_string();
        expect_reference(res, req, DataType::kInt32, ReduceOp::kSum);
        ChannelSet set = plan_channels(shape, req);
        for (int c = 0; c < set.size(); ++c) {
          for (const Hop& h : set[c].hops) {  // every hop's ends are where the shape puts them
            EXPECT_EQ(h.inter_node, shape.node_of(h.src) != shape.node_of(h.dst));
            if (h.inter_node) {
              EXPECT_LT(h.nic, shape.nodes[size_t(shape.node_of(h.src))].nic_count);
              EXPECT_LT(h.recv_nic, shape.nodes[size_t(shape.node_of(h.dst))].nic_count);
            }
          }
        }
      }
    }
  }
}

// Random floats: the fold order matters. One-shot and two-shot fold in rank order, so they
// equal the host fold exactly; ring and tree compute each value once and copy it, so every
// rank holds the same bits.
TEST(GpuPlanSchedule, RandomFloatsAreBitIdenticalOnEveryRank) {
  for (const auto& sc : {ShapeCase{1, 8, 8}, ShapeCase{1, 3, 1}, ShapeCase{2, 4, 4}, ShapeCase{3, 2, 2}}) {
    const JobShape shape = uniform_shape(sc.nodes, sc.gpus, sc.nics);
    std::vector<Algo> algos = {Algo::kRing, Algo::kTree};
    if (sc.nodes == 1) algos.insert(algos.end(), {Algo::kOneShot, Algo::kTwoShot});
    else algos.push_back(Algo::kHierarchical);
    for (Algo algo : algos) {
      PlanRequest req;
      req.algo = algo;
      req.count = 4099;
      req.chunk_bytes = 256;
      SCOPED_TRACE(shape_name(sc) + " " + to_string(algo));
      RunResult res = run_case(shape, req, DataType::kFloat32, ReduceOp::kSum, false, 7);
      ASSERT_TRUE(res.status.ok()) << res.status.to_string();
      for (size_t r = 1; r < res.bufs.size(); ++r)
        ASSERT_EQ(res.bufs[r].out, res.bufs[0].out) << "rank " << r << " differs from rank 0";
      if (algo == Algo::kOneShot || algo == Algo::kTwoShot) {
        expect_reference(res, req, DataType::kFloat32, ReduceOp::kSum);
      }
    }
  }
}

// The executor catches a broken schedule: a wrong count, a step dropped, a missing hop.
TEST(GpuPlanSchedule, ExecutorRejectsBrokenSchedules) {
  const JobShape shape = uniform_shape(2, 2, 2);
  PlanRequest req;
  req.count = 64;
  req.chunk_bytes = 32;
  ChannelSet channels = plan_channels(shape, req);
  auto fresh = [&] {
    std::vector<std::vector<Step>> steps;
    for (int r = 0; r < 4; ++r) steps.push_back(rank_steps(shape, channels, req, r));
    return steps;
  };
  std::vector<RankBuffers> bufs(4);
  for (auto& b : bufs) b.in.assign(64 * 4, 0), b.out.assign(64 * 4, 0);
  auto steps = fresh();
  ASSERT_TRUE(execute(shape, channels, steps, DataType::kFloat32, ReduceOp::kSum, {}, &bufs, nullptr).ok());
  steps[1][3].count += 1;
  Status st = execute(shape, channels, steps, DataType::kFloat32, ReduceOp::kSum, {}, &bufs, nullptr);
  EXPECT_FALSE(st.ok());
  steps = fresh();
  steps[2].erase(steps[2].begin() + 2);
  st = execute(shape, channels, steps, DataType::kFloat32, ReduceOp::kSum, {}, &bufs, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rank"), std::string::npos) << st.to_string();
  steps = fresh();
  steps[0][0].send[0] = 2;  // rank 0 has no ring hop to rank 2
  st = execute(shape, channels, steps, DataType::kFloat32, ReduceOp::kSum, {}, &bufs, nullptr);
  EXPECT_NE(st.message().find("no such hop"), std::string::npos) << st.to_string();
}

// Every schedule runs with one slot per hop too (no step waits for a later one of a peer).
// Every schedule runs with two slots per hop (the GPU channels' minimum, as the host ring's):
// no step waits for a later step of a peer. With one slot a ring's recv-reduce-send, which
// holds its incoming slot until the outgoing one is free, deadlocks, and the executor says so.
TEST(GpuPlanSchedule, NoDeadlockWithTwoSlots) {
  {
    PlanRequest req;
    req.count = 999;
    req.chunk_bytes = 64;
    RunResult res = run_case(uniform_shape(1, 4, 4), req, DataType::kInt32, ReduceOp::kSum, true, 3, 1);
    EXPECT_NE(res.status.message().find("deadlocked"), std::string::npos) << res.status.to_string();
  }
  for (const auto& sc : {ShapeCase{1, 8, 8}, ShapeCase{2, 4, 4}, ShapeCase{5, 3, 2}}) {
    const JobShape shape = uniform_shape(sc.nodes, sc.gpus, sc.nics);
    for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kOneShot, Algo::kTwoShot, Algo::kHierarchical}) {
      if (sc.nodes > 1 && (algo == Algo::kOneShot || algo == Algo::kTwoShot)) continue;
      if (sc.nodes == 1 && algo == Algo::kHierarchical) continue;
      for (Kind kind : {Kind::kAllreduce, Kind::kReduceScatter, Kind::kAllGather, Kind::kBroadcast}) {
        PlanRequest req;
        req.kind = kind;
        req.algo = algo;
        req.count = 999;
        req.chunk_bytes = 64;
        req.root = 1;
        SCOPED_TRACE(shape_name(sc) + " " + to_string(kind) + " " + to_string(algo));
        RunResult res = run_case(shape, req, DataType::kInt32, ReduceOp::kSum, true, 3, 2);
        ASSERT_TRUE(res.status.ok()) << res.status.to_string();
        expect_reference(res, req, DataType::kInt32, ReduceOp::kSum);
      }
    }
  }
}

// One-shot and two-shot with a window: a rank sends a group of chunks before it receives any
// of them (so it runs ahead of a peer that is not running, as processes time-sliced on one GPU
// are), exact with as many slots as the window, and deadlocked with fewer (the executor says so).
TEST(GpuPlanSchedule, DirectPushesSendAWindowAhead) {
  for (int n : {2, 3, 5, 8}) {
    const JobShape shape = uniform_shape(1, n, 1);  // one channel, as the step channels' pairs
    for (Algo algo : {Algo::kOneShot, Algo::kTwoShot}) {
      for (Kind kind : {Kind::kAllreduce, Kind::kReduceScatter, Kind::kAllGather, Kind::kBroadcast}) {
        for (size_t window : {size_t{2}, size_t{4}, size_t{8}}) {
          PlanRequest req;
          req.kind = kind;
          req.algo = algo;
          req.count = 3001;  // 47 chunks of 64 bytes (two-shot: segments of about 3001/n)
          req.chunk_bytes = 64;
          req.root = n - 1;
          req.window = window;
          SCOPED_TRACE("1x" + std::to_string(n) + " " + to_string(kind) + " " + to_string(algo) + " window " +
                       std::to_string(window));
          RunResult res = run_case(shape, req, DataType::kInt32, ReduceOp::kSum, true, 5, window);
          ASSERT_TRUE(res.status.ok()) << res.status.to_string();
          expect_reference(res, req, DataType::kInt32, ReduceOp::kSum);
          // Rank 0's messages to rank 1 before its first receive: a window's worth (two-shot's
          // allreduce sends two per chunk, half a window of pieces first).
          const ChannelSet channels = plan_channels(shape, req);
          const std::vector<Step> steps = rank_steps(shape, channels, req, 0);
          size_t ahead = 0;
          for (const Step& st : steps) {
            if (st.nrecv > 0) break;
            for (int j = 0; j < st.nsend; ++j) ahead += st.send[j] == 1;
          }
          const bool root_only_sends = kind == Kind::kBroadcast && algo == Algo::kOneShot;
          if (kind == Kind::kAllreduce || kind == Kind::kAllGather || kind == Kind::kReduceScatter) {
            EXPECT_EQ(ahead, algo == Algo::kTwoShot && kind == Kind::kAllreduce ? window / 2 : window);
          } else if (root_only_sends) {
            EXPECT_EQ(ahead, 0u);  // rank 0 is no root: it only receives
          }
        }
      }
    }
  }
  // A window over the slots: the sends of the group wait for slots the peer frees only after
  // its own group's sends, which wait likewise.
  PlanRequest req;
  req.algo = Algo::kOneShot;
  req.count = 999;
  req.chunk_bytes = 64;
  req.window = 4;
  RunResult res = run_case(uniform_shape(1, 2, 2), req, DataType::kInt32, ReduceOp::kSum, true, 3, 2);
  EXPECT_NE(res.status.message().find("deadlocked"), std::string::npos) << res.status.to_string();
}

// ---------------------------------------------------------------------------------------------
// Byte counts (symbolic sizes: the steps' counts only, no data)

LinkBytes count_all(const JobShape& shape, const PlanRequest& req) {
  ChannelSet channels = plan_channels(shape, req);
  LinkBytes bytes(shape);
  for (int r = 0; r < shape.world_size(); ++r)
    count_bytes(shape, channels, r, rank_steps(shape, channels, req, r), req.esize, &bytes);
  return bytes;
}

TEST(GpuPlanBytes, OneNodeOneShotAndTwoShotAsTheKernels) {
  for (int n : {2, 3, 4, 5, 8}) {
    const JobShape shape = uniform_shape(1, n, n);
    for (size_t count : {size_t{1}, size_t{1000}, size_t{1} << 20, (size_t{1} << 20) + 13}) {
      SCOPED_TRACE("1x" + std::to_string(n) + " count " + std::to_string(count));
      const uint64_t S = count * 4;
      PlanRequest req;
      req.count = count;
      req.algo = Algo::kOneShot;
      LinkBytes one = count_all(shape, req);
      for (int r = 0; r < n; ++r) EXPECT_EQ(one.intra_sent[size_t(r)], uint64_t(n - 1) * S) << "rank " << r;
      req.algo = Algo::kTwoShot;
      LinkBytes two = count_all(shape, req);
      const uint64_t seg = two_shot_segment(count, 4, n, 256);
      EXPECT_EQ(seg * 4 % 256, 0u);
      EXPECT_GE(seg * size_t(n), count);
      EXPECT_EQ(two.total_intra_sent(), 2 * uint64_t(n - 1) * S) << "every element crosses 2(n-1) hops in total";
      if (count >= size_t(n) * seg)  // every segment full: every rank sends exactly 2(n-1) segments
        for (int r = 0; r < n; ++r) {
          EXPECT_EQ(two.intra_sent[size_t(r)], 2 * uint64_t(n - 1) * seg * 4) << "rank " << r;
        }
      for (int r = 0; r < n; ++r) EXPECT_LE(two.intra_sent[size_t(r)], 2 * uint64_t(n - 1) * seg * 4) << "rank " << r;
      if (n == 8 && count == size_t{1} << 20) {
        EXPECT_EQ(one.intra_sent[0], 4 * two.intra_sent[0]) << "at 8 GPUs one-shot moves 4x the bytes";
      }
    }
  }
}

TEST(GpuPlanBytes, OneNodeRingAndTwoShotWithinTheRingBound) {
  for (int n : {2, 3, 4, 8}) {
    const JobShape shape = uniform_shape(1, n, n);
    for (Algo algo : {Algo::kRing, Algo::kTwoShot}) {
      for (size_t count : {size_t{1} << 16, (size_t{3} << 20) + 7}) {  // 256 KiB and 12 MiB floats
        PlanRequest req;
        req.algo = algo;
        req.count = count;
        LinkBytes b = count_all(shape, req);
        const double bound = 2.0 * (n - 1) / n * double(count * 4) * 1.05;
        SCOPED_TRACE("1x" + std::to_string(n) + " " + to_string(algo) + " count " + std::to_string(count));
        EXPECT_LE(double(b.max_intra_sent()), bound);
        EXPECT_EQ(b.max_nic(), 0u);
      }
    }
  }
}

TEST(GpuPlanBytes, RingAcrossNodesIsNcclsFormulaOnEveryRail) {
  for (const auto& sc : {ShapeCase{2, 1, 1}, ShapeCase{2, 8, 8}, ShapeCase{3, 2, 2}, ShapeCase{16, 8, 8}}) {
    const JobShape shape = uniform_shape(sc.nodes, sc.gpus, sc.nics);
    const int n = shape.world_size();
    // A count that splits evenly into channels and ring segments: the formula holds exactly.
    const size_t count = size_t(n) * size_t(sc.nics) * 1024;
    const uint64_t S = count * 4;
    PlanRequest req;
    req.count = count;
    req.chunk_bytes = size_t{1} << 30;  // one round: segments of exactly count/(C n)
    LinkBytes b = count_all(shape, req);
    SCOPED_TRACE(shape_name(sc));
    const uint64_t per_node = 2 * uint64_t(n - 1) * S / uint64_t(n);
    for (int x = 0; x < sc.nodes; ++x) {
      EXPECT_EQ(b.node_nic_sent(x), per_node) << "node " << x;
      EXPECT_EQ(b.node_nic_recv(x), per_node) << "node " << x;
      for (int k = 0; k < sc.nics; ++k) {
        EXPECT_EQ(b.nic_sent[size_t(x)][size_t(k)], per_node / uint64_t(sc.nics)) << "node " << x << " NIC " << k;
        EXPECT_EQ(b.nic_recv[size_t(x)][size_t(k)], per_node / uint64_t(sc.nics)) << "node " << x << " NIC " << k;
      }
    }
    // Inside the node every rank but the exits sends 2(n-1)/n of its channels' shares.
    EXPECT_LE(double(b.max_intra_sent()), 2.0 * (n - 1) / n * double(S) * 1.05);
  }
}

// Hierarchical: reduce-scatter and all-gather inside the node, one ring per rail across the k
// nodes on the node's segment: 2(k-1)/k·S per node per direction, S/g of it on each rail, and
// 2(g-1)/g·S per GPU inside the node (each node's rails run the ring allreduce of its share).
TEST(GpuPlanBytes, HierarchicalMovesTwoKMinusOneOverKPerNode) {
  for (const auto& sc : {ShapeCase{2, 1, 1}, ShapeCase{2, 8, 8}, ShapeCase{3, 2, 2}, ShapeCase{16, 8, 8}}) {
    const JobShape shape = uniform_shape(sc.nodes, sc.gpus, sc.nics);
    const uint64_t k = uint64_t(sc.nodes), g = uint64_t(sc.gpus);
    // Splits evenly into channels, chunks, node segments and ring segments.
    const size_t count = size_t(sc.nics) * size_t(g * k) * 256;
    const uint64_t S = count * 4;
    PlanRequest req;
    req.algo = Algo::kHierarchical;
    req.count = count;
    ASSERT_EQ(check_request(shape, req), "");
    LinkBytes b = count_all(shape, req);
    SCOPED_TRACE(shape_name(sc));
    for (int x = 0; x < sc.nodes; ++x) {
      EXPECT_EQ(b.node_nic_sent(x), 2 * (k - 1) * S / k) << "node " << x;
      EXPECT_EQ(b.node_nic_recv(x), 2 * (k - 1) * S / k) << "node " << x;
      for (int l = 0; l < sc.nics; ++l) EXPECT_EQ(b.nic_sent[size_t(x)][size_t(l)], 2 * (k - 1) * S / k / uint64_t(sc.nics));
    }
    for (int r = 0; r < shape.world_size(); ++r) EXPECT_EQ(b.intra_sent[size_t(r)], 2 * (g - 1) * S / g) << "rank " << r;
  }
  PlanRequest req;
  req.algo = Algo::kHierarchical;
  EXPECT_NE(check_request(uniform_shape(1, 8, 8), req), "");   // one node: two-shot
  EXPECT_NE(check_request(uniform_shape(2, 9, 1), req), "");   // more than 8 per node
}

TEST(GpuPlanBytes, TreeAcrossNodesCarriesHalfPerTreeOnEachEdge) {
  for (const auto& sc : {ShapeCase{2, 8, 8}, ShapeCase{3, 2, 2}, ShapeCase{4, 8, 8}, ShapeCase{16, 8, 8},
                         ShapeCase{5, 1, 1}}) {
    const JobShape shape = uniform_shape(sc.nodes, sc.gpus, sc.nics);
    const int C = default_tree_channels(shape);
    const size_t count = size_t(C) * 4096;
    const uint64_t S = count * 4, share = S / uint64_t(C);
    PlanRequest req;
    req.algo = Algo::kTree;
    req.count = count;
    LinkBytes b = count_all(shape, req);
    ChannelSet set = plan_channels(shape, req);
    SCOPED_TRACE(shape_name(sc));
    uint64_t total = 0;
    for (int x = 0; x < sc.nodes; ++x) {
      // Exactly: per channel, one share up (unless root) and one down per child node.
      uint64_t want = 0;
      for (int c = 0; c < C; ++c) {
        for (int r : shape.nodes[size_t(x)].ranks) {
          const TreeLinks& l = set[c].links[size_t(r)];
          if (l.parent >= 0 && shape.node_of(l.parent) != x) want += share;
          for (int k = 0; k < l.nchildren; ++k)
            if (shape.node_of(l.children[k]) != x) want += share;
        }
      }
      EXPECT_EQ(b.node_nic_sent(x), want) << "node " << x;
      EXPECT_EQ(b.node_nic_recv(x), want) << "node " << x;
      total += b.node_nic_sent(x);
      if (sc.nodes % 2 == 0) {
        EXPECT_LE(b.node_nic_sent(x), 2 * S) << "node " << x << ": about 2 S";
      }
    }
    // Each of the N-1 edges of each tree carries that tree's half once up and once down.
    EXPECT_EQ(total, 2 * uint64_t(sc.nodes - 1) * S);
    // The chain inside the node: each rank sends its data up and down once.
    EXPECT_LE(b.max_intra_sent(), 2 * S);
  }
}

}  // namespace
}  // namespace gradsync::plan
