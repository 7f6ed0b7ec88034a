#include "coordinator/job_table.h"

#include <algorithm>
#include <utility>

#include "common/limits.h"
#include "common/log.h"
#include "common/secret.h"
#include "coordinator/agreement.h"
#include "topology/topology_summary.h"

namespace gradsync::coordinator {
namespace {

Status invalid(const std::string& msg) { return {Code::kInvalidArgument, msg}; }

// "rank 3" or "ranks 2,3": messages read as sentences.
std::string ranks_phrase(const std::vector<uint32_t>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + compress_ranks(ranks);
}

}  // namespace

std::string compress_ranks(std::vector<uint32_t> ranks) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ',';
    if (j - i >= 2) {  // three or more in a row: a range
      out += std::to_string(ranks[i]) + "-" + std::to_string(ranks[j]);
    } else {
      for (size_t k = i; k <= j; ++k) out += (k > i ? "," : "") + std::to_string(ranks[k]);
    }
    i = j + 1;
  }
  return out;
}

JobTable::JobTable(JobTableOptions options) : options_(options) {}

// --- helpers ------------------------------------------------------------------------------

const char* JobTable::state_name(GenState s) {
  switch (s) {
    case GenState::kForming:
      return "forming";
    case GenState::kActive:
      return "active";
    case GenState::kAborted:
      return "aborted";
    case GenState::kFinished:
      return "finished";
  }
  return "unknown";
}

std::string JobTable::label(const Job& job) {
  return "job=" + job.id + " gen=" + std::to_string(job.gen.number);
}

std::string JobTable::node_label(const std::string& node_id, const std::string& hostname) {
  return "node " + node_id + " (host " + (hostname.empty() ? "?" : hostname) + ")";
}

std::string JobTable::node_label(const std::string& node_id) const {
  auto it = nodes_.find(node_id);
  return node_label(node_id, it == nodes_.end() ? "" : it->second.info.hostname());
}

Status JobTable::check_registered(const std::string& node_id, const char* what) const {
  if (nodes_.count(node_id)) return Status::Ok();
  return {Code::kNotFound,
          std::string(what) + ": node '" + node_id +
              "' is not registered with the coordinator (its lease of " +
              std::to_string(options_.lease.count()) +
              " ms expired, or the coordinator restarted); the daemon must RegisterNode again"};
}

std::vector<uint32_t> JobTable::ranks_of(const Generation& gen, const std::string& node_id) const {
  auto it = gen.members.find(node_id);
  return it == gen.members.end() ? std::vector<uint32_t>{} : it->second.ranks;
}

void JobTable::fill_entry(const Generation& gen, uint32_t rank, v1::PeerEntry* out) {
  const Claim& claim = gen.claims.at(rank);
  out->set_rank(rank);
  out->set_node_id(claim.node_id);
  out->set_hostname(claim.hostname);
  out->set_endpoint(claim.endpoint);
}

v1::JobSummary JobTable::summary_of(const Job& job) const {
  v1::JobSummary s;
  s.set_job_id(job.id);
  s.set_generation(job.gen.number);
  s.set_state(state_name(job.gen.state));
  s.set_world_size(job.gen.world_size);
  s.set_joined(static_cast<uint32_t>(job.gen.claims.size()));
  s.set_reason(job.gen.reason);
  return s;
}

void JobTable::emit(const std::string& node_id, v1::Event::Kind kind, const Job& job) {
  if (!nodes_.count(node_id)) return;  // a lost node has no queue
  v1::Event ev;
  ev.set_kind(kind);
  ev.set_job_id(job.id);
  ev.set_generation(job.gen.number);
  ev.set_reason(job.gen.reason);
  ev.set_failed_rank(job.gen.failed_rank);
  ev.set_failed_node(job.gen.failed_node);
  events_.push_back({node_id, std::move(ev)});
}

// --- nodes --------------------------------------------------------------------------------

Result<std::string> JobTable::register_node(const v1::NodeInfo& info, TimePoint now) {
  std::string name = !info.node_name().empty()  ? info.node_name()
                     : !info.hostname().empty() ? info.hostname()
                                                : "node";
  // The GPU topology is kept and shown to operators: refuse one that breaks its bounds.
  if (Status s = topology::check_summary(info.gpu_topology()); !s.ok()) {
    return Status(s.code(), "registration of node " + name + " (host " + info.hostname() + ", pid " +
                                std::to_string(info.pid()) + ") refused: " + s.message());
  }
  const auto key = std::make_pair(name, info.hostname());
  if (auto same = by_name_.find(key); same != by_name_.end()) {
    const v1::NodeInfo& old = nodes_.at(same->second).info;
    if (info.incarnation() != 0 && old.incarnation() == info.incarnation()) {
      // The same daemon again: its earlier RegisterNode timed out at the daemon after the
      // coordinator had answered it. Not a restart; it keeps its id.
      log::get("coordinator")->info("node={} registered again (a retry of the same daemon, pid {})", same->second, info.pid());
      return same->second;
    }
  }
  std::string id = name + "-" + std::to_string(next_node_number_++);
  // The suffix after the last '-' is a counter that is never reused, so ids never collide.
  if (auto same = by_name_.find(key); same != by_name_.end()) {
    lose_node(same->second, "its daemon registered again as " + id + " (restarted?)");
  }
  Node node{info};
  node.info.set_node_name(name);
  nodes_.emplace(id, std::move(node));
  by_name_[key] = id;
  log::get("coordinator")
      ->info("registered node={} host={} pid={} data={} lease_ms={}", id, info.hostname(),
             info.pid(), info.data_endpoint(), options_.lease.count());
  (void)now;
  return id;
}

bool JobTable::has_node(const std::string& node_id) const { return nodes_.count(node_id) != 0; }

void JobTable::lose_node(std::string node_id, const std::string& why) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return;
  const std::string host = it->second.info.hostname();
  auto name = by_name_.find({it->second.info.node_name(), host});
  if (name != by_name_.end() && name->second == node_id) by_name_.erase(name);
  nodes_.erase(it);
  removed_nodes_.push_back(node_id);
  log::get("coordinator")->warn("lost node={} host={}: {}", node_id, host, why);
  for (auto& [id, job] : jobs_) {
    Generation& g = job.gen;
    bool live = g.state == GenState::kForming || g.state == GenState::kActive;
    if (!live || !g.members.count(node_id) || g.left.count(node_id)) continue;
    std::vector<uint32_t> ranks = ranks_of(g, node_id);
    std::string reason = node_label(node_id, host) + " lost: " + why + "; " + ranks_phrase(ranks);
    int32_t failed_rank = ranks.empty() ? -1 : static_cast<int32_t>(ranks.front());
    fail(job, {Code::kAborted, label(job) + " aborted: " + reason}, reason, failed_rank, node_id,
         /*node_lost=*/true);
  }
}

// --- jobs ---------------------------------------------------------------------------------

Result<JoinTicket> JobTable::join(const JoinRequest& r, TimePoint now) {
  const std::string where = "JoinJob job=" + r.job_id + " node=" + r.node_id + ": ";
  if (r.job_id.empty()) return invalid("JoinJob node=" + r.node_id + ": job_id is empty");
  if (Status id = check_job_id(r.job_id); !id.ok()) return invalid("JoinJob node=" + r.node_id + ": " + id.message());
  if (r.world_size == 0) return invalid(where + "world_size must be at least 1");
  if (r.token.size() > kMaxTokenBytes) {
    return invalid(where + "token longer than " + std::to_string(kMaxTokenBytes) + " bytes");
  }
  if (r.token.empty() && r.ranks.size() < r.world_size) {
    return Status(Code::kPermissionDenied,
                  where + "a job over several nodes needs a job token ($GRADSYNC_JOB_TOKEN or gradsyncrun "
                          "--token-file), the same on every node: without one anyone could join it");
  }
  if (r.world_size > kMaxWorldSize) {
    return invalid(where + "world_size " + std::to_string(r.world_size) + " exceeds the limit of " +
                   std::to_string(kMaxWorldSize));
  }
  if (r.ranks.empty())
    return invalid(where + "no ranks given; a node joins with the ranks it hosts");
  if (r.endpoints.size() != r.ranks.size()) {
    return invalid(where + std::to_string(r.ranks.size()) + " ranks but " +
                   std::to_string(r.endpoints.size()) +
                   " endpoints; every rank needs exactly one endpoint blob");
  }
  std::set<uint32_t> seen;
  for (uint32_t rank : r.ranks) {
    if (rank >= r.world_size) {
      return invalid(where + "rank " + std::to_string(rank) + " is out of range for world_size " +
                     std::to_string(r.world_size) + " (valid ranks are 0-" +
                     std::to_string(r.world_size - 1) + ")");
    }
    if (!seen.insert(rank).second) {
      return invalid(where + "rank " + std::to_string(rank) + " appears twice in the request");
    }
  }
  GS_RETURN_IF_ERROR(check_registered(r.node_id, "JoinJob"));

  // Check against the generation this join would enter, before changing anything.
  auto jit = jobs_.find(r.job_id);
  std::set<JoinTicket> superseded;
  if (jit != jobs_.end()) {
    Job& job = jit->second;
    const Generation& g = job.gen;
    bool open = g.state == GenState::kForming || g.state == GenState::kActive;
    // A join that cannot be part of a forming generation (another token or world size) fails
    // it for every node at once: their ranks would otherwise wait for their join deadline.
    auto refuse_forming = [&](Status why) {
      if (g.state == GenState::kForming) {
        const std::string reason = why.message() + "; the join of " + label(job) + " is refused for every node";
        fail(job, {why.code(), reason}, reason, -1, r.node_id, false);
      }
      return why;
    };
    if (open && !g.claims.empty()) {
      const Claim& first = g.claims.begin()->second;
      if (!same_secret(g.token, r.token)) {
        return refuse_forming(Status(Code::kPermissionDenied,
                                     "wrong token for job " + job.id + " (gen " + std::to_string(g.number) +
                                         ") from " + node_label(r.node_id) + ": " +
                                         node_label(first.node_id, first.hostname) +
                                         " joined with a different token; every node must use the job's token"));
      }
      if (g.world_size != r.world_size) {
        return refuse_forming(invalid(where + "world_size " + std::to_string(r.world_size) +
                                      " does not match world_size " + std::to_string(g.world_size) + " of " +
                                      label(job) + " set by " + node_label(first.node_id, first.hostname) +
                                      "; every node must be started with the same WORLD_SIZE"));
      }
      for (uint32_t rank : r.ranks) {
        auto c = g.claims.find(rank);
        if (c == g.claims.end()) continue;
        if (g.state == GenState::kForming && c->second.node_id == r.node_id) {
          superseded.insert(c->second.ticket);  // the same daemon retrying its join
          continue;
        }
        std::string msg = label(job) + ": rank " + std::to_string(rank) + " is already held by " +
                          node_label(c->second.node_id, c->second.hostname);
        msg += g.state == GenState::kActive
                   ? "; the generation is active: abort it (AbortJob) or let every node leave "
                     "before joining again"
                   : "; two nodes were given the same RANK (check the launcher's rank "
                     "assignment)";
        return Status(Code::kAlreadyExists, msg);
      }
    }
  }

  if (jit == jobs_.end()) jit = jobs_.emplace(r.job_id, Job{r.job_id, {}}).first;
  Job& job = jit->second;
  Generation& g = job.gen;
  if (g.state == GenState::kAborted || g.state == GenState::kFinished) {
    uint64_t next = g.number + 1;
    g = Generation{};
    g.number = next;
  }
  for (JoinTicket old : superseded) {
    resolve(old, Status(Code::kAborted, label(job) + ": this JoinJob from node " + r.node_id +
                                            " was superseded by a newer JoinJob from the same node"));
    remove_joiner(job, old);
  }
  if (g.claims.empty()) {  // the first joiner of a generation sets its token and size
    g.token = r.token;
    g.world_size = r.world_size;
  }
  const JoinTicket ticket = next_ticket_++;
  const Millis timeout = r.timeout.count() > 0 ? r.timeout : options_.default_join_timeout;
  const v1::NodeInfo& info = nodes_.at(r.node_id).info;
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    g.claims[r.ranks[i]] = Claim{r.node_id, info.hostname(), r.endpoints[i], ticket};
  }
  Member& member = g.members[r.node_id];
  member.info = info;
  member.offer = r.offer;
  member.ranks.insert(member.ranks.end(), r.ranks.begin(), r.ranks.end());
  std::sort(member.ranks.begin(), member.ranks.end());
  g.left.erase(r.node_id);
  g.joiners[ticket] = Joiner{r.node_id, r.ranks, now + timeout, timeout};
  g.deadlines.insert({now + timeout, ticket});
  pending_[ticket] = job.id;
  log::get("coordinator")
      ->debug("{} node={} joined {} ({}/{} in)", label(job), r.node_id, ranks_phrase(r.ranks),
              g.claims.size(), g.world_size);
  if (g.claims.size() == g.world_size) activate(job);
  return ticket;
}

void JobTable::remove_joiner(Job& job, JoinTicket ticket) {
  Generation& g = job.gen;
  auto jt = g.joiners.find(ticket);
  if (jt == g.joiners.end()) return;
  const Joiner& joiner = jt->second;
  for (uint32_t rank : joiner.ranks) {
    auto c = g.claims.find(rank);
    if (c != g.claims.end() && c->second.ticket == ticket) g.claims.erase(c);
  }
  if (auto m = g.members.find(joiner.node_id); m != g.members.end()) {
    auto& ranks = m->second.ranks;
    std::vector<uint32_t> gone = joiner.ranks;
    std::sort(gone.begin(), gone.end());
    std::vector<uint32_t> kept;
    std::set_difference(ranks.begin(), ranks.end(), gone.begin(), gone.end(), std::back_inserter(kept));
    ranks = std::move(kept);
    if (ranks.empty()) g.members.erase(m);
  }
  g.deadlines.erase({joiner.deadline, ticket});
  g.joiners.erase(jt);
  pending_.erase(ticket);
  if (g.claims.empty()) {  // nobody left: the next joiner sets token and size afresh
    g.token.clear();
    g.world_size = 0;
  }
}

void JobTable::resolve(JoinTicket ticket, Result<JoinResult> outcome) {
  outcomes_.insert_or_assign(ticket, std::move(outcome));
  resolved_.push_back(ticket);
}

std::optional<Result<JoinResult>> JobTable::take_join_result(JoinTicket ticket) {
  auto it = outcomes_.find(ticket);
  if (it == outcomes_.end()) return std::nullopt;
  Result<JoinResult> out = std::move(it->second);
  outcomes_.erase(it);
  return out;
}

void JobTable::withdraw(JoinTicket ticket, const std::string& why) {
  if (outcomes_.erase(ticket)) return;  // already resolved: nothing is held any more
  auto pit = pending_.find(ticket);
  if (pit == pending_.end()) return;
  Job& job = jobs_.at(pit->second);
  auto jt = job.gen.joiners.find(ticket);
  if (jt != job.gen.joiners.end()) {
    log::get("coordinator")
        ->info("{} node={} withdrew {}: {}", label(job), jt->second.node_id,
               ranks_phrase(jt->second.ranks), why);
  }
  remove_joiner(job, ticket);
}

void JobTable::lay_out(Generation& g) {
  // Built once for the generation: every peer table and describe reads it.
  std::vector<const std::string*> owner(g.world_size);
  for (const auto& [rank, claim] : g.claims) owner[rank] = &claim.node_id;
  std::unordered_map<std::string, const v1::GpuTopology*> topology_of;
  OfferFold fold;
  for (const auto& [node_id, member] : g.members) {
    topology_of[node_id] = &member.info.gpu_topology();
    fold.add(member.offer, node_label(node_id, member.info.hostname()));
  }
  g.layout = std::make_shared<const JobLayout>(build_layout(owner, topology_of));
  g.agreement = fold.result();
}

void JobTable::activate(Job& job) {
  Generation& g = job.gen;
  g.state = GenState::kActive;
  lay_out(g);
  touch(job);
  for (const auto& [ticket, joiner] : g.joiners) {
    resolve(ticket, JoinResult{g.number, g.world_size});
    pending_.erase(ticket);
  }
  g.joiners.clear();
  g.deadlines.clear();
  log::get("coordinator")
      ->info("{} complete: {} rank(s) on {} node(s)", label(job), g.world_size, g.members.size());
  for (const auto& [node_id, member] : g.members) emit(node_id, v1::Event::JOB_READY, job);
}

void JobTable::fail(Job& job, const Status& waiter_status, const std::string& reason,
                    int32_t failed_rank, const std::string& failed_node, bool node_lost) {
  Generation& g = job.gen;
  g.state = GenState::kAborted;
  touch(job);
  g.reason = reason;
  g.failed_rank = failed_rank;
  g.failed_node = failed_node;
  for (const auto& [ticket, joiner] : g.joiners) {
    resolve(ticket, waiter_status);
    pending_.erase(ticket);
  }
  g.joiners.clear();
  g.deadlines.clear();
  log::get("coordinator")->info("{} aborted: {}", label(job), reason);
  for (const auto& [node_id, member] : g.members) {
    if (node_lost) emit(node_id, v1::Event::NODE_LOST, job);
    emit(node_id, v1::Event::JOB_ABORTED, job);
  }
}

Status JobTable::leave(const std::string& node_id, const std::string& job_id, uint64_t generation) {
  GS_RETURN_IF_ERROR(check_registered(node_id, "LeaveJob"));
  auto jit = jobs_.find(job_id);
  if (jit == jobs_.end()) return {Code::kNotFound, "LeaveJob: no job '" + job_id + "'"};
  Job& job = jit->second;
  Generation& g = job.gen;
  if (generation != 0 && generation < g.number) return Status::Ok();  // already over
  if (generation > g.number) {
    return {Code::kNotFound, "LeaveJob job=" + job_id + ": no generation " +
                                 std::to_string(generation) + " (current is " +
                                 std::to_string(g.number) + ")"};
  }
  if (!g.members.count(node_id)) {
    return {Code::kFailedPrecondition,
            "LeaveJob: " + node_label(node_id) + " is not a member of " + label(job)};
  }
  if (g.left.count(node_id)) return Status::Ok();
  if (g.state == GenState::kForming) {
    std::vector<JoinTicket> mine;
    for (const auto& [ticket, joiner] : g.joiners) {
      if (joiner.node_id == node_id) mine.push_back(ticket);
    }
    for (JoinTicket t : mine) {
      resolve(t, Status(Code::kAborted, label(job) + ": " + node_label(node_id) + " left the job while it was forming"));
      remove_joiner(job, t);
    }
    log::get("coordinator")->info("{} node={} left while forming", label(job), node_id);
    return Status::Ok();
  }
  g.left.insert(node_id);
  touch(job);
  log::get("coordinator")->info("{} node={} left", label(job), node_id);
  if (g.state == GenState::kActive && g.left.size() == g.members.size()) {
    g.state = GenState::kFinished;
    log::get("coordinator")->info("{} finished: every node left", label(job));
    for (const auto& [node, member] : g.members) emit(node, v1::Event::JOB_FINISHED, job);
  }
  return Status::Ok();
}

Status JobTable::abort(const std::string& node_id, const std::string& job_id, uint64_t generation,
                       const std::string& reason, int32_t failed_rank) {
  if (!node_id.empty()) GS_RETURN_IF_ERROR(check_registered(node_id, "AbortJob"));
  auto jit = jobs_.find(job_id);
  if (jit == jobs_.end()) return {Code::kNotFound, "AbortJob: no job '" + job_id + "'"};
  Job& job = jit->second;
  Generation& g = job.gen;
  if (generation != 0 && generation < g.number) return Status::Ok();  // already over
  if (generation > g.number) {
    return {Code::kNotFound, "AbortJob job=" + job_id + ": no generation " +
                                 std::to_string(generation) + " (current is " +
                                 std::to_string(g.number) + ")"};
  }
  if (g.state == GenState::kAborted || g.state == GenState::kFinished) return Status::Ok();
  std::string failed_node;
  if (failed_rank >= 0) {
    auto c = g.claims.find(static_cast<uint32_t>(failed_rank));
    if (c != g.claims.end()) failed_node = c->second.node_id;
  }
  std::string full =
      "aborted by " + (node_id.empty() ? std::string("an operator") : node_label(node_id));
  if (!reason.empty()) full += ": " + reason;
  fail(job, {Code::kAborted, label(job) + " " + full}, full, failed_rank, failed_node);
  return Status::Ok();
}

void JobTable::expire_join_deadline(Job& job, TimePoint now) {
  Generation& g = job.gen;
  if (g.deadlines.empty() || now < g.deadlines.begin()->first) return;
  const Millis timeout = g.joiners.at(g.deadlines.begin()->second).timeout;
  std::vector<uint32_t> missing;
  for (uint32_t r = 0; r < g.world_size; ++r) {
    if (!g.claims.count(r)) missing.push_back(r);
  }
  std::string reason = "join timed out after " + std::to_string(timeout.count()) + " ms with " +
                       std::to_string(g.claims.size()) + " of " + std::to_string(g.world_size) +
                       " ranks; ranks that never joined: " + compress_ranks(missing) +
                       " (is their node's daemon running with the same job id and world size, "
                       "and can it reach the coordinator?)";
  int32_t first_missing = missing.empty() ? -1 : static_cast<int32_t>(missing.front());
  fail(job, {Code::kDeadlineExceeded, label(job) + ": " + reason}, reason, first_missing, "");
}

void JobTable::tick(TimePoint now) {
  for (auto& [id, job] : jobs_) {
    if (job.gen.state == GenState::kForming && !job.gen.joiners.empty()) {
      expire_join_deadline(job, now);
    }
  }
}

// --- queries ------------------------------------------------------------------------------

Result<v1::PeerTableResponse> JobTable::peer_table(const std::string& job_id, uint64_t generation,
                                                   const std::string& node_id, uint32_t page,
                                                   const std::vector<uint32_t>& ranks) const {
  auto jit = jobs_.find(job_id);
  if (jit == jobs_.end()) return Status(Code::kNotFound, "GetPeerTable: no job '" + job_id + "'");
  const Job& job = jit->second;
  const Generation& g = job.gen;
  if (generation != 0 && generation != g.number) {
    return Status(Code::kFailedPrecondition,
                  "GetPeerTable job=" + job_id + ": generation " + std::to_string(generation) +
                      " is not current (current is " + std::to_string(g.number) + ", " +
                      state_name(g.state) + "); join again to get the new generation");
  }
  if (g.state == GenState::kForming) {
    return Status(
        Code::kFailedPrecondition,
        "GetPeerTable " + label(job) + " is still forming: " + std::to_string(g.claims.size()) +
            " of " + std::to_string(g.world_size) + " ranks joined; call it after JoinJob returns");
  }
  if (g.state == GenState::kAborted) {
    return Status(Code::kFailedPrecondition,
                  "GetPeerTable " + label(job) + " was aborted: " + g.reason);
  }
  const JobLayout& l = *g.layout;
  v1::PeerTableResponse out;
  out.set_generation(g.number);
  out.set_world_size(g.world_size);
  out.set_node_count(uint32_t(l.node_ids.size()));
  if (!ranks.empty()) {  // fetch by key
    if (ranks.size() > kPageEntries) {
      return Status(Code::kInvalidArgument, "GetPeerTable " + label(job) + ": " + std::to_string(ranks.size()) +
                                                " ranks asked for; at most " + std::to_string(kPageEntries) + " a call");
    }
    for (uint32_t r : ranks) {
      if (r >= g.world_size) {
        return Status(Code::kInvalidArgument, "GetPeerTable " + label(job) + ": rank " + std::to_string(r) +
                                                  " is out of range for world_size " + std::to_string(g.world_size));
      }
      fill_entry(g, r, out.add_peers());
    }
    out.set_pages(1);
    return out;
  }
  auto number = l.node_number.find(node_id);
  if (number == l.node_number.end()) {
    return Status(Code::kFailedPrecondition, "GetPeerTable " + label(job) + ": " + node_label(node_id) +
                                                 " holds no rank of it; a node asks for its own table");
  }
  const std::vector<uint32_t> needed = l.needed(number->second);
  auto pages_of = [](size_t n, size_t per) { return uint32_t((n + per - 1) / per); };
  const uint32_t pages = std::max({1u, pages_of(needed.size(), kPageEntries), pages_of(l.runs.size(), kPageRuns),
                                   pages_of(l.shapes.size(), kPageShapes)});
  if (page >= pages) {
    return Status(Code::kInvalidArgument, "GetPeerTable " + label(job) + ": page " + std::to_string(page) +
                                              " of " + std::to_string(pages));
  }
  out.set_pages(pages);
  out.set_node_index(number->second);
  *out.mutable_agreement() = g.agreement;
  for (size_t i = size_t(page) * kPageEntries; i < needed.size() && i < size_t(page + 1) * kPageEntries; ++i) {
    fill_entry(g, needed[i], out.add_peers());
  }
  for (size_t i = size_t(page) * kPageRuns; i < l.runs.size() && i < size_t(page + 1) * kPageRuns; ++i) {
    *out.add_runs() = l.runs[i];
  }
  for (size_t i = size_t(page) * kPageShapes; i < l.shapes.size() && i < size_t(page + 1) * kPageShapes; ++i) {
    *out.add_shapes() = l.shapes[i];
  }
  return out;
}

bool JobTable::is_member(const std::string& job_id, const std::string& node_id) const {
  auto jit = jobs_.find(job_id);
  return jit != jobs_.end() && jit->second.gen.members.count(node_id) != 0;
}

std::vector<v1::JobSummary> JobTable::list_jobs() const {
  std::vector<v1::JobSummary> out;
  for (const auto& [id, job] : jobs_) out.push_back(summary_of(job));
  return out;
}

Result<v1::DescribeJobResponse> JobTable::describe(const std::string& job_id, uint32_t page) const {
  auto jit = jobs_.find(job_id);
  if (jit == jobs_.end()) return Status(Code::kNotFound, "DescribeJob: no job '" + job_id + "'");
  const Job& job = jit->second;
  const Generation& g = job.gen;
  auto pages_of = [](size_t n, size_t per) { return uint32_t((n + per - 1) / per); };
  const uint32_t pages = std::max({1u, pages_of(g.claims.size(), kPageEntries), pages_of(g.members.size(), kPageNodes),
                                   pages_of(g.paths.size(), kPageEntries)});
  if (page >= pages) {
    return Status(Code::kInvalidArgument, "DescribeJob " + label(job) + ": page " + std::to_string(page) + " of " +
                                              std::to_string(pages));
  }
  v1::DescribeJobResponse out;
  out.set_pages(pages);
  *out.mutable_summary() = summary_of(job);
  // Entries by rank, the ring, nodes and paths: this page's slice of each. Walking to the
  // page's start is O(page x per page) over the ordered maps; describe is an operator's call.
  const size_t lo = size_t(page) * kPageEntries, hi = lo + kPageEntries;
  size_t i = 0;
  for (auto it = g.claims.begin(); it != g.claims.end() && i < hi; ++it, ++i) {
    if (i >= lo) fill_entry(g, it->first, out.add_peers());
  }
  if (g.layout) {
    for (size_t p = lo; p < g.layout->ring.size() && p < hi; ++p) out.add_ring(g.layout->ring[p]);
  }
  i = 0;
  for (auto it = g.members.begin(); it != g.members.end() && i < size_t(page + 1) * kPageNodes; ++it, ++i) {
    if (i >= size_t(page) * kPageNodes) *out.add_nodes() = it->second.info;
  }
  i = 0;
  for (auto it = g.paths.begin(); it != g.paths.end() && i < hi; ++it, ++i) {
    if (i >= lo) *out.add_paths() = it->second;
  }
  return out;
}

Result<JobTable::Holders> JobTable::holders(const std::string& job_id) const {
  auto jit = jobs_.find(job_id);
  if (jit == jobs_.end()) return Status(Code::kNotFound, "TraceJob: no job '" + job_id + "'");
  Holders out;
  out.summary = summary_of(jit->second);
  for (const auto& [rank, claim] : jit->second.gen.claims) out.nodes[claim.node_id].insert(rank);
  return out;
}

Status JobTable::report_path(const std::string& node_id, const std::string& job_id,
                             uint64_t generation, const v1::RankPath& path) {
  GS_RETURN_IF_ERROR(check_registered(node_id, "ReportPath"));
  auto jit = jobs_.find(job_id);
  if (jit == jobs_.end()) return Status(Code::kNotFound, "ReportPath: no job '" + job_id + "'");
  Generation& g = jit->second.gen;
  if (generation != g.number) {
    return Status(Code::kFailedPrecondition, "ReportPath " + label(jit->second) + ": generation " +
                                                 std::to_string(generation) + " is not the current one");
  }
  auto claim = g.claims.find(path.rank());
  if (claim == g.claims.end() || claim->second.node_id != node_id) {
    return Status(Code::kPermissionDenied, "ReportPath " + label(jit->second) + ": rank " +
                                               std::to_string(path.rank()) + " is not held by " +
                                               node_label(node_id));
  }
  g.paths[path.rank()] = path;
  touch(jit->second);
  return Status::Ok();
}

std::vector<Delivery> JobTable::take_events() { return std::exchange(events_, {}); }

std::vector<std::string> JobTable::take_removed_nodes() {
  return std::exchange(removed_nodes_, {});
}

}  // namespace gradsync::coordinator
