// JobTable's durable records (coordinator/store.h): what a job's current generation and the
// registered nodes look like in the store, and the way back into an empty table.
#include <algorithm>

#include "common/log.h"
#include "coordinator/job_table.h"

namespace gradsync::coordinator {

std::optional<v1::StoredJob> JobTable::stored_job(const std::string& job_id) const {
  auto jit = jobs_.find(job_id);
  if (jit == jobs_.end()) return std::nullopt;
  const Generation& g = jit->second.gen;
  v1::StoredJob out;
  out.set_job_id(job_id);
  out.set_generation(g.number);
  out.set_state(state_name(g.state));
  out.set_reason(g.reason);
  out.set_failed_rank(g.failed_rank);
  out.set_failed_node(g.failed_node);
  if (g.state == GenState::kForming) return out;  // its joins die with this coordinator
  out.set_token(g.token);
  out.set_world_size(g.world_size);
  for (const auto& [rank, claim] : g.claims) {
    v1::StoredClaim* c = out.add_claims();
    c->set_rank(rank);
    c->set_node_id(claim.node_id);
    c->set_hostname(claim.hostname);
    c->set_endpoint(claim.endpoint);
  }
  for (const auto& [node_id, member] : g.members) {
    v1::StoredMember* m = out.add_members();
    m->set_node_id(node_id);
    *m->mutable_info() = member.info;
    *m->mutable_offer() = member.offer;
    for (uint32_t r : member.ranks) m->add_ranks(r);
    m->set_left(g.left.count(node_id) != 0);
  }
  for (const auto& [rank, path] : g.paths) *out.add_paths() = path;
  return out;
}

Status JobTable::restore(const std::vector<v1::StoredNode>& nodes, const std::vector<v1::StoredJob>& jobs,
                         uint64_t next_node_number) {
  if (!nodes_.empty() || !jobs_.empty()) {
    return {Code::kFailedPrecondition, "JobTable::restore: the table is not empty"};
  }
  auto bad = [](const std::string& what) {
    return Status(Code::kInternal, "the store's records are inconsistent: " + what +
                                       " (written by another gradsync version, or edited by hand?)");
  };
  next_node_number_ = std::max<uint64_t>(next_node_number, 1);
  for (const auto& n : nodes) {
    if (n.node_id().empty() || nodes_.count(n.node_id())) return bad("node id '" + n.node_id() + "'");
    nodes_[n.node_id()] = Node{n.info()};
    by_name_[{n.info().node_name(), n.info().hostname()}] = n.node_id();
    // Ids end in a counter that must never be handed out again.
    const size_t dash = n.node_id().rfind('-');
    if (dash != std::string::npos) {
      const uint64_t number = std::strtoull(n.node_id().c_str() + dash + 1, nullptr, 10);
      next_node_number_ = std::max(next_node_number_, number + 1);
    }
  }
  for (const auto& r : jobs) {
    if (r.job_id().empty() || jobs_.count(r.job_id())) return bad("job id '" + r.job_id() + "'");
    Job job{r.job_id(), {}};
    Generation& g = job.gen;
    g.number = std::max<uint64_t>(r.generation(), 1);
    g.reason = r.reason();
    g.failed_rank = r.failed_rank();
    g.failed_node = r.failed_node();
    const std::string& state = r.state();
    g.state = state == "active"     ? GenState::kActive
              : state == "aborted"  ? GenState::kAborted
              : state == "finished" ? GenState::kFinished
                                    : GenState::kForming;
    if (g.state != GenState::kForming) {
      g.token = r.token();
      g.world_size = r.world_size();
      for (const auto& c : r.claims()) {
        if (c.rank() >= g.world_size) return bad("job " + r.job_id() + " rank " + std::to_string(c.rank()));
        g.claims[c.rank()] = Claim{c.node_id(), c.hostname(), c.endpoint(), 0};
      }
      for (const auto& m : r.members()) {
        Member& member = g.members[m.node_id()];
        member.info = m.info();
        member.offer = m.offer();
        member.ranks.assign(m.ranks().begin(), m.ranks().end());
        if (m.left()) g.left.insert(m.node_id());
      }
      for (const auto& p : r.paths()) g.paths[p.rank()] = p;
      if (g.claims.size() != g.world_size) {
        return bad("job " + r.job_id() + " holds " + std::to_string(g.claims.size()) + " of " +
                   std::to_string(g.world_size) + " ranks");
      }
      for (const auto& [rank, claim] : g.claims) {
        if (!g.members.count(claim.node_id)) return bad("job " + r.job_id() + " rank " + std::to_string(rank));
      }
      lay_out(g);
      // A member the store no longer lists was lost while its record was being written.
      for (const auto& [node_id, member] : g.members) {
        if (g.state == GenState::kActive && !nodes_.count(node_id) && !g.left.count(node_id)) {
          g.state = GenState::kAborted;
          g.reason = node_label(node_id, member.info.hostname()) +
                     " was not registered when this coordinator took over (lost before the change)";
          g.failed_node = node_id;
          g.failed_rank = member.ranks.empty() ? -1 : int32_t(member.ranks.front());
          touch(job);
        }
      }
    }
    log::get("coordinator")->info("restored {} ({}, {} rank(s) on {} node(s))", label(job), state_name(g.state),
                                  g.world_size, g.members.size());
    jobs_.emplace(r.job_id(), std::move(job));
  }
  return Status::Ok();
}

}  // namespace gradsync::coordinator
