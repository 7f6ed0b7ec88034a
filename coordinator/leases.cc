#include "coordinator/leases.h"

#include <algorithm>

namespace gradsync::coordinator {

void Leases::add(const std::string& node_id, TimePoint now, Millis grace) {
  const uint64_t epoch = next_epoch_++;
  auto it = nodes_.insert_or_assign(node_id, Lease{now, stalled_, epoch, grace}).first;
  heap_.push({deadline(it->second), epoch, node_id});
}

bool Leases::renew(const std::string& node_id, TimePoint now) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return false;
  it->second.last = now;
  it->second.stalled_at_last = stalled_;  // its heap entry is now early: re-checked when it comes up
  if (it->second.grace.count() > 0) {  // the first renewal ends the grace: the deadline may come sooner
    it->second.grace = Millis{0};
    it->second.epoch = next_epoch_++;
    heap_.push({deadline(it->second), it->second.epoch, node_id});
  }
  return true;
}

void Leases::remove(const std::string& node_id) { nodes_.erase(node_id); }  // its heap entry dies lazily

std::vector<std::pair<std::string, Leases::Millis>> Leases::expire(TimePoint now) {
  std::vector<std::pair<std::string, Millis>> out;
  while (!heap_.empty() && std::get<0>(heap_.top()) <= now) {
    auto [when, epoch, id] = heap_.top();
    heap_.pop();
    auto it = nodes_.find(id);
    if (it == nodes_.end() || it->second.epoch != epoch) continue;  // removed, or added again
    const TimePoint due = deadline(it->second);
    if (due > now) {
      heap_.push({due, epoch, std::move(id)});
      continue;
    }
    auto silent = std::chrono::duration_cast<Millis>(now - it->second.last) - (stalled_ - it->second.stalled_at_last);
    out.emplace_back(std::move(id), silent);
    nodes_.erase(it);
  }
  return out;
}

void Leases::read_lag(Millis lag) {
  if (lag_ms_.size() < kMaxLagSamples) lag_ms_.push_back(lag.count());
}

Leases::Millis Leases::update_behind(TimePoint now, Millis slack) {
  if (window_start_ == TimePoint{}) window_start_ = now;
  if (lag_ms_.size() < kLagSamples && now - window_start_ < kLagWindow) return behind_;
  Millis median{0};
  if (!lag_ms_.empty()) {
    auto mid = lag_ms_.begin() + lag_ms_.size() / 2;
    std::nth_element(lag_ms_.begin(), mid, lag_ms_.end());
    median = Millis(*mid);
  }
  lag_ms_.clear();
  window_start_ = now;
  behind_ = median;
  const Millis over = std::max(Millis{0}, median - slack);
  if (over > extended_) stalled_ += over - extended_;
  extended_ = over;
  return behind_;
}

std::string Leases::expiry_reason(Millis silent) const {
  return "no heartbeat for " + std::to_string(silent.count()) + " ms (lease " + std::to_string(lease_.count()) + " ms)";
}

}  // namespace gradsync::coordinator
