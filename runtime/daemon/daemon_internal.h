// What the Daemon's files (daemon.cc, daemon_jobs.cc, daemon_failures.cc) share: the
// daemon's deadlines and a few helpers. Internal to gradsyncd.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "common/log.h"
#include "daemon/daemon.h"

namespace gradsync {
namespace daemon_internal {

// How long a peer daemon's channel connection may wait for this node's side of the job.
inline constexpr std::chrono::milliseconds kPeerAcceptTimeout{30'000};
// The least time the coordinator is given to complete a join whose local ranks came late.
inline constexpr std::chrono::milliseconds kMinCoordinatorJoin{1'000};
// How long local ranks wait past their deadline for the leader's coordinator answer; less than
// the slack trainers add to their own deadline (Session::join), so they get the answer.
inline constexpr std::chrono::milliseconds kLeaderSlack{3'000};
// How long a finished job may take to flush its last slots to peers before it is cut.
inline constexpr std::chrono::milliseconds kDrainTimeout{30'000};
// How long a connection on the trainer socket may stay silent before it joined a job, and how
// long a peer daemon may take to send its Hello.
inline constexpr std::chrono::milliseconds kIdleBeforeJoin{10'000};
inline constexpr std::chrono::milliseconds kHelloTimeout{10'000};
// How long a connection thread that served one waits for the next before it ends: threads are
// reused across a burst (a job's ranks connecting), and a flood's are gone soon after it.
inline constexpr std::chrono::milliseconds kConnectionThreadLinger{10'000};
// How long ~Daemon waits for its connection threads to see their peers hang up.
inline constexpr std::chrono::milliseconds kThreadExitWait{10'000};
// How long a channel that lost its peer waits for the reason the peer's daemon may have given
// the coordinator, before it reports the lost connection as the job's failure.
inline constexpr std::chrono::milliseconds kPeerAbortGrace{500};
// How long a pump's failure handler waits to learn whether the peer daemon still accepts
// connections (probe_daemon), within the grace above.
inline constexpr std::chrono::milliseconds kPeerProbeTimeout{200};
// ... and how often it probes again while the grace lasts.
inline constexpr std::chrono::milliseconds kPeerProbeEvery{50};
// The peer daemons probed at most each time the coordinator is found unreachable for longer
// than the lease (Daemon::coordinator_unreachable), each for kPeerProbeTimeout.
inline constexpr size_t kMaxCutOffProbes = 8;

inline std::shared_ptr<spdlog::logger> dlog() { return log::get("daemon"); }

inline v1::DaemonMessage error_message(const Status& s) {
  v1::DaemonMessage m;
  m.mutable_error()->set_code(static_cast<uint32_t>(s.code()));
  m.mutable_error()->set_message(s.message());
  return m;
}

inline Status write_file_atomically(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << text << "\n";
    if (!f) return {Code::kInternal, "cannot write " + tmp};
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return {Code::kInternal, errno_string("rename")};
  return Status::Ok();
}

// How a channel from a rank on node `src` to a rank on node `dst` moves its slots: both
// daemons of the channel compute this from the endpoints they exchanged, so they agree.
inline ChannelTransport channel_transport(const v1::ChannelEndpoint& src, const v1::ChannelEndpoint& dst) {
  if (src.transport() == "verbs" && dst.transport() == "verbs") return ChannelTransport::kVerbs;
  if (src.rank_sockets() && dst.rank_sockets()) return ChannelTransport::kTcpRank;
  return ChannelTransport::kTcp;
}


}  // namespace daemon_internal
}  // namespace gradsync
