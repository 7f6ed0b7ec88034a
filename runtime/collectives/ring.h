// Ring AllReduce over two channels (design §4): reduce-scatter then all-gather, pipelined in
// slot-sized pieces. Pure logic over channels: the same code runs with ranks as threads in
// tests, with shared-memory neighbours and with the daemon's proxy in between.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "channel/channel.h"
#include "gradsync/gradsync.h"

namespace gradsync {

// Who this rank is in the ring, and how to name its neighbours in errors.
struct RingPeers {
  std::string job;
  int rank = 0;
  int world_size = 1;
  int position = 0;  // index of `rank` in the ring order
  int prev_rank = 0;
  int next_rank = 0;
  std::string prev_host;
  std::string next_host;
};

struct CollectiveCall {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  DataType type = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  uint32_t seq = 0;  // this communicator's collective number: checked against the peers'
};

// Identifies kind/type/op so that mismatched calls are caught instead of reduced.
uint32_t collective_signature(const CollectiveCall& call);

// Checks a call before anything is sent: null buffers, overflowing sizes, unknown types/ops.
Status validate_allreduce(const CollectiveCall& call);

Status ring_allreduce(const RingPeers& peers, Channel& send, Channel& recv, const WaitContext& wait,
                      const CollectiveCall& call);

}  // namespace gradsync
