// gradsyncd's /metrics (Prometheus text 0.0.4, served by common/metrics_server.h when
// --metrics-listen is given). The ranks' counters come from their flight recorder regions in
// the jobs' shared memory (trainers open no port); a finished job's last values are kept
// (the last kRetainedJobs jobs), so a scrape after the job still sees its totals.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "channel/flight_recorder.h"

namespace gradsync {

// One local rank's counters, as read from its region.
struct RankCounters {
  std::string job;
  uint64_t generation = 0;
  uint32_t rank = 0;
  std::string transport;  // this node's for cross-node channels: tcp or verbs
  StatsCopy stats;
};

// A live job as /metrics shows it.
struct JobGauge {
  std::string job;
  std::string state;  // collecting, joining, ready, failed, done, aborted
  uint32_t incoming = 0, staging = 0;  // channels with a local end
  std::string transport;
};

class DaemonMetrics {
 public:
  static constexpr size_t kRetainedJobs = 64;

  // An error the daemon saw: kind (rank_exit, rank_abort, peer_channel, coordinator_abort,
  // join) and the peer it concerns ("rank 3", "gradsyncd h:p", "").
  void error(const std::string& kind, const std::string& peer);
  // A job whose memory is about to go: its ranks' last counters are kept.
  void retire(std::vector<RankCounters> ranks);
  // The byte counters of the proxy's channels to and from one peer daemon (created once).
  std::shared_ptr<std::atomic<uint64_t>> pumped(const std::string& peer_daemon, bool sent);

  // `live`: the counters of the running jobs' ranks; `jobs`: their states and channels.
  std::string render(const std::vector<RankCounters>& live, const std::vector<JobGauge>& jobs) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, uint64_t> errors_;
  std::deque<std::vector<RankCounters>> retired_;
  std::map<std::pair<std::string, bool>, std::shared_ptr<std::atomic<uint64_t>>> pumped_;
};

}  // namespace gradsync
