#include "coordinator/trace_gather.h"

namespace gradsync::coordinator {

uint64_t TraceGather::open(const std::string& job, uint64_t generation,
                           std::map<std::string, std::set<uint32_t>> nodes, uint32_t max_records) {
  std::lock_guard lock(mu_);
  const uint64_t id = next_id_++;
  Pending& p = pending_[id];
  p.job = job;
  p.generation = generation;
  p.max_records = max_records;
  p.nodes = std::move(nodes);
  return id;
}

void TraceGather::unreachable(uint64_t id, const std::string& node, const std::string& why) {
  std::lock_guard lock(mu_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  it->second.answered.insert(node);
  it->second.result.missing.push_back("node " + node + ": " + why);
  cv_.notify_all();
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
  cv_.notify_all();
  return Status::Ok();
}

TraceGather::Result TraceGather::wait(uint64_t id, std::chrono::steady_clock::time_point deadline,
                                      const std::function<bool()>& cancelled, std::chrono::milliseconds poll) {
  std::unique_lock lock(mu_);
  auto done = [&] {
    const Pending& p = pending_.at(id);
    return p.answered.size() >= p.nodes.size();
  };
  while (!done() && std::chrono::steady_clock::now() < deadline && !cancelled()) {
    cv_.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() + poll));
  }
  Pending p = std::move(pending_.at(id));
  pending_.erase(id);
  for (const auto& [node, ranks] : p.nodes) {
    if (!p.answered.count(node)) p.result.missing.push_back("node " + node + ": no answer in time");
  }
  return std::move(p.result);
}

}  // namespace gradsync::coordinator
