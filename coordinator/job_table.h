// The coordinator's state: registered nodes and jobs (with generations); their heartbeat
// leases live in coordinator/leases.h, apart, so a heartbeat never waits for this table.
// Pure logic: no gRPC, no threads, no clock reads — every call that depends on time takes
// `now`, so tests drive it step by step. Not thread-safe; the service holds a mutex around it.
//
// Cost: a join is O(its ranks x log world); the generation's layout (ring, runs, shapes, the
// channel agreement) is built once, O(world), when its last rank joins; a peer-table page is
// O(what the node needs); nothing per request walks every rank or every node.
//
// Generation life cycle:   forming --all ranks in--> active --all nodes left--> finished
//                             |                         |
//                             +--deadline/abort/lost----+--abort/lost--> aborted
// A join for a job whose current generation is aborted or finished opens generation + 1.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "coordinator.pb.h"
#include "coordinator_store.pb.h"
#include "coordinator/job_layout.h"
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
  v1::ChannelOffer offer;              // rings 0: none
};

// Bounds on one page of a peer table or a DescribeJob, so no message grows with the job:
// at 4096 entries of about 100 bytes a page stays far below gRPC's 4 MiB.
constexpr uint32_t kPageEntries = 4096;
constexpr uint32_t kPageRuns = 4096;
constexpr uint32_t kPageShapes = 16;
constexpr uint32_t kPageNodes = 256;

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
  // hostname is a restarted daemon, dropped as lost, unless it has the same non-zero
  // incarnation: then it is the same daemon retrying, and gets its id again.
  Result<std::string> register_node(const v1::NodeInfo& info, TimePoint now);
  bool has_node(const std::string& node_id) const;
  size_t node_count() const { return nodes_.size(); }
  Millis lease() const { return options_.lease; }
  // The node's lease expired (coordinator/leases.h): drops it and aborts its live jobs.
  // `node_id` by value: callers pass strings this erases (the by-name index's entry).
  void lose_node(std::string node_id, const std::string& why);

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
  // Expires join deadlines: O(jobs) when none is due.
  void tick(TimePoint now);

  // --- queries -------------------------------------------------------------------------
  // Page `page` of what `node_id` needs (v1::PeerTableRequest); with `ranks`, those ranks'
  // entries instead (at most kPageEntries).
  Result<v1::PeerTableResponse> peer_table(const std::string& job_id, uint64_t generation,
                                           const std::string& node_id, uint32_t page = 0,
                                           const std::vector<uint32_t>& ranks = {}) const;
  // Whether `node_id` holds ranks in the job's current generation. O(log nodes).
  bool is_member(const std::string& job_id, const std::string& node_id) const;
  std::vector<v1::JobSummary> list_jobs() const;
  Result<v1::DescribeJobResponse> describe(const std::string& job_id, uint32_t page = 0) const;
  // The ranks each node holds in the job's current generation, with its summary (TraceJob):
  // O(world), an operator's call.
  struct Holders {
    v1::JobSummary summary;
    std::map<std::string, std::set<uint32_t>> nodes;  // node id -> its ranks
  };
  Result<Holders> holders(const std::string& job_id) const;
  // Pending JoinJob calls resolved since the last call (take each with take_join_result).
  std::vector<JoinTicket> take_resolved() { return std::exchange(resolved_, {}); }

  // --- side effects for the service ------------------------------------------------------
  std::vector<Delivery> take_events();            // in the order they happened
  std::vector<std::string> take_removed_nodes();  // nodes dropped since the last call

  // --- durable state (coordinator/store.h; defined in job_table_store.cc) -----------------
  // Jobs whose record changed since the last call: generations that completed, failed,
  // finished, were left or got a path. A join into a forming generation is not a change: a
  // forming generation is stored without its claims.
  std::vector<std::string> take_dirty_jobs() { return std::exchange(dirty_jobs_, {}); }
  // The job's record; nullopt when there is no such job.
  std::optional<v1::StoredJob> stored_job(const std::string& job_id) const;
  uint64_t next_node_number() const { return next_node_number_; }
  // Fills an empty table from a store's records: the nodes keep their ids, the jobs their
  // generations (layouts rebuilt; forming generations come back empty, their daemons join
  // again). No events are sent. Records that contradict each other are refused.
  Status restore(const std::vector<v1::StoredNode>& nodes, const std::vector<v1::StoredJob>& jobs,
                 uint64_t next_node_number);

 private:
  enum class GenState { kForming, kActive, kAborted, kFinished };
  struct Node {
    v1::NodeInfo info;
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
  struct Member {
    v1::NodeInfo info;               // at join time
    v1::ChannelOffer offer;
    std::vector<uint32_t> ranks;     // held in this generation, ascending
  };
  struct Generation {
    uint64_t number = 1;
    GenState state = GenState::kForming;
    std::string token;
    uint32_t world_size = 0;
    std::map<uint32_t, Claim> claims;             // rank -> holder
    std::map<JoinTicket, Joiner> joiners;         // pending calls (forming only)
    std::set<std::pair<TimePoint, JoinTicket>> deadlines;  // of the joiners, earliest first
    std::map<std::string, Member> members;        // node_id -> its part
    std::shared_ptr<const JobLayout> layout;      // built once, when the last rank joins
    v1::JobAgreement agreement;                   // the members' offers, folded at completion
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
  static void fill_entry(const Generation& gen, uint32_t rank, v1::PeerEntry* out);
  v1::JobSummary summary_of(const Job& job) const;

  void remove_joiner(Job& job, JoinTicket ticket);
  void activate(Job& job);
  void lay_out(Generation& g);  // the layout and agreement of a generation whose ranks are all in
  void touch(const Job& job) { dirty_jobs_.push_back(job.id); }
  // Marks the generation aborted, resolves its waiters with `waiter_status` and sends
  // JOB_ABORTED (preceded by NODE_LOST when `node_lost`) to every member node still registered.
  void fail(Job& job, const Status& waiter_status, const std::string& reason, int32_t failed_rank,
            const std::string& failed_node, bool node_lost = false);
  void resolve(JoinTicket ticket, Result<JoinResult> outcome);
  void expire_join_deadline(Job& job, TimePoint now);
  void emit(const std::string& node_id, v1::Event::Kind kind, const Job& job);

  JobTableOptions options_;
  uint64_t next_node_number_ = 1;
  JoinTicket next_ticket_ = 1;
  std::map<std::string, Node> nodes_;
  std::map<std::pair<std::string, std::string>, std::string> by_name_;  // (node_name, hostname) -> id
  std::map<std::string, Job> jobs_;
  std::map<JoinTicket, std::string> pending_;  // ticket -> job id, while forming
  std::map<JoinTicket, Result<JoinResult>> outcomes_;
  std::vector<Delivery> events_;
  std::vector<std::string> removed_nodes_;
  std::vector<JoinTicket> resolved_;
  std::vector<std::string> dirty_jobs_;  // may repeat; the service writes each once
};

}  // namespace gradsync::coordinator
