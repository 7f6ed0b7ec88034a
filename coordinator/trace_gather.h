// Gathering a job's flight recorders for gradsyncctl trace: the coordinator asks each member
// node's daemon (a TRACE_REQUESTED event), the daemons answer with ReportTrace, and TraceJob
// returns what came before its deadline, naming the nodes that did not answer.
//
// Its own mutex: a TraceJob waiting here holds nothing of the service's table. The answers
// come from daemons, so each is checked: a request this coordinator opened, a node it asked
// once, the job and generation asked about, only ranks that node holds, at most the records
// asked for.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "coordinator.pb.h"
#include "gradsync/status.h"

namespace gradsync::coordinator {

class TraceGather {
 public:
  struct Result {
    std::vector<v1::RankTrace> ranks;
    std::vector<std::string> missing;  // "node n: why"
    std::vector<std::string> dumps;    // "node n: path"
  };

  // Opens a request to `nodes` (node id -> the ranks it holds); returns its id.
  uint64_t open(const std::string& job, uint64_t generation, std::map<std::string, std::set<uint32_t>> nodes,
                uint32_t max_records);
  // A node that cannot be asked (no event queue): counted as answered, with `why`.
  void unreachable(uint64_t id, const std::string& node, const std::string& why);
  // A daemon's answer.
  Status report(const v1::ReportTraceRequest& r);
  // Waits until every node answered, `deadline` passed or `cancelled()`; closes the request.
  // Wakes every `poll` to look at `cancelled`.
  Result wait(uint64_t id, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& cancelled,
              std::chrono::milliseconds poll = std::chrono::milliseconds(100));

 private:
  struct Pending {
    std::string job;
    uint64_t generation = 0;
    uint32_t max_records = 0;
    std::map<std::string, std::set<uint32_t>> nodes;
    std::set<std::string> answered;
    Result result;
  };

  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Pending> pending_;
};

}  // namespace gradsync::coordinator
