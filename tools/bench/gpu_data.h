// The data of gradsync-bench --device cuda (bench/gpu.cc): one row's buffers, its inputs (a
// rank-dependent pattern of small integers whose reductions are exact in every type), the
// expected results with their tolerances, and the checks of what came back; and the
// interface of the two implementations the table compares (gradsync, NCCL).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#ifdef GRADSYNC_BENCH_NCCL
#include <nccl.h>
#endif

#include "bench/collective.h"
#include "gradsync/gradsync.h"

namespace bench {

using gradsync::DataType;
using gradsync::ReduceOp;

inline bool reduces(Collective c) {
  return c == Collective::kAllreduce || c == Collective::kReduceScatter;
}

// One row of the table: its buffers and its data.
struct Row {
  Collective collective = Collective::kAllreduce;
  DataType type;
  ReduceOp op;
  int root = 0;  // broadcast
  int rank = 0;
  size_t esize = 0;
  size_t count = 0;  // the call's count argument (per rank for reduce_scatter and all_gather)
  size_t bytes = 0;  // the printed size: the full buffer
  size_t send_elems = 0, recv_elems = 0;
  size_t alloc = 0;   // bytes of each device buffer: the larger of send and recv (in-place layouts)
  double bus_factor = 1;  // busbw = algbw * bus_factor
  size_t period = 1;  // the inputs repeat every `period` elements of the send buffer
  void* d_send = nullptr;
  void* d_recv = nullptr;
  std::vector<uint8_t> in;    // this rank's input, send_elems long (broadcast: the root's data)
  std::vector<uint8_t> out;   // scratch for copies back
  std::vector<double> want;   // reductions: one period of the expected result
  std::vector<double> tol;    // allowed |got - want| per element of the period
  std::vector<std::vector<double>> inputs;  // copies: one period of every rank's input
};

// Fills row.in (this rank's input, repeated every `period` elements of the whole send
// buffer, so that reduce_scatter's segments differ) and one period of the expected result:
// the reduction (allreduce, reduce_scatter), or every rank's input (the others, whose inputs
// follow the sum pattern: small integers that differ between ranks).
void make_data(Row& w, int rank, int n);

// Elements of got (the recv buffer, recv_elems of them) that differ from the expected result.
size_t count_wrong(const Row& w, const void* got);

// Elements of got (a send buffer) that are not bit-equal to this rank's input.
size_t count_changed(const Row& w, const uint8_t* got);

// row.out = a device buffer's worth (alloc bytes) of v (exact in every type).
void fill_constant(Row& w, int v);

// One implementation of the collectives: queue one call of the row's collective on the
// stream; the first asynchronous error. Both return "" when fine, else what went wrong.
struct Library {
  const char* name;
  bool one_buffer_broadcast;  // broadcast(buf): no out-of-place form (gradsync)
  std::function<std::string(const Row&, const void* send, void* recv)> call;
  std::function<std::string()> async_error;
};

// One group (a library, out-of-place or in-place) of one row on this rank.
struct Cell {
  bool ran = false;
  bool failed = false;
  size_t wrong = 0;
  double time_us = 0;
};
constexpr int kCells = 4;  // gradsync out-of-place, in-place, NCCL out-of-place, in-place
constexpr int kFields = 5;  // per cell through gather: time, wrong (two halves), failed, ran
constexpr double kHalf = 1 << 20;

inline std::string time_str(double us) {  // nccl-tests' widths
  char b[32];
  std::snprintf(b, sizeof b, us >= 10000 ? "%7.0f" : us >= 100 ? "%7.1f" : "%7.2f", us);
  return b;
}

#ifdef GRADSYNC_BENCH_NCCL
ncclDataType_t nccl_type(DataType t);
ncclRedOp_t nccl_op(ReduceOp op);
#endif

}  // namespace bench
