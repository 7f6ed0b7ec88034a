// One measured group (out-of-place or in-place) of one size: buffers laid out like
// nccl-tests, a checked call, then warm-up and timed iterations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "bench/options.h"
#include "gradsync/gradsync.h"

namespace bench {

// What one line of the table is about.
struct Geometry {
  size_t bytes;       // printed size: the full buffer (reduce_scatter's send, all_gather's recv)
  size_t count;       // printed count: the count argument of the call
  size_t send_elems;  // of this rank's send buffer
  size_t recv_elems;
  double bus_factor;  // busbw = algbw * bus_factor
};
Geometry geometry(Collective c, size_t bytes, size_t esize, int world);
size_t esize_of(gradsync::DataType t);  // the bench's own table: no dependency on the library's

struct Case {
  Collective collective;
  gradsync::DataType type;
  gradsync::ReduceOp op;
  int root;
  gradsync::CallOptions call_options;
  Geometry g;
  uint64_t seed;  // of the checked call's inputs
};

struct Outcome {
  gradsync::Status status;  // of the first failed call
  size_t wrong = 0;
  double time_us = 0;  // mean per timed iteration on this rank
};

// Buffers of one size, shared by both groups so that each size allocates (and first-touches)
// its memory once, before anything is timed.
struct Buffers {
  std::vector<uint64_t> send, recv;  // uint64_t: aligned for every element type
  Buffers(const Geometry& g, size_t esize);
};

Outcome run_group(gradsync::Communicator& comm, const Case& c, bool in_place, bool check,
                  int warmup, int iters, Buffers& buf, bool median = false);

// The bench's own bookkeeping uses only float32 sum allreduce, so that measuring the other
// collectives does not depend on them working.
gradsync::Status sync(gradsync::Communicator& comm);
// Every rank's `mine` (same length on every rank), rank-major. Values pass through float32:
// exact for integers below 2^24, 7 digits otherwise.
gradsync::Result<std::vector<double>> gather(gradsync::Communicator& comm,
                                             const std::vector<double>& mine);

}  // namespace bench
