#include "coordinator/regroup.h"

#include <algorithm>

#include "common/limits.h"
#include "common/secret.h"
#include "coordinator/job_table.h"

namespace gradsync::coordinator {
namespace {

// The longest a member or newcomer may ask to wait.
constexpr std::chrono::milliseconds kMaxWait{10 * 60 * 1000};
// A decided round is remembered this long, to refuse its late members by name.
constexpr std::chrono::minutes kRemember{10};
// Jobs regrouping at once; more is refused (each holds at most a world of entries).
constexpr size_t kMaxLineages = 4096;
// Newcomers waiting for one job's grow.
constexpr size_t kMaxWaitingNewcomers = 1024;

std::string ranks_text(const std::vector<int32_t>& ranks) {
  std::vector<uint32_t> r;
  for (int32_t x : ranks) {
    if (x >= 0) r.push_back(uint32_t(x));
  }
  return r.empty() ? "none" : compress_ranks(r);
}

std::string label(const std::string& job, uint64_t gen) {
  return "job=" + job + " regroup gen " + std::to_string(gen) + "->" + std::to_string(gen + 1);
}

}  // namespace

Result<RegroupTicket> RegroupTable::call(const RegroupCall& c, TimePoint now) {
  if (Status id = check_job_id(c.job); !id.ok()) return Status(id.code(), "Regroup: " + id.message());
  if (c.token.size() > kMaxTokenBytes) return Status(Code::kInvalidArgument, "Regroup job=" + c.job + ": token too long");
  if (c.wait.count() < 0 || c.wait > kMaxWait) {
    return Status(Code::kInvalidArgument, "Regroup job=" + c.job + ": wait of " + std::to_string(c.wait.count()) +
                                              " ms out of range (at most " + std::to_string(kMaxWait.count()) + ")");
  }
  auto it = jobs_.find(c.job);
  if (it == jobs_.end()) {
    if (jobs_.size() >= kMaxLineages) {
      return Status(Code::kUnavailable, "Regroup job=" + c.job + ": too many jobs regrouping at once");
    }
    it = jobs_.emplace(c.job, Lineage{}).first;
    it->second.token = c.token;
  }
  Lineage& l = it->second;
  if (!same_secret(l.token, c.token)) {
    return Status(Code::kPermissionDenied, "Regroup job=" + c.job + ": wrong token for the job");
  }
  if (!c.newcomer) return member_call(l, c, now);
  if (l.waiting.size() >= kMaxWaitingNewcomers) {
    return Status(Code::kUnavailable, "Regroup job=" + c.job + ": too many newcomers waiting");
  }
  const RegroupTicket t = next_ticket_++;
  l.waiting.push_back(Entry{t, c.node_id, -1, now + c.wait});
  maybe_decide(l, now);
  return t;
}

Result<RegroupTicket> RegroupTable::member_call(Lineage& l, const RegroupCall& c, TimePoint now) {
  const std::string who = label(c.job, c.from_generation) + " rank " + std::to_string(c.old_rank) + ": ";
  if (c.from_generation == 0 || c.old_world_size == 0 || c.old_world_size > kMaxWorldSize || c.old_rank < 0 ||
      uint32_t(c.old_rank) >= c.old_world_size || c.newcomers > kMaxWaitingNewcomers) {
    return Status(Code::kInvalidArgument, who + "generation, world size (" + std::to_string(c.old_world_size) +
                                              "), rank or newcomer count out of range");
  }
  if (l.decided_from != 0 && c.from_generation <= l.decided_from) {
    if (c.from_generation < l.decided_from) {
      return Status(Code::kFailedPrecondition, who + "generation " + std::to_string(c.from_generation) +
                                                   " is stale: the job regrouped from generation " +
                                                   std::to_string(l.decided_from) + " since");
    }
    const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(now - l.decided_at).count();
    return Status(Code::kFailedPrecondition,
                  who + "came " + std::to_string(ago) + " ms after the members of generation " +
                      std::to_string(c.from_generation + 1) + " were fixed without it (old ranks " +
                      ranks_text(l.decided_old_ranks) + "): it was later than the others' deadline");
  }
  if (l.open && l.open->from_generation != c.from_generation) {
    return Status(Code::kFailedPrecondition, who + "another regroup, from generation " +
                                                 std::to_string(l.open->from_generation) + ", is in progress");
  }
  if (!l.open) {
    Round r;
    r.from_generation = c.from_generation;
    r.old_world_size = c.old_world_size;
    r.opened = now;
    r.deadline = now + c.wait;
    l.open = std::move(r);
  }
  Round& r = *l.open;
  if (r.old_world_size != c.old_world_size) {
    return Status(Code::kInvalidArgument, who + "old world size " + std::to_string(c.old_world_size) +
                                              " differs from the other members' " + std::to_string(r.old_world_size));
  }
  if (r.members.count(c.old_rank)) {
    return Status(Code::kAlreadyExists, who + "rank " + std::to_string(c.old_rank) + " already called");
  }
  for (int32_t f : c.failed) {
    if (f >= 0 && uint32_t(f) < r.old_world_size && !r.members.count(f)) r.failed.insert(f);
  }
  r.failed.erase(c.old_rank);  // it is calling, so it is alive
  r.newcomers = std::max(r.newcomers, c.newcomers);
  const RegroupTicket t = next_ticket_++;
  r.members[c.old_rank] = Entry{t, c.node_id, c.old_rank, r.deadline};
  maybe_decide(l, now);
  return t;
}

void RegroupTable::maybe_decide(Lineage& l, TimePoint now) {
  if (!l.open) return;
  const Round& r = *l.open;
  const bool all_in = r.members.size() + r.failed.size() >= r.old_world_size;
  const bool enough_new = l.waiting.size() >= r.newcomers;
  if ((all_in && enough_new) || now >= r.deadline) decide(l, now);
}

void RegroupTable::decide(Lineage& l, TimePoint now) {
  Round r = std::move(*l.open);
  l.open.reset();
  std::vector<const Entry*> order;
  for (auto& [rank, e] : r.members) order.push_back(&e);  // std::map: old rank order
  std::vector<Entry> admitted;
  while (admitted.size() < r.newcomers && !l.waiting.empty()) {
    admitted.push_back(l.waiting.front());
    l.waiting.pop_front();
  }
  for (const Entry& e : admitted) order.push_back(&e);
  RegroupOutcome base;
  base.generation = r.from_generation + 1;
  base.world_size = uint32_t(order.size());
  for (const Entry* e : order) base.old_ranks.push_back(e->old_rank);
  std::map<std::string, uint32_t> per_node;
  for (const Entry* e : order) ++per_node[e->node_id];
  std::map<std::string, uint32_t> seen;
  for (uint32_t i = 0; i < order.size(); ++i) {
    RegroupOutcome o = base;
    o.rank = i;
    o.local_rank = seen[order[i]->node_id]++;
    o.local_world_size = per_node[order[i]->node_id];
    outcomes_.insert_or_assign(order[i]->ticket, Result<RegroupOutcome>(std::move(o)));
  }
  l.decided_from = r.from_generation;
  l.decided_old_ranks.clear();
  for (auto& [rank, e] : r.members) l.decided_old_ranks.push_back(rank);
  l.decided_at = now;
}

std::optional<Result<RegroupOutcome>> RegroupTable::take(RegroupTicket t) {
  auto it = outcomes_.find(t);
  if (it == outcomes_.end()) return std::nullopt;
  Result<RegroupOutcome> r = std::move(it->second);
  outcomes_.erase(it);
  return r;
}

void RegroupTable::withdraw(RegroupTicket t) {
  outcomes_.erase(t);
  for (auto& [job, l] : jobs_) {
    if (l.open) {
      for (auto it = l.open->members.begin(); it != l.open->members.end(); ++it) {
        if (it->second.ticket == t) {
          l.open->members.erase(it);
          if (l.open->members.empty()) l.open.reset();
          return;
        }
      }
    }
    auto w = std::find_if(l.waiting.begin(), l.waiting.end(), [&](const Entry& e) { return e.ticket == t; });
    if (w != l.waiting.end()) {
      l.waiting.erase(w);
      return;
    }
  }
}

void RegroupTable::tick(TimePoint now) {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Lineage& l = it->second;
    maybe_decide(l, now);
    for (auto w = l.waiting.begin(); w != l.waiting.end();) {
      if (w->deadline > now) {
        ++w;
        continue;
      }
      outcomes_.insert_or_assign(
          w->ticket, Result<RegroupOutcome>(Status(Code::kDeadlineExceeded,
                                                   "job=" + it->first + ": no grow admitted this newcomer (node " +
                                                       w->node_id + ") before its deadline; the members call grow() "
                                                                    "at a step boundary")));
      w = l.waiting.erase(w);
    }
    const bool idle = !l.open && l.waiting.empty();
    if (idle && (l.decided_from == 0 || now - l.decided_at > kRemember)) {
      it = jobs_.erase(it);
    } else {
      ++it;
    }
  }
}

std::optional<RegroupTable::TimePoint> RegroupTable::next_deadline() const {
  std::optional<TimePoint> next;
  auto consider = [&](TimePoint t) {
    if (!next || t < *next) next = t;
  };
  for (const auto& [job, l] : jobs_) {
    if (l.open) consider(l.open->deadline);
    for (const Entry& e : l.waiting) consider(e.deadline);
  }
  return next;
}

Result<RegroupOutcome> RegroupService::run(const RegroupCall& c, RegroupTable::TimePoint give_up,
                                           const std::function<bool()>& cancelled) {
  // Cancellation has no callback in the sync API: look at it this often.
  constexpr std::chrono::milliseconds kPoll{200};
  std::unique_lock lock(mu_);
  if (stopping_) return Status(Code::kUnavailable, "coordinator is shutting down");
  auto ticket = table_.call(c, RegroupTable::Clock::now());
  if (!ticket.ok()) return ticket.status();
  cv_.notify_all();  // this call may have decided a round others wait for
  for (;;) {
    if (auto outcome = table_.take(*ticket)) return std::move(*outcome);
    const auto now = RegroupTable::Clock::now();
    if (stopping_ || cancelled() || now >= give_up) {
      table_.withdraw(*ticket);
      return Status(stopping_ ? Code::kUnavailable : Code::kDeadlineExceeded,
                    "Regroup of job " + c.job + ": " +
                        (stopping_ ? "coordinator is shutting down" : "the call was cancelled or timed out"));
    }
    auto wake = std::min(give_up, now + kPoll);
    if (auto d = table_.next_deadline()) wake = std::min(wake, *d);
    cv_.wait_until(lock, wake);
    table_.tick(RegroupTable::Clock::now());
    cv_.notify_all();
  }
}

void RegroupService::stop() {
  std::lock_guard lock(mu_);
  stopping_ = true;
  cv_.notify_all();
}

}  // namespace gradsync::coordinator
