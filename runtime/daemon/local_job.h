// One job as this node sees it: its local ranks, the shared memory holding their channels,
// and the proxy pumps of its cross-node channels. Fields are guarded by Daemon's mutex;
// pumps only touch the shared memory and the atomics.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "channel/channel.h"
#include "channel/shared_memory.h"
#include "coordinator.pb.h"
#include "daemon.pb.h"
#include "daemon/proxy.h"

namespace gradsync {

struct LocalMember {
  uint32_t rank = 0;
  uint32_t pid = 0;
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
  Status failure;                       // why kFailed
  uint64_t generation = 0;
  std::map<uint32_t, LocalMember> members;  // by rank

  // Set when the job reaches kJoining.
  std::vector<uint32_t> local_ranks;    // sorted; index = local channel index
  std::shared_ptr<SharedMemory> shm;
  ShmLayout layout;
  v1::PeerTableResponse table;
  std::atomic<bool> stop{false};        // aborted or torn down: pumps exit
  std::atomic<bool> drain{false};       // every local rank left: senders flush, then Bye
  bool aborted = false;
  std::vector<std::unique_ptr<Pump>> pumps;

  std::string ids() const { return "job=" + id + " gen=" + std::to_string(generation); }
  int local_index(uint32_t rank) const;
  // Channel set-up for one local rank (ring neighbours from `table`).
  v1::ChannelSetup setup_for(uint32_t rank) const;
  std::string host_of(uint32_t rank) const;
  std::string peer_name(uint32_t rank) const;  // "rank 3 (host h, gradsyncd h:p)"
  bool all_left() const;
  bool all_disconnected() const;
};

}  // namespace gradsync
