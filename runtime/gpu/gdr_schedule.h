// The ring schedule of the GPUDirect RDMA path (gpu/gdr_ring.h), as plain data: what one rank
// does, step by step, for one collective. No CUDA here, so that the schedule is tested on any
// machine (tests/unit/gdr_schedule_test.cc runs it on host memory for every collective, world
// size and count) and the GPU code only turns steps into kernels and messages.
//
// A step may take the next message from the previous rank (`recv`: it lands in a receive slot)
// and may produce the next message to the next rank (`send`: it is written into a send slot).
// Messages are numbered per direction in step order; the steps of rank r's `send`s and of rank
// r+1's `recv`s describe the same pieces in the same order, with the same lengths.
//
// Allreduce cuts the buffer into n segments (rank order, sizes differ by at most one element)
// and each segment into pieces of at most `per` elements; the steps run piece-major (all steps
// of piece 0, then piece 1, ...), which with at least two slots per direction keeps the ring
// free of deadlock: a rank waits only for a neighbour at an earlier message.
//   reduce-scatter half, step s = 0 .. n-2: send segment r-s-1, receive segment r-s-2;
//   rank r ends it with segment r reduced (in ring order from r+1);
//   all-gather half, step t = 0 .. n-2: send segment r-t, receive segment r-t-1.
// reduce_scatter and all_gather are the halves (segments of `count` elements, the strided
// buffers of the host API); broadcast is a pipeline from the root around the ring.
#pragma once

#include <cstddef>
#include <vector>

#include "gradsync/gradsync.h"
#include "collectives/collective.h"

namespace gradsync::gdr {

enum class Body {
  kCopyIn,       // send slot <- input piece
  kReduce,       // send slot <- op(receive slot, input piece)
  kReduceFinal,  // output piece <- op(receive slot, input piece), avg divided by n; the send
                 // slot gets the same when the step sends
  kGatherFirst,  // output piece <- input piece (unless the same memory); send slot <- input
  kCopyOut,      // output piece <- receive slot; the send slot gets the same when it sends
};

struct Step {
  bool recv = false;
  bool send = false;
  Body body = Body::kCopyIn;
  size_t in = 0;   // element offset of the piece in the call's send buffer (input)
  size_t out = 0;  // element offset of the piece in the call's recv buffer (output)
  size_t len = 0;  // elements, > 0
};

// Rank `rank`'s steps for one call: kind is allreduce, reduce_scatter, all_gather or
// broadcast, `count` as in the host API (per rank for reduce_scatter and all_gather),
// `per` >= 1 the elements of one slot. Broadcast reads and writes the recv buffer only (in and
// out are both offsets into it). Empty when count is 0 or n is 1.
std::vector<Step> plan(CollectiveKind kind, size_t count, int n, int rank, int root, size_t per);

}  // namespace gradsync::gdr
