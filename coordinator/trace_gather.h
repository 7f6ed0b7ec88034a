// Gathering a job's flight recorders for gradsyncctl trace: the coordinator asks each member
// node's daemon (a TRACE_REQUESTED event), the daemons answer with ReportTrace, and TraceJob
// returns what came before its deadline, naming the nodes that did not answer.
//
// No call waits here: the service opens a request, feeds it the daemons' answers, and
// answers TraceJob when take_finished() hands the request back (every node answered, or its
// deadline passed). Its own mutex, so a report never waits for the service's table. The
// answers come from daemons, so each is checked: a request this coordinator opened, a node it
// asked once, the job and generation asked about, only ranks that node holds, at most the
// records asked for.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "coordinator.pb.h"
#include "gradsync/status.h"

namespace gradsync::coordinator {

class TraceGather {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  struct Result {
    std::vector<v1::RankTrace> ranks;
    std::vector<std::string> missing;  // "node n: why"
    std::vector<std::string> dumps;    // "node n: path"
  };

  // Opens a request to `nodes` (node id -> the ranks it holds), answered by `deadline`;
  // returns its id.
  uint64_t open(const std::string& job, uint64_t generation, std::map<std::string, std::set<uint32_t>> nodes,
                uint32_t max_records, TimePoint deadline);
  // A node that cannot be asked (no event queue): counted as answered, with `why`.
  void unreachable(uint64_t id, const std::string& node, const std::string& why);
  // A daemon's answer.
  Status report(const v1::ReportTraceRequest& r);
  // Closes and returns the requests that every node answered or whose deadline is past `now`,
  // naming the nodes that did not answer.
  std::vector<std::pair<uint64_t, Result>> take_finished(TimePoint now);
  // Closes a request whose caller went away.
  void cancel(uint64_t id);
  size_t open_requests() const;

 private:
  struct Pending {
    std::string job;
    uint64_t generation = 0;
    uint32_t max_records = 0;
    TimePoint deadline;
    std::map<std::string, std::set<uint32_t>> nodes;
    std::set<std::string> answered;
    Result result;
  };

  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Pending> pending_;
};

}  // namespace gradsync::coordinator
