// Per rank, the primitive steps of one GPU collective over a ChannelSet (channels.h): what
// the device kernels run, as plain data. Pure: same request -> same steps on every rank.
//
// A step names its channel, up to 7 peers it receives from and 7 it sends to, the element
// offsets into the call's input (`in`) and output (`out`) and the element count. The steps
// of one channel run in list order (one CTA per channel on the GPU); channels run side by
// side. A message is one step's payload: the n-th step of rank a sending to b on channel c
// is received by the n-th step of b receiving from a on c, with the same count.
//
//   send                 payload = input[in..]                    -> send peers
//   copy-send            output[out..] = input[in..]; payload = it -> send peers
//   recv                 output[out..] = payload
//   recv-copy-send       output[out..] = payload                  -> send peers
//   recv-reduce-send     payload' = fold(input[in..], payloads)   -> send peers
//   recv-reduce-copy-send  output[out..] = final fold             -> send peers
//   recv-reduce-copy     output[out..] = final fold
// fold: the received payloads in peer order with the own input at `self_pos`, folded left
// with the host loops' arithmetic (kernels/host_reduce.h); the final fold divides kAvg by
// the world size once. A value is reduced once and then only copied, so every rank ends with
// the same bits.
//
// Algorithms (data split evenly over the channels, then into chunks of `chunk_bytes`,
// pipelined):
//   ring     allreduce: reduce-scatter then all-gather around the ring, 2(n-1) transfers per
//            chunk (NCCL's runRing); reduce_scatter and all_gather: one half each; broadcast:
//            a pipeline from the root around the ring.
//   tree     allreduce: reduce up the tree, the root's final value broadcast down, chunk k's
//            way down right after chunk k+1's way up; each tree half of the data. broadcast:
//            down the trees rooted at the root. reduce_scatter and all_gather have no tree
//            form (NCCL uses trees for allreduce only, nccl#673): they take the ring.
//   one-shot (one node) allreduce: every rank pushes its whole buffer to every peer and
//            folds the n inputs in rank order: (n-1)·S bytes sent per rank.
//            reduce_scatter: block s pushed to rank s only, rank s folds in rank order.
//            all_gather: every rank pushes its block to every peer. broadcast: the root
//            pushes the buffer to every peer.
//   two-shot (one node) allreduce: segments of ceil(S/n) rounded up to 256 bytes, rank s owns
//            segment s; every rank pushes segment s to rank s, which folds it in rank order
//            and pushes the result to every peer: 2(n-1) segments sent per rank (the last
//            ranks' segments are shorter or empty). broadcast: the root pushes segment s to
//            rank s, then every rank pushes its segment to every peer. reduce_scatter and
//            all_gather: as one-shot (they already move (n-1)/n·S).
//   hierarchical (allreduce, several nodes of the same rank count, at most 8 each): inside
//            each node a reduce-scatter by direct pushes (local rank l folds node segment l
//            in local order), then one ring per local index across the nodes on that rank's
//            rail (ring allreduce of the node segment), then an all-gather by direct pushes:
//            2(k-1)/k·S per node per direction between k nodes, 2(g-1)/g·S per GPU inside
//            a node of g, and 2 + 2(k-1) hops (the flat ring: 2(n-1)/n·S and 2(n-1) hops).
//            The other collectives take the ring.
//   One-shot and two-shot send a window of chunks (PlanRequest::window) before they receive
//   any of them.
// One-shot and two-shot are the schedules of kernels/cuda_node.cu's kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "collectives/collective.h"
#include "gpu/plan/channels.h"
#include "gradsync/status.h"

namespace gradsync::plan {

enum class Algo : uint8_t { kRing = 0, kTree = 1, kOneShot = 2, kTwoShot = 3, kHierarchical = 4 };
constexpr int kNumAlgos = 5;
const char* to_string(Algo a);

enum class Prim : uint8_t {
  kSend,
  kCopySend,
  kRecv,
  kRecvCopySend,
  kRecvReduceSend,
  kRecvReduceCopySend,
  kRecvReduceCopy,
  kCopy,  // output[out..] = input[in..] (a world of one rank)
};
const char* to_string(Prim p);

constexpr int kMaxPeers = 7;

struct Step {
  Prim prim = Prim::kSend;
  uint8_t nrecv = 0;
  uint8_t nsend = 0;
  uint8_t self_pos = 0;  // fold position of the own input among the received payloads
  uint8_t from_output = 0;  // the own operand is output[in..] (an earlier step's result), not the input
  uint8_t partial = 0;      // a fold to the output that is not the last one: kAvg stays a sum
  int32_t channel = 0;
  int32_t recv[kMaxPeers] = {};
  int32_t send[kMaxPeers] = {};
  uint64_t in = 0;     // element offset into the input
  uint64_t out = 0;    // element offset into the output
  uint64_t count = 0;  // elements, > 0
};

struct PlanRequest {
  CollectiveKind kind = CollectiveKind::kAllreduce;
  Algo algo = Algo::kRing;
  size_t count = 0;  // as in the host API: per rank for reduce_scatter and all_gather
  size_t esize = 4;  // bytes per element
  int root = 0;      // broadcast
  int channels = 0;  // 0: default_ring_channels / default_tree_channels / 1 direct channel per rail
  size_t chunk_bytes = size_t{512} << 10;
  size_t segment_align_bytes = 256;  // two-shot segments (kernels/cuda_node.cu)
  // Messages a rank may send to one peer before that peer has read any (the link's slots per
  // peer). One-shot and two-shot send a group of chunks that fills it before they receive the
  // group's; 1: chunk by chunk.
  size_t window = 1;
};

// The algorithm a request really runs: tree reduce_scatter and all_gather, and hierarchical
// anything but allreduce, take the ring.
Algo effective_algo(CollectiveKind kind, Algo algo);
// Empty when `req` can be planned on `shape`, else why not (one-shot and two-shot need one
// node of at most 8 ranks; hierarchical several nodes of the same rank count, at most 8; the
// shape must validate; root within the world).
std::string check_request(const JobShape& shape, const PlanRequest& req);

// The channels the request's algorithm runs over.
ChannelSet plan_channels(const JobShape& shape, const PlanRequest& req);
// Rank `rank`'s steps (empty for a count of 0). `channels` from plan_channels.
std::vector<Step> rank_steps(const JobShape& shape, const ChannelSet& channels,
                             const PlanRequest& req, int rank);

// The two-shot segment in elements: ceil(count/n) elements rounded up to whole
// `segment_align_bytes` (kernels/cuda_node.cu two_shot_segment_bytes).
size_t two_shot_segment(size_t count, size_t esize, int n, size_t align_bytes);

}  // namespace gradsync::plan
