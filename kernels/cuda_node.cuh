// Allreduce among the GPUs of one node in one kernel per rank: every rank pushes its input,
// chunk by chunk, into a slot in each peer's GPU memory (NVLink or PCIe peer stores through
// CUDA IPC mappings) and reduces the chunks its peers pushed into its own slots.
//
// Shape. The buffer is cut into chunks; chunk j belongs to block j % blocks, on every rank.
// Block b of rank r owns, in every rank p's region, `slots` slots [b][r][0..slots) that only
// it writes, and the flags:
//   ready[b][r] in p's region: how many chunks block b of r has pushed into p (r writes);
//   freed[b][p] in r's region: how many of those p has consumed (p writes).
// A block pushes chunk i+1 before it waits for and reduces chunk i, so the push of one chunk
// overlaps the flag round trip and the reduction of the previous one. Every rank folds the
// inputs in rank order (x0 op x1 op ... ), so every rank gets the same bytes.
//
// The per-block counts live in device memory (`progress`, one word a block), advanced by the
// kernel itself: nothing per call comes from the host, so a CUDA graph that captured the
// launch replays correctly.
//
// Waits: one thread a block spins on a flag with a deadline (%globaltimer) and polls the abort
// word in mapped host memory; a wait that fails writes a NodeError to mapped host memory and
// every block of that launch returns (the output is then undefined, and the flags no longer
// agree between ranks: the communicator must be considered failed).
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
  uint32_t what;   // 0 waited for a free slot, 1 waited for the peer's chunk
};

struct NodeArgs {
  int me = 0;
  uint8_t* region[kMaxNodeRanks] = {};  // every rank's region, addressable on this device
  uint64_t* progress = nullptr;          // 2 * layout.blocks words in this device's memory
  NodeError* error = nullptr;            // mapped pinned host memory
  const uint32_t* abort = nullptr;       // mapped pinned host memory; nonzero stops waits
  uint64_t timeout_ns = 0;
};

// Low-latency protocol (messages up to layout.ll_max_bytes): every 8 bytes of input travel as
// one 16-byte line {data, flag, data, flag} stored at once into each peer's line buffer, the
// flag being the block's call count; the receiver spins on the lines themselves, so there is
// no fence, no separate flag and no slot credit. Lines alternate between two buffers by call
// parity: a peer cannot write call c + 2's lines before this rank pushed call c + 1's, which
// it does only after it finished reading call c's. Twice the bytes on the link, a fraction
// of the latency.
//
// recv[i] = op over ranks of send[i]. Queues one kernel on `stream`. send == recv is allowed.
// cudaErrorInvalidValue (nothing launched) for an invalid layout, type or op, null or
// misaligned buffers.
cudaError_t launch_node_allreduce(const NodeLayout& layout, const NodeArgs& args, DataType type,
                                  ReduceOp op, const void* send, void* recv, size_t count,
                                  cudaStream_t stream);

// The blocks a launch of `count` elements uses (the others have no chunk); all ranks agree.
uint32_t node_blocks_used(const NodeLayout& layout, size_t bytes);

// One thread waits until *flag >= value (flag in mapped pinned host memory, written by a host
// thread), or *abort is nonzero, or timeout_ns passed (then error->code is set); adds the time
// it waited to *waited_ns when that is not null. Makes a stream wait for host-side work
// without blocking the host.
cudaError_t launch_wait_host(const volatile uint64_t* flag, uint64_t value,
                             const uint32_t* abort, NodeError* error, uint64_t timeout_ns,
                             uint64_t* waited_ns, cudaStream_t stream);

// One thread stores %globaltimer to *stamp_ns (if not null), then value to *word (if not null),
// both in mapped pinned host memory: tells a host thread that the stream got this far.
cudaError_t launch_signal_host(uint64_t* word, uint64_t value, uint64_t* stamp_ns,
                               cudaStream_t stream);

}  // namespace gradsync::kernels
