// Collective calls and the channel ends one rank uses to run them (design §4). Pure logic
// over channels: the same code runs with ranks as threads in tests, with shared-memory
// neighbours, and with the daemon's proxy in between.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "channel/channel.h"
#include "collectives/topology.h"
#include "gradsync/gradsync.h"

namespace gradsync {

enum class CollectiveKind : uint8_t {
  kAllreduce = 1,
  kReduceScatter = 2,
  kAllGather = 3,
  kBroadcast = 4,
  kBarrier = 5,
};
const char* to_string(CollectiveKind kind);

struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kAllreduce;
  const void* send = nullptr;
  void* recv = nullptr;
  // allreduce/broadcast: elements of the buffer; reduce_scatter: elements received per rank;
  // all_gather: elements sent per rank.
  size_t count = 0;
  DataType type = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  Algorithm algorithm = Algorithm::kAuto;  // resolved to ring or tree before running
  uint32_t seq = 0;  // this communicator's collective number: checked against the peers'
};

// Identifies kind/type/op/root so that mismatched calls are caught instead of combined.
uint32_t collective_signature(const CollectiveCall& call);
std::string describe(const CollectiveCall& call);

// Checks a call before anything is sent: null or misaligned buffers, overflowing sizes,
// unknown types/ops/kinds, a root outside the world.
Status validate(const CollectiveCall& call, int world_size, int rank);

// Everything one rank knows about its communicator's links.
struct RankLinks {
  std::string job;
  int rank = 0;
  int world_size = 1;
  std::vector<uint32_t> ring;        // ring order of ranks
  int position = 0;                  // index of `rank` in `ring`
  std::vector<std::string> hosts;    // hostname by rank, for errors
  uint32_t rings = 1;
  // Threads that drive a large call's rings; 0: GRADSYNC_RING_THREADS, else by the cores (ring.cc).
  uint32_t ring_threads = 0;
  // Channel ends, by ring or tree index. Unused ends are default (null) channels.
  std::vector<Channel> ring_send, ring_recv;
  Channel up_send[kNumTrees];                  // to the parent
  Channel up_recv[kNumTrees][2];               // from each child
  Channel down_recv[kNumTrees];                // from the parent
  Channel down_send[kNumTrees][2];             // to each child
  TreeLinks trees[kNumTrees];
  // Moves the channels whose other end is a socket this rank owns; null when it owns none.
  // Every channel above points at it (Channel::set_driver).
  std::shared_ptr<ChannelDriver> driver;

  int prev_rank() const { return int(ring[(position + world_size - 1) % world_size]); }
  int next_rank() const { return int(ring[(position + 1) % world_size]); }
  std::string name(int rank) const;  // "rank 3 (host h)"
};

// Runs one resolved call (algorithm ring or tree) to completion or failure.
Status run_collective(const RankLinks& links, const WaitContext& wait, const CollectiveCall& call);

// The culprit of a failed call as far as this rank knows it: the peer whose connection broke,
// or -1 when it is not known (a deadline: the peer waited for may itself be waiting; a
// mismatch: either side may be the odd one).
int failed_peer(const RankLinks& links, const Status& s);

}  // namespace gradsync
