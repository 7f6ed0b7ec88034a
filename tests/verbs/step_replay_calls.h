// The calls of the one-node step replay test on the GPU (node_gpu_test.cc, OneNodeStepReplay)
// and on the CPU (gdr_link_sequence_test.cc): in-place int32 allreduces on one buffer, each
// feeding the next, with counts, ops and protocols (low-latency at 37 and 1001 elements, bulk
// at 300001) interleaved so that most calls repeat an earlier one.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradsync/gradsync.h"

namespace gradsync::step_replay {

struct Call {
  size_t count;
  ReduceOp op;
};
inline constexpr Call kCalls[] = {{1001, ReduceOp::kSum},  {1001, ReduceOp::kSum},   {37, ReduceOp::kMax},
                                  {1001, ReduceOp::kSum},  {300001, ReduceOp::kMax}, {37, ReduceOp::kMax},
                                  {300001, ReduceOp::kMax}, {1001, ReduceOp::kSum},  {37, ReduceOp::kMax}};
inline constexpr size_t kCap = 300001;  // elements of each rank's buffer

// Rank r's element i before the first call.
inline int32_t initial(int r, size_t i) { return int32_t(r + int(i % 5)); }

// The host's reduction of call `c` over every rank's buffer: after it every rank holds it.
inline void reduce_on_host(const Call& c, std::vector<std::vector<int32_t>>& v) {
  for (size_t i = 0; i < c.count; ++i) {
    int32_t x = v[0][i];
    for (size_t r = 1; r < v.size(); ++r) x = c.op == ReduceOp::kSum ? x + v[r][i] : std::max(x, v[r][i]);
    for (auto& b : v) b[i] = x;
  }
}

}  // namespace gradsync::step_replay
