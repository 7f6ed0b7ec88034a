// The trainer's side of the daemon protocol (proto/daemon.proto) as plain structs, encoded and
// decoded without libprotobuf: libgradsync.so carries nanopb's generated tables for the
// messages below (proto/nanopb/*.options say which) and Debian's nanopb runtime, so a trainer's
// `ldd` shows no protobuf. gradsyncd keeps protobuf's C++ classes; the bytes on the socket are
// the same (tests/unit/daemon_wire_test.cc checks both directions).
//
// Decoding is bounded: the daemon is another process, so every string, every repeated field
// and the frame itself have a limit, and a reply that breaks one is refused whole.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "gradsync/status.h"

namespace gradsync::wire {

// Limits of what a daemon's reply may hold (the frame itself is bounded by kMaxFrameBytes).
constexpr size_t kMaxNameBytes = 1024;          // node names, hostnames, device names, paths
constexpr size_t kMaxErrorBytes = 64 * 1024;    // an ErrorResponse's message
constexpr size_t kMaxChannelRefs = 1u << 20;    // channel ends of one rank

// --- trainer -> daemon (ClientMessage) --------------------------------------------------
struct AttachRequest {
  uint32_t pid = 0;
  uint32_t protocol_version = 0;
};
struct JoinRequest {
  std::string job_id, token;
  uint32_t rank = 0, world_size = 0, local_rank = 0, local_world_size = 0, timeout_ms = 0;
};
struct LeaveRequest {};
struct AbortRequest {
  std::string reason;
  bool failure = false;
  int32_t culprit = 0;
};
struct PathReport {
  std::string path, why;
  uint64_t gpu_memory_bytes = 0, pinned_host_bytes = 0;  // the rank's communicator's memory
};
struct TraceDumpRequest {
  std::string reason;
};
struct RegroupRequest {  // coordinator.proto's, carried by the daemon
  std::string node_id, job_id, token;
  uint64_t from_generation = 0;
  uint32_t old_world_size = 0;
  int32_t old_rank = 0;
  std::vector<int32_t> failed;
  bool newcomer = false;
  uint32_t newcomers = 0;
  uint32_t wait_ms = 0;
};
using ClientMessage = std::variant<AttachRequest, JoinRequest, LeaveRequest, AbortRequest, PathReport,
                                   TraceDumpRequest, RegroupRequest>;

// --- daemon -> trainer (DaemonMessage) --------------------------------------------------
struct AttachResponse {
  std::string node_name, hostname;
  uint32_t protocol_version = 0;
};
struct ChannelRef {
  uint32_t tag = 0, peer = 0;
  bool send = false;
  uint32_t index = 0;
  bool remote = false;
  uint32_t socket = 0;
};
struct ChannelSetup {
  uint64_t shm_bytes = 0;
  uint32_t slots = 0, slot_bytes = 0, num_channels = 0, rings = 0;
  std::vector<ChannelRef> channels;
  uint32_t recorders = 0, recorder_entries = 0, recorder_index = 0;
};
struct VerbsDevice {
  std::string device;
  uint32_t port = 0;
  int32_t gid_index = 0;
  std::string api;
  // Per GPU of the node, its rail's RDMA device or "" (topology/rail_devices.h, whose bounds
  // the decoder holds it to: kMaxRailDevices entries of kMaxRailDeviceName bytes at most).
  std::vector<std::string> rail_devices;
};
// JoinResponse's node_shape and shapes (the job's GPU topologies) are skipped: nothing in the
// library reads them yet.
struct JoinResponse {
  uint64_t generation = 0;
  std::vector<uint32_t> ring;
  std::vector<std::string> rank_hosts;
  ChannelSetup setup;
  std::optional<VerbsDevice> verbs;
  std::vector<uint32_t> rank_node;
  std::string data_host;  // this node's gradsyncd's advertised data address
};
struct LeaveResponse {};
struct ErrorResponse {
  uint32_t code = 0;
  std::string message;
};
struct RegroupResponse {
  uint64_t generation = 0;
  uint32_t world_size = 0, rank = 0, local_rank = 0, local_world_size = 0;
  std::vector<int32_t> old_ranks;
};
using DaemonMessage = std::variant<AttachResponse, JoinResponse, LeaveResponse, ErrorResponse, RegroupResponse>;

// The serialized ClientMessage (a frame's body, common/framing.h).
Result<std::string> encode(const ClientMessage& msg);
// A DaemonMessage with exactly one body; kInternal naming the field when the bytes are not
// one, or break a limit above (per-rank lists: at most kMaxWorldSize entries, common/limits.h).
Result<DaemonMessage> decode(std::string_view bytes);
// A ChannelSetup alone (tests hand a daemon-side setup to build_links through it).
Result<ChannelSetup> decode_channel_setup(std::string_view bytes);

}  // namespace gradsync::wire
