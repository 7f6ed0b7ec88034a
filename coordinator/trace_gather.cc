#include "coordinator/trace_gather.h"

namespace gradsync::coordinator {

uint64_t TraceGather::open(const std::string& job, uint64_t generation,
                           std::map<std::string, std::set<uint32_t>> nodes, uint32_t max_records,
                           TimePoint deadline) {
  std::lock_guard lock(mu_);
  const uint64_t id = next_id_++;
  Pending& p = pending_[id];
  p.job = job;
  p.generation = generation;
  p.max_records = max_records;
  p.deadline = deadline;
  p.nodes = std::move(nodes);
  return id;
}

void TraceGather::unreachable(uint64_t id, const std::string& node, const std::string& why) {
  std::lock_guard lock(mu_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  it->second.answered.insert(node);
  it->second.result.missing.push_back("node " + node + ": " + why);
}

Status TraceGather::report(const v1::ReportTraceRequest& r) {
  std::lock_guard lock(mu_);
  auto it = pending_.find(r.request_id());
  if (it == pending_.end()) {
    return {Code::kNotFound, "ReportTrace: no trace request " + std::to_string(r.request_id()) +
                                 " is open (it timed out, or it was never made)"};
  }
  Pending& p = it->second;
  auto node = p.nodes.find(r.node_id());
  if (node == p.nodes.end() || r.job_id() != p.job || r.generation() != p.generation) {
    return {Code::kPermissionDenied, "ReportTrace: node " + r.node_id() + " was not asked for the flight recorders of " +
                                         r.job_id() + " generation " + std::to_string(r.generation())};
  }
  if (!p.answered.insert(r.node_id()).second) {
    return {Code::kAlreadyExists, "ReportTrace: node " + r.node_id() + " already answered request " +
                                      std::to_string(r.request_id())};
  }
  if (!r.error().empty()) p.result.missing.push_back("node " + r.node_id() + ": " + r.error());
  std::set<uint32_t> seen;
  for (const auto& t : r.ranks()) {
    if (!node->second.count(t.rank()) || !seen.insert(t.rank()).second) {
      p.result.missing.push_back("node " + r.node_id() + ": sent a recorder for rank " + std::to_string(t.rank()) +
                                 ", which it does not hold (ignored)");
      continue;
    }
    v1::RankTrace kept = t;
    kept.set_node_id(r.node_id());  // the node that answered, whatever the message says
    if (kept.records_size() > int(p.max_records)) {
      kept.mutable_records()->DeleteSubrange(0, kept.records_size() - int(p.max_records));
    }
    p.result.ranks.push_back(std::move(kept));
  }
  if (!r.dump_path().empty()) p.result.dumps.push_back("node " + r.node_id() + ": " + r.dump_path());
  return Status::Ok();
}

std::vector<std::pair<uint64_t, TraceGather::Result>> TraceGather::take_finished(TimePoint now) {
  std::lock_guard lock(mu_);
  std::vector<std::pair<uint64_t, Result>> out;
  for (auto it = pending_.begin(); it != pending_.end();) {
    Pending& p = it->second;
    if (p.answered.size() < p.nodes.size() && now < p.deadline) {
      ++it;
      continue;
    }
    for (const auto& [node, ranks] : p.nodes) {
      if (!p.answered.count(node)) p.result.missing.push_back("node " + node + ": no answer in time");
    }
    out.emplace_back(it->first, std::move(p.result));
    it = pending_.erase(it);
  }
  return out;
}

void TraceGather::cancel(uint64_t id) {
  std::lock_guard lock(mu_);
  pending_.erase(id);
}

size_t TraceGather::open_requests() const {
  std::lock_guard lock(mu_);
  return pending_.size();
}

}  // namespace gradsync::coordinator
