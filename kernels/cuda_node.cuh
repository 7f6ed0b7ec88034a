// The collectives among the GPUs of one node, one kernel per rank and call: every rank pushes
// its input, chunk by chunk, into a slot in its peers' GPU memory (NVLink or PCIe peer stores
// through CUDA IPC mappings) and consumes what its peers pushed into its own slots.
//
// Collectives (NodeCollective). A call works on `count` elements per rank's segment:
// - allreduce: every rank pushes its input to every peer; each rank folds all inputs.
// - reduce_scatter: send has nranks segments; rank r pushes only segment s to rank s, and
//   rank s folds segment s of every input (its own read in place).
// - all_gather: every rank pushes its input to every peer; each rank copies every peer's
//   chunk into the peer's segment of recv (its own from send, unless in place).
// - broadcast: the root pushes, the others copy; the root consumes nothing.
// Folds run in rank order (x0 op x1 op ... ), the last step with the final op (avg divides
// there), so every rank gets the same bytes and they equal the host loops' rank-order fold.
// That is the one-shot protocol: n - 1 buffers sent per rank for allreduce and broadcast.
// From 3 ranks, large allreduces and broadcasts take the two-shot protocol instead
// (cuda_node_two_shot.cuh, NodeLayout::two_shot_min_bytes): 2 (n-1)/n of a buffer.
// Files: cuda_node_device.cuh (flags, waits, movers), cuda_node_chunked.cuh (one-shot),
// cuda_node_ll.cuh (low-latency), cuda_node_two_shot.cuh, cuda_node_launch.cuh (protocol,
// chunk and grid of a call), one translation unit per collective's kernels.
//
// Shape. The segment is cut into chunks; chunk j belongs to block j % blocks, on every rank
// (the grid and the chunks depend only on the segment's bytes and the layout, so all ranks
// agree whatever the collective). Block b of rank r owns, in every rank p's region, `slots`
// slots [b][r][0..slots) that only it writes, and the flags:
//   ready[b][r] in p's region: the sequence number + 1 of the last chunk block b of r pushed
//                              into p (r writes);
//   freed[b][p] in r's region: the sequence number + 1 of the last chunk p finished, i.e.
//                              stopped reading its slots of (p writes, into every peer).
// Every rank gives every sequence number of a block a meaning (one chunk of one call), and
// every rank publishes freed for every sequence number, whether it read anything or not (a
// broadcast root, or a rank that no one pushed to): a pusher waits only for "the peer is done
// with sequence k - slots", which then holds across collectives. ready is waited for only
// from ranks that push in that call; it is stored as an absolute value, so the sequences a
// rank did not push (broadcasts of another root) are simply skipped.
// A block pushes chunk i+1 before it waits for and consumes chunk i, so the push of one chunk
// overlaps the flag round trip and the consumption of the previous one.
//
// The per-block counts live in device memory (`progress`, one word a block), advanced by the
// kernel itself: nothing per call comes from the host, so a CUDA graph that captured the
// launch replays correctly.
//
// Waits: one thread a block spins on a flag with a deadline (%globaltimer) and polls the abort
// word in mapped host memory; a wait that fails writes a NodeError to mapped host memory and
// every block of that launch returns (the output is then undefined, and the flags no longer
// agree between ranks: the communicator must be considered failed).
//
// Timeline (GRADSYNC_GPU_TIMELINE=1, runtime/gpu/timeline.h; off by default). A launch given a
// NodeTimeline runs a second instantiation of the chunked kernel, whose thread 0 of every
// block stores %globaltimer stamps (ns) into it; without one, the kernel is the same code as
// before the timeline existed (same registers: no test, no stamp). The low-latency kernel
// records nothing. Block b's record starts at word b * node_timeline_stride(chunks):
//   [0] the block's start (kernel entry), [1] its end (after its last consume, freed release
//   included), [2] its chunks in the call, all of them (the record holds the first `chunks`;
//   the others are dropped and only counted here), [3] the sequence number of its chunk 0;
//   then per recorded chunk i, kTimelineSteps words, in the order thread 0 passes them:
//   kCreditWait  push(i) entered: the wait for the peers' freed (the slot's credit) starts
//   kPushStart   the credit is there (after the block's barrier): the stores start
//   kPushEnd     every thread's stores are issued and fenced (__threadfence_system, then the
//                barrier): they completed at system scope; stamped BEFORE the ready release,
//                so a peer's observation of ready happens after this stamp
//   kReadyWait   consume(i) entered: the wait for the peers' ready starts
//   kFoldStart   every pushing peer's ready was seen (after the barrier): the fold (all_gather,
//                broadcast: the copy out) starts
//   kFoldEnd     every thread finished reading the slot (after the barrier); stamped BEFORE
//                the freed release
//   A step that does not happen (a broadcast non-root pushes nothing) stays 0.
// Thread 0's program order for a block with m chunks (what the host checks):
//   push(0), then for i < m: push(i + 1) (if i + 1 < m), consume(i).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "gradsync/gradsync.h"

namespace gradsync::kernels {

constexpr int kMaxNodeRanks = 8;

struct NodeLayout {
  int nranks = 0;
  uint32_t blocks = 0;       // thread blocks of a launch, at most
  uint32_t slots = 0;        // per (block, source), >= 2
  uint64_t chunk_bytes = 0;  // largest chunk, a multiple of 256
  uint64_t ll_max_bytes = 0;  // largest message of the low-latency protocol (0: never)
  // Allreduce and broadcast segments of at least this many bytes take the two-shot protocol
  // when nranks >= 3 (0: never); it takes precedence over the low-latency protocol.
  uint64_t two_shot_min_bytes = 0;

  uint64_t flags_bytes() const;   // ready + freed, rounded up to 4 KiB
  uint64_t ll_offset() const;     // after the slots
  uint64_t ll_stride() const;     // one source's low-latency lines of one parity
  uint64_t region_bytes() const;  // flags + slots + low-latency lines: one rank's allocation
  bool valid() const;
};

// Written by a failing wait (mapped host memory; the host reads it after the stream ran).
struct NodeError {
  uint32_t code;   // 0 none, 1 deadline, 2 aborted
  int32_t peer;    // the rank waited for
  uint32_t block;  // the block that waited
  uint32_t what;   // 0 waited for a free slot, 1 waited for the peer's chunk, 2-4: launch_wait_host
};

struct NodeArgs {
  int me = 0;
  uint8_t* region[kMaxNodeRanks] = {};  // every rank's region, addressable on this device
  uint64_t* progress = nullptr;          // 2 * layout.blocks words in this device's memory
  NodeError* error = nullptr;            // mapped pinned host memory
  const uint32_t* abort = nullptr;       // mapped pinned host memory; nonzero stops waits
  uint64_t timeout_ns = 0;
  // Device memory, or null: the payload bytes this rank stored into peers' regions (slots
  // and low-latency lines, flags not counted), added by every launch.
  uint64_t* sent = nullptr;
};

// The timeline (see the top of this file): layout.blocks records of
// node_timeline_stride(chunks) words in this device's memory.
struct NodeTimeline {
  uint64_t* stamps = nullptr;
  uint32_t chunks = 0;  // chunks recorded per block and call, at most
};

// The timeline record of a block: header words, then kTimelineSteps words a recorded chunk.
constexpr uint32_t kTimelineHeader = 4;
constexpr uint32_t kTimelineSteps = 6;
enum TimelineStep : uint32_t {
  kCreditWait = 0,
  kPushStart = 1,
  kPushEnd = 2,
  kReadyWait = 3,
  kFoldStart = 4,
  kFoldEnd = 5,
};
__host__ __device__ constexpr uint64_t node_timeline_stride(uint32_t timeline_chunks) {
  return kTimelineHeader + uint64_t(kTimelineSteps) * timeline_chunks;
}

enum class NodeCollective : uint8_t { kAllreduce, kReduceScatter, kAllGather, kBroadcast };

// One call. `count` is the elements of one segment: allreduce and broadcast the buffer,
// reduce_scatter the elements each rank receives (send holds nranks * count), all_gather the
// elements each rank sends (recv holds nranks * count). In place: allreduce send == recv;
// reduce_scatter recv == send + me * count; all_gather send == recv + me * count; broadcast
// always (send == recv == the buffer). `op` only for allreduce and reduce_scatter, `root`
// only for broadcast.
struct NodeCall {
  NodeCollective kind = NodeCollective::kAllreduce;
  DataType type = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
};

// Low-latency protocol (segments up to layout.ll_max_bytes): every 8 bytes of input travel as
// one 16-byte line {data, flag, data, flag} stored at once into each peer's line buffer, the
// flag being the block's call count; the receiver spins on the lines themselves, so there is
// no fence, no separate flag and no slot credit. Lines alternate between two buffers by call
// parity: a peer cannot write call c + 2's lines before this rank pushed call c + 1's, which
// it does only after it finished reading call c's. That argument needs every rank to read at
// least one line from every peer in every call: allreduce, reduce_scatter and all_gather do;
// in a broadcast every non-root also pushes one acknowledgement line to every peer, which
// the root and the other non-roots wait for. Twice the bytes on the link, a fraction of the
// latency.
//
// Queues one kernel on `stream`. cudaErrorInvalidValue (nothing launched) for an invalid
// layout, kind, type, op or root, null or misaligned buffers.
// `timeline`: record this launch's timeline there (chunked protocol only), or null.
cudaError_t launch_node_collective(const NodeLayout& layout, const NodeArgs& args,
                                   const NodeCall& call, cudaStream_t stream,
                                   const NodeTimeline* timeline = nullptr);

// The protocol a call takes (every rank computes the same): the low-latency lines, the
// chunked one-shot push, or two-shot (cuda_node_two_shot.cuh: reduce_scatter + all_gather by
// direct pushes, 2 (n-1)/n of the buffer sent per rank instead of n - 1 buffers).
enum class NodeProtocol : uint8_t { kLowLatency, kOneShot, kTwoShot };
NodeProtocol node_protocol(const NodeLayout& layout, NodeCollective kind, size_t bytes);
const char* to_string(NodeProtocol p);

// The blocks a launch on segments of `bytes` uses (the others have no chunk); all ranks agree.
uint32_t node_blocks_used(const NodeLayout& layout, size_t bytes);
// The chunk of a chunked launch on segments of `bytes` (chunk j: bytes [j * c, (j + 1) * c)
// of the segment, block j % blocks used); 0 when the low-latency protocol takes `bytes`.
uint64_t node_chunk_bytes(const NodeLayout& layout, size_t bytes);

// One thread waits until *flag >= value (flag in mapped pinned host memory, written by a host
// thread), or *abort is nonzero, or timeout_ns passed (then error->code is set); adds the time
// it waited to *waited_ns when that is not null. Makes a stream wait for host-side work
// without blocking the host.
// `peer` and `what` go into *error (the rank waited for, NodeError::what: 2 host-staged
// results, 3 a GPUDirect RDMA arrival, 4 a free GPUDirect RDMA send slot).
cudaError_t launch_wait_host(const volatile uint64_t* flag, uint64_t value,
                             const uint32_t* abort, NodeError* error, uint64_t timeout_ns,
                             uint64_t* waited_ns, cudaStream_t stream, int32_t peer = -1,
                             uint32_t what = 2);

// Loads launch_wait_host's and launch_signal_host's kernels now (see load_reduce_kernels in
// cuda_reduce.cuh for why).
cudaError_t load_host_sync_kernels();

// One thread stores %globaltimer to *stamp_ns (if not null), then value to *word (if not null),
// both in mapped pinned host memory: tells a host thread that the stream got this far.
cudaError_t launch_signal_host(uint64_t* word, uint64_t value, uint64_t* stamp_ns,
                               cudaStream_t stream);

}  // namespace gradsync::kernels
