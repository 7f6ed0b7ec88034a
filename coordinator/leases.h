// Heartbeat leases of registered nodes, apart from the job table so that a heartbeat never
// waits behind a join or a peer table. A heartbeat is O(1) (a hash-map store); expiry is a
// min-heap of deadlines with at most one entry per node, re-checked lazily when it comes up,
// so an idle coordinator with thousands of nodes does O(expiring nodes) work per tick.
//
// Lease expiry measures the node, not the coordinator: time the coordinator itself was
// stalled (its ticker ran late: no CPU, swapped out, stopped in a debugger) is added to every
// lease, so a busy coordinator never declares a node lost for heartbeats it did not get to.
// Pure logic with `now` passed in; not thread-safe (the service holds its own mutex).
#pragma once

#include <chrono>
#include <cstdint>
#include <queue>
#include <tuple>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gradsync::coordinator {

class Leases {
 public:
  using Clock = std::chrono::steady_clock;
  using TimePoint = Clock::time_point;
  using Millis = std::chrono::milliseconds;

  explicit Leases(Millis lease) : lease_(lease) {}

  void add(const std::string& node_id, TimePoint now);
  bool renew(const std::string& node_id, TimePoint now);  // false: not registered
  void remove(const std::string& node_id);
  bool has(const std::string& node_id) const { return nodes_.count(node_id) != 0; }
  size_t size() const { return nodes_.size(); }
  // The coordinator was stalled for `d`: every lease is extended by it.
  void stalled(Millis d) { stalled_ += d; }
  Millis stalled_total() const { return stalled_; }
  // Removes and returns the nodes whose lease ran out, with how long each was silent
  // (stalls not counted), oldest first.
  std::vector<std::pair<std::string, Millis>> expire(TimePoint now);
  Millis lease() const { return lease_; }
  // Why an expired node is lost: "no heartbeat for N ms (lease L ms)".
  std::string expiry_reason(Millis silent) const;

 private:
  struct Lease {
    TimePoint last;
    Millis stalled_at_last;  // stalled_ when `last` was recorded
    uint64_t epoch;          // of its one heap entry; older entries are dropped when they come up
  };
  TimePoint deadline(const Lease& l) const { return l.last + lease_ + (stalled_ - l.stalled_at_last); }
  using Due = std::tuple<TimePoint, uint64_t, std::string>;

  const Millis lease_;
  Millis stalled_{0};
  uint64_t next_epoch_ = 1;
  std::unordered_map<std::string, Lease> nodes_;
  std::priority_queue<Due, std::vector<Due>, std::greater<>> heap_;  // one entry per node
};

}  // namespace gradsync::coordinator
