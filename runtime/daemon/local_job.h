// One job as this node sees it: its local ranks, the shared memory holding their channels,
// and the proxy pumps of its cross-node channels. Fields are guarded by Daemon's mutex;
// pumps only touch the shared memory and the atomics.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "channel/channel.h"
#include "channel/shared_memory.h"
#include "collectives/topology.h"
#include "coordinator.pb.h"
#include "daemon.pb.h"
#include "daemon/proxy.h"

namespace gradsync {
namespace verbs {
class MemoryRegion;
}

struct LocalMember {
  uint32_t rank = 0;
  uint32_t pid = 0;
  uint32_t local_rank = 0;
  bool left = false;       // sent Leave: its collectives are done
  bool connected = true;   // its connection to us is open
};

struct LocalJob {
  enum class State { kCollecting, kJoining, kReady, kFailed, kDone };

  std::string id;
  std::string token;
  uint32_t world_size = 0;
  uint32_t local_world_size = 0;
  State state = State::kCollecting;
  Deadline join_deadline;               // first local arrival + its join timeout
  Status failure;                       // why kFailed
  uint64_t generation = 0;
  std::map<uint32_t, LocalMember> members;  // by rank

  // Set once the coordinator completed the generation.
  std::vector<uint32_t> local_ranks;    // sorted
  std::shared_ptr<SharedMemory> shm;
  ShmLayout layout;
  uint32_t rings = 1;
  // From the coordinator's peer table (what this node needs; daemon/peer_layout.h).
  std::vector<uint32_t> ring;                 // ring order of every rank
  std::vector<uint32_t> rank_node;            // node number of every rank (ring order)
  std::vector<uint32_t> node_shape;           // node number -> index into `shapes`
  std::vector<v1::GpuTopology> shapes;        // the job's distinct GPU topologies
  std::map<uint32_t, std::string> hosts;      // hostnames of the ranks this node knows
  std::vector<v1::ChannelEndpoint> endpoints;  // by rank
  // Channel index of every edge with a local end: incoming (dst local) and staging (src
  // local, dst remote). Key: (tag, src, dst).
  using EdgeKey = std::tuple<uint32_t, uint32_t, uint32_t>;
  std::map<EdgeKey, uint32_t> incoming;
  std::map<EdgeKey, uint32_t> staging;
  // Connected sockets of rank-owned TCP channels (ChannelTransport::kTcpRank), by channel
  // index, until the local rank that owns the channel end takes them with its join reply.
  std::map<uint32_t, Fd> rank_sockets;
  // Incoming channels a peer daemon connected (by index): each accepts exactly one connection.
  std::set<uint32_t> connected;
  std::atomic<bool> stop{false};        // aborted or torn down: pumps exit
  std::atomic<bool> drain{false};       // every local rank left: senders flush, then Bye
  bool aborted = false;
  std::string abort_reason;  // the first abort's
  std::vector<std::unique_ptr<ChannelPump>> pumps;
  // The job's shared memory registered with the daemon's RDMA device (verbs channels only).
  // Declared after `shm`'s users; released after the pumps that post from it.
  std::shared_ptr<verbs::MemoryRegion> verbs_mr;

  std::string ids() const { return "job=" + id + " gen=" + std::to_string(generation); }
  bool is_local(uint32_t rank) const;
  // Lays out the channels of every edge with a local end, then a flight recorder of
  // `recorder_entries` per local rank (0: none); needs local_ranks and ring.
  // O(world) once, then O(local ranks).
  void plan_channels(uint32_t slots, uint32_t slot_bytes, uint32_t recorder_entries = 0);
  // Writes the recorders' headers into fresh (zeroed) shared memory.
  void init_recorders() const;
  // Channel set-up for one local rank.
  v1::ChannelSetup setup_for(uint32_t rank) const;
  // Marks the channels of `setup` that have a rank socket and moves those sockets out, in
  // the order ChannelRef.socket numbers them.
  std::vector<Fd> take_rank_sockets(v1::ChannelSetup* setup);
  std::string host_of(uint32_t rank) const;
  std::string peer_name(uint32_t rank) const;  // "rank 3 (host h, gradsyncd h:p)"
  // A local rank as the errors that blame it name it: "rank 0 (pid 123, host h)".
  std::string member_name(uint32_t rank, const std::string& host) const;
  bool all_left() const;
  // While collecting: the local ranks that have not come, assuming this node's ranks are
  // contiguous (rank - local_rank is the same for all), as launchers place them.
  std::string missing_local_ranks() const;
  bool all_disconnected() const;
};

}  // namespace gradsync
