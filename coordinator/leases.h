// Heartbeat leases of registered nodes, apart from the job table so that a heartbeat never
// waits behind a join or a peer table. A heartbeat is O(1) (a hash-map store); expiry is a
// min-heap of deadlines with at most one entry per node, re-checked lazily when it comes up,
// so an idle coordinator with thousands of nodes does O(expiring nodes) work per tick.
//
// Lease expiry measures the node, not the coordinator. Two kinds of the coordinator's own
// delay are added to every lease, so a busy coordinator never declares a node lost for
// heartbeats it did not get to:
//  - time it was stalled (its ticker ran late: no CPU, swapped out, stopped in a debugger);
//  - how far its reads are behind: messages that wait unread in gRPC's queues and the socket
//    buffers while its two callback threads work through a herd of registrations, joins or
//    peer tables. Each stream heartbeat carries its sender's clock (WatchRequest.sent_ms);
//    how much later than its stream's best a heartbeat is read is one sample of that delay
//    (read_lag), and the median of the samples of a window is the estimate (update_behind).
//    A rise of the estimate past a slack is added to every lease; a fall takes nothing back,
//    so a lease is never shorter than the node's own silence plus the lease.
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

  // `grace` is added to the node's first lease only, until its first renewal.
  void add(const std::string& node_id, TimePoint now, Millis grace = Millis{0});
  bool renew(const std::string& node_id, TimePoint now);  // false: not registered
  void remove(const std::string& node_id);
  bool has(const std::string& node_id) const { return nodes_.count(node_id) != 0; }
  size_t size() const { return nodes_.size(); }
  // The coordinator was stalled for `d`: every lease is extended by it. Its reads fell behind by
  // as much meanwhile, so a rise of the estimate up to `d` is not added again (update_behind).
  void stalled(Millis d) {
    stalled_ += d;
    extended_ += d;
  }
  Millis stalled_total() const { return stalled_; }
  // A heartbeat was read `lag` later than the best read of its stream: one sample.
  void read_lag(Millis lag);
  // Called every tick: once a window has kLagSamples samples or is kLagWindow old, its median
  // becomes the estimate of how far reads are behind (0 for a window without any), and every
  // lease is extended by the estimate's rise past `slack`. Returns the estimate.
  Millis update_behind(TimePoint now, Millis slack);
  Millis behind() const { return behind_; }
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
    Millis grace{0};         // until the first renewal
  };
  TimePoint deadline(const Lease& l) const { return l.last + lease_ + l.grace + (stalled_ - l.stalled_at_last); }
  using Due = std::tuple<TimePoint, uint64_t, std::string>;

  static constexpr size_t kLagSamples = 32;        // a window is judged once it has these
  static constexpr Millis kLagWindow{1000};          // or is this old
  static constexpr size_t kMaxLagSamples = 1 << 16;  // kept while the ticker is late

  const Millis lease_;
  Millis stalled_{0};
  std::vector<int64_t> lag_ms_;  // this window's samples
  TimePoint window_start_{};
  Millis behind_{0};             // the last window's median
  Millis extended_{0};           // how much of behind_ (past the slack) the leases already got
  uint64_t next_epoch_ = 1;
  std::unordered_map<std::string, Lease> nodes_;
  std::priority_queue<Due, std::vector<Due>, std::greater<>> heap_;  // one entry per node
};

}  // namespace gradsync::coordinator
