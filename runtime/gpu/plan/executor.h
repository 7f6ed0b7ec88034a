// Runs the step lists of schedule.h on host memory, every rank of a shape in one thread, with
// the host reduction loops (kernels/host_reduce.h) and bounded message queues per directed
// hop (the slots of a channel), and counts the bytes each rank sends and receives on each
// link class. The CPU stand-in for the device kernels: it checks a schedule exactly (every
// message's count against the receiving step, no step left waiting: a deadlock is reported
// with the ranks that wait), and gives the byte counts the cost model and the tests use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gpu/plan/schedule.h"
#include "gradsync/gradsync.h"

namespace gradsync::plan {

// Payload bytes per link class.
struct LinkBytes {
  std::vector<uint64_t> intra_sent;  // per rank: to ranks of its own node
  std::vector<uint64_t> intra_recv;  // per rank: from ranks of its own node
  std::vector<uint64_t> inter_sent;  // per rank: to other nodes
  std::vector<std::vector<uint64_t>> nic_sent;  // per node, per NIC
  std::vector<std::vector<uint64_t>> nic_recv;  // per node, per NIC

  explicit LinkBytes(const JobShape& shape);
  uint64_t max_intra_sent() const;
  uint64_t total_intra_sent() const;
  uint64_t node_nic_sent(int node) const;  // summed over its NICs
  uint64_t node_nic_recv(int node) const;
  uint64_t max_nic() const;  // the busiest NIC of any node, either direction
};

// Adds `rank`'s steps to `bytes`: what it sends (intra-node per rank, inter-node per NIC of
// its node) and what it receives (per NIC of its node, intra per rank). Moves no data, so it
// takes symbolic sizes (gradsync-bench --simulate). Counting every rank's steps counts each
// message once on each side.
void count_bytes(const JobShape& shape, const ChannelSet& channels, int rank,
                 const std::vector<Step>& steps, size_t esize, LinkBytes* bytes);

struct RankBuffers {
  std::vector<unsigned char> in;   // the call's input (broadcast: only the root's is read)
  std::vector<unsigned char> out;  // the call's output
};

struct ExecOptions {
  size_t slots = 2;  // messages a directed hop holds before its sender waits
};

// Runs `steps[r]` for every rank r of `shape`; `bufs` hold every rank's input and output,
// sized by the caller. Returns kMismatch where a message's count differs from the receiving
// step's, kInternal where a step names a hop its channel lacks or the schedule deadlocks or
// ends with messages nobody received; the message names rank, channel, step and peer.
Status execute(const JobShape& shape, const ChannelSet& channels,
               const std::vector<std::vector<Step>>& steps, DataType type, ReduceOp op,
               const ExecOptions& opts, std::vector<RankBuffers>* bufs, LinkBytes* bytes);

}  // namespace gradsync::plan
