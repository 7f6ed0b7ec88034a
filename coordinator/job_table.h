// The coordinator's state: registered nodes (with heartbeat leases) and jobs (with
// generations). Pure logic: no gRPC, no threads, no clock reads — every call that depends on
// time takes `now`, so tests drive it step by step. Not thread-safe; the service holds a
// mutex around it.
//
// Generation life cycle:   forming --all ranks in--> active --all nodes left--> finished
//                             |                         |
//                             +--deadline/abort/lost----+--abort/lost--> aborted
// A join for a job whose current generation is aborted or finished opens generation + 1.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "coordinator.pb.h"
#include "gradsync/status.h"

namespace gradsync::coordinator {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using Millis = std::chrono::milliseconds;

struct JobTableOptions {
  Millis lease{5000};                  // a node with no heartbeat for this long is lost
  Millis default_join_timeout{60000};  // used when a JoinJob request says timeout_ms = 0
};

// One JoinJob call: one node joining with all of its local ranks.
struct JoinRequest {
  std::string node_id;
  std::string job_id;
  std::string token;
  uint32_t world_size = 0;
  std::vector<uint32_t> ranks;
  std::vector<std::string> endpoints;  // one opaque blob per entry of `ranks`
  Millis timeout{0};                   // 0: JobTableOptions::default_join_timeout
};

struct JoinResult {
  uint64_t generation = 0;
  uint32_t world_size = 0;
};

// Identifies one pending JoinJob call until its outcome is taken.
using JoinTicket = uint64_t;

// An event addressed to one node's WatchEvents queue.
struct Delivery {
  std::string node_id;
  v1::Event event;
};

// "0-3,5,7,8": runs of three or more become ranges. Input need not be sorted.
std::string compress_ranks(std::vector<uint32_t> ranks);

class JobTable {
 public:
  explicit JobTable(JobTableOptions options);

  // --- nodes ---------------------------------------------------------------------------
  // Returns a fresh node id "<node_name>-<n>". A live node with the same node_name and
  // hostname is treated as a restarted daemon: it is dropped as lost.
  Result<std::string> register_node(const v1::NodeInfo& info, TimePoint now);
  Status heartbeat(const std::string& node_id, TimePoint now);  // NOT_FOUND: re-register
  bool has_node(const std::string& node_id) const;
  size_t node_count() const { return nodes_.size(); }
  // Nodes dropped because their lease expired, since start (for /metrics).
  uint64_t leases_expired() const { return leases_expired_; }
  Millis lease() const { return options_.lease; }

  // --- jobs ----------------------------------------------------------------------------
  // Claims the request's ranks. On success the call is pending: poll take_join_result().
  Result<JoinTicket> join(const JoinRequest& request, TimePoint now);
  // nullopt while the generation is still forming; afterwards the outcome (once).
  std::optional<Result<JoinResult>> take_join_result(JoinTicket ticket);
  // The caller went away (cancelled RPC, shutdown): releases its ranks if still forming.
  void withdraw(JoinTicket ticket, const std::string& why);
  Status leave(const std::string& node_id, const std::string& job_id, uint64_t generation);
  // node_id empty: an operator. generation 0: the current one. Idempotent.
  Status abort(const std::string& node_id, const std::string& job_id, uint64_t generation,
               const std::string& reason, int32_t failed_rank);
  // Records the data path of a rank `node_id` holds in the given (current) generation.
  Status report_path(const std::string& node_id, const std::string& job_id, uint64_t generation,
                     const v1::RankPath& path);
  // Expires leases and join deadlines.
  void tick(TimePoint now);

  // --- queries -------------------------------------------------------------------------
  Result<v1::PeerTableResponse> peer_table(const std::string& job_id, uint64_t generation) const;
  std::vector<v1::JobSummary> list_jobs() const;
  Result<v1::DescribeJobResponse> describe(const std::string& job_id) const;

  // --- side effects for the service ------------------------------------------------------
  std::vector<Delivery> take_events();            // in the order they happened
  std::vector<std::string> take_removed_nodes();  // nodes dropped since the last call

 private:
  enum class GenState { kForming, kActive, kAborted, kFinished };
  struct Node {
    v1::NodeInfo info;
    TimePoint last_heartbeat;
  };
  struct Claim {
    std::string node_id;
    std::string hostname;
    std::string endpoint;
    JoinTicket ticket = 0;
  };
  struct Joiner {  // a pending JoinJob call of a forming generation
    std::string node_id;
    std::vector<uint32_t> ranks;
    TimePoint deadline;
    Millis timeout{0};
  };
  struct Generation {
    uint64_t number = 1;
    GenState state = GenState::kForming;
    std::string token;
    uint32_t world_size = 0;
    std::map<uint32_t, Claim> claims;             // rank -> holder
    std::map<JoinTicket, Joiner> joiners;         // pending calls (forming only)
    std::map<std::string, v1::NodeInfo> members;  // node_id -> info at join time
    std::map<uint32_t, v1::RankPath> paths;       // rank -> its reported data path
    std::set<std::string> left;                   // members that called LeaveJob
    std::string reason;
    int32_t failed_rank = -1;
    std::string failed_node;
  };
  struct Job {
    std::string id;
    Generation gen;  // only the current generation is kept
  };

  static const char* state_name(GenState s);
  static std::string label(const Job& job);  // "job=train gen=2"
  static std::string node_label(const std::string& node_id, const std::string& hostname);
  std::string node_label(const std::string& node_id) const;  // "node n1-1 (host a)"
  Status check_registered(const std::string& node_id, const char* what) const;
  std::vector<uint32_t> ranks_of(const Generation& gen, const std::string& node_id) const;
  std::vector<uint32_t> ring_of(const Generation& gen) const;
  v1::JobSummary summary_of(const Job& job) const;

  void remove_joiner(Job& job, JoinTicket ticket);
  void activate(Job& job);
  // Marks the generation aborted, resolves its waiters with `waiter_status` and sends
  // JOB_ABORTED (preceded by NODE_LOST when `node_lost`) to every member node still registered.
  void fail(Job& job, const Status& waiter_status, const std::string& reason, int32_t failed_rank,
            const std::string& failed_node, bool node_lost = false);
  void lose_node(const std::string& node_id, const std::string& why);
  void expire_join_deadline(Job& job, TimePoint now);
  void emit(const std::string& node_id, v1::Event::Kind kind, const Job& job);

  JobTableOptions options_;
  uint64_t next_node_number_ = 1;
  JoinTicket next_ticket_ = 1;
  std::map<std::string, Node> nodes_;
  std::map<std::string, Job> jobs_;
  std::map<JoinTicket, std::string> pending_;  // ticket -> job id, while forming
  std::map<JoinTicket, Result<JoinResult>> outcomes_;
  std::vector<Delivery> events_;
  std::vector<std::string> removed_nodes_;
  uint64_t leases_expired_ = 0;
};

}  // namespace gradsync::coordinator
