// The GPU cost model: predicted time of a collective per (algorithm, protocol) from the link
// figures of the shape (shape.h) and the schedule's own hop and byte counts, as NCCL's
// tuning does it (shared/reference/nccl.md §1, multinode_ops.md §1; src/graph/tuning.cc):
//
//   t = base[algo][proto] + intra_hops · intra_lat[proto] + inter_hops · nic_lat[proto]
//       + max(busiest GPU's intra-node bytes / (intra GB/s · eff),
//             busiest NIC's bytes / (NIC GB/s · eff))
//
// Hops are those a chunk passes in sequence: ring allreduce 2(n-1) of which 2(nodes-1)
// between nodes, reduce_scatter, all_gather and broadcast n-1 of which nodes-1 (NCCL's
// nsteps and nInterSteps); tree: the chain and tree depth of the channels, up and down for
// allreduce (NCCL: 2·((ppn-1)·intraLat + log2(nodes)·interLat)); one-shot one hop, two-shot
// two; hierarchical two inside the node and 2(nodes-1) between. Bytes come from counting the schedule's steps (executor.h count_bytes) of the ranks
// that carry the most, so the model sees what the schedule really moves. eff: 0.5 for the
// low-latency protocol (a flag beside every 4 bytes of data, NCCL's LL), 1 for bulk, and
// NCCL's 0.92 on tree allreduce. Base latencies: NCCL's ring 6.6/8.4 us and tree 6.8/8.4 us
// (LL/Simple); one-shot, two-shot and hierarchical take the ring's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gpu/plan/schedule.h"
#include "gradsync/gradsync.h"

namespace gradsync::plan {

enum class Protocol : uint8_t { kLowLatency = 0, kBulk = 1 };
const char* to_string(Protocol p);

struct CostParams {
  double base_us[kNumAlgos][2] = {{6.6, 8.4}, {6.8, 8.4}, {6.6, 8.4}, {6.6, 8.4}, {6.6, 8.4}};  // [algo][proto]
  double ll_efficiency = 0.5;
  double tree_efficiency = 0.92;
};

// What the time depends on, from the channels and the steps.
struct ScheduleFigures {
  int intra_hops = 0;
  int inter_hops = 0;
  uint64_t max_intra_bytes = 0;  // the busiest GPU, sent or received inside its node
  uint64_t max_nic_bytes = 0;    // the busiest NIC, either direction
};

// Plans `req` on `shape` and counts the steps of the ranks that carry the most (node 0's for
// rings and direct pushes; a sample of nodes for trees, all of them up to 64). Moves no data.
ScheduleFigures schedule_figures(const JobShape& shape, const PlanRequest& req);
// The nodes whose ranks carry the most bytes, which schedule_figures counts: node 0 for rings
// and direct pushes; for trees every node up to 64, else nine of them.
std::vector<int> sample_nodes(const JobShape& shape, Algo algo);
// Its hop counts alone (bytes 0): what a caller that counts the bytes its own way needs.
ScheduleFigures schedule_hops(const JobShape& shape, const PlanRequest& req, const ChannelSet& channels);

struct Estimate {
  Algo algo = Algo::kRing;
  Protocol proto = Protocol::kBulk;
  double us = 0;
  ScheduleFigures fig;
};

double predict_us(const LinkFigures& links, const ScheduleFigures& fig, Algo algo, Protocol proto,
                  const CostParams& params = {});

// The algorithms a collective can run on a shape: ring and tree (tree only for allreduce and
// broadcast), on one node of at most 8 ranks also one-shot and two-shot, across nodes of the
// same size (at most 8 ranks) also hierarchical for allreduce.
std::vector<Algo> candidates(const JobShape& shape, CollectiveKind kind);

struct Choice {
  Estimate best;
  std::vector<Estimate> all;  // every candidate algorithm x protocol
  std::string forced;         // why the choice was forced, or empty
};

// Estimates every candidate and picks the fastest; `forced` (forced_algo) restricts the choice
// to that algorithm where the shape can run it (else the model decides, and `forced` says so).
Choice choose(const JobShape& shape, CollectiveKind kind, size_t count, size_t esize, int root,
              std::optional<Algo> forced = std::nullopt, const CostParams& params = {});

// GRADSYNC_ALGO for GPU calls: ring, tree, oneshot, twoshot, hierarchical or auto (nullopt:
// auto). Another
// value is an error (`error` says which values are known).
std::optional<Algo> algo_from_env(const char* value, std::string* error);
// The override of a call: CallOptions::algorithm when not kAuto, else GRADSYNC_ALGO's.
std::optional<Algo> forced_algo(Algorithm call, std::optional<Algo> env);

}  // namespace gradsync::plan
