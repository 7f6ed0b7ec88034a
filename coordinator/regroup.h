// Elastic membership at the coordinator (proto RegroupRequest, gradsync/elastic.h): the ranks
// of one generation of a job agree on the members of the next one (shrink after a failure,
// grow to admit newcomers), and every caller gets the same answer.
//
// A round opens with the first member's call and is decided once:
//   - at once, when every rank of the old generation has called or is known failed (a member
//     names the ranks it knows failed: the job's culprit) and as many newcomers as any member
//     asked for are waiting;
//   - else at the first member's deadline (its wait), with the members that called by then.
// New ranks: the members in their old order, then newcomers in arrival order. A member that
// calls after its round was decided is refused, naming the set it missed; a newcomer waits
// (up to its own deadline) for a round that asks for newcomers, so a shrink never admits one.
//
// RegroupTable is pure logic (time is passed in, no threads); RegroupService adds the lock
// and the blocking wait the gRPC handler needs, apart from the job table's lock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gradsync/status.h"

namespace gradsync::coordinator {

struct RegroupCall {
  std::string node_id;
  std::string job;              // the base job id
  std::string token;
  uint64_t from_generation = 0; // members: the generation they leave (>= 1)
  uint32_t old_world_size = 0;  // members
  int32_t old_rank = -1;        // members: >= 0; newcomers: -1
  std::vector<int32_t> failed;  // ranks the member knows failed
  bool newcomer = false;
  uint32_t newcomers = 0;       // grow: newcomers to wait for
  std::chrono::milliseconds wait{0};
};

struct RegroupOutcome {
  uint64_t generation = 0;
  uint32_t world_size = 0;
  uint32_t rank = 0;
  uint32_t local_rank = 0;
  uint32_t local_world_size = 0;
  std::vector<int32_t> old_ranks;  // per new rank; -1 for a newcomer
};

using RegroupTicket = uint64_t;

class RegroupTable {
 public:
  using Clock = std::chrono::steady_clock;
  using TimePoint = Clock::time_point;

  // Refusals (bad input, a wrong token, a late or duplicate member) come back at once; else
  // the call waits: poll take().
  Result<RegroupTicket> call(const RegroupCall& c, TimePoint now);
  // nullopt while undecided; afterwards the outcome (once).
  std::optional<Result<RegroupOutcome>> take(RegroupTicket t);
  // The caller went away before its round was decided.
  void withdraw(RegroupTicket t);
  // Decides rounds whose deadline passed, times out newcomers, forgets old lineages.
  void tick(TimePoint now);
  // The earliest deadline of an open round or a waiting newcomer.
  std::optional<TimePoint> next_deadline() const;

 private:
  struct Entry {
    RegroupTicket ticket = 0;
    std::string node_id;
    int32_t old_rank = -1;
    TimePoint deadline;  // newcomers: when they give up
  };
  struct Round {
    uint64_t from_generation = 0;
    uint32_t old_world_size = 0;
    std::set<int32_t> failed;
    std::map<int32_t, Entry> members;  // by old rank
    uint32_t newcomers = 0;
    TimePoint opened;
    TimePoint deadline;
  };
  struct Lineage {  // one base job's generations
    std::string token;
    std::optional<Round> open;
    uint64_t decided_from = 0;  // the last decided round's from_generation; 0: none
    std::vector<int32_t> decided_old_ranks;
    TimePoint decided_at;
    std::deque<Entry> waiting;  // newcomers
  };

  Result<RegroupTicket> member_call(Lineage& l, const RegroupCall& c, TimePoint now);
  void maybe_decide(Lineage& l, TimePoint now);
  void decide(Lineage& l, TimePoint now);

  RegroupTicket next_ticket_ = 1;
  std::map<std::string, Lineage> jobs_;
  std::map<RegroupTicket, Result<RegroupOutcome>> outcomes_;
};

// The table behind a lock, with the blocking wait of one call.
class RegroupService {
 public:
  // Blocks until the caller's round is decided, `give_up` passes, `cancelled()` says so, or
  // stop() is called.
  Result<RegroupOutcome> run(const RegroupCall& c, RegroupTable::TimePoint give_up,
                             const std::function<bool()>& cancelled);
  void stop();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  RegroupTable table_;
  bool stopping_ = false;
};

}  // namespace gradsync::coordinator
