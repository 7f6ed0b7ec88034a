// gradsync/elastic.h: shrink, grow and newcomers. The coordinator fixes the next generation's
// members (coordinator/regroup.h, through gradsyncd's RegroupRequest); then every member
// leaves the old generation and joins "BASE@GENERATION" with the rank it was given.
#include "gradsync/elastic.h"

#include <unistd.h>

#include "client/communicator_internals.h"
#include "common/limits.h"
#include "common/log.h"

namespace gradsync {
namespace {

// Beyond the coordinator's own wait: the connection, the daemon's hop and the reply.
constexpr std::chrono::seconds kRegroupSlack{15};

std::string next_job_id(const std::string& base, uint64_t generation) {
  return base + "@" + std::to_string(generation);
}

// Sends the regroup on `daemon` and checks the answer before anything is built on it.
Result<wire::RegroupResponse> ask(DaemonClient& daemon, const wire::RegroupRequest& r, const std::string& who) {
  auto reply = daemon.call(r, deadline_after(std::chrono::milliseconds(r.wait_ms) + kRegroupSlack));
  if (!reply.ok()) return Status(reply.status().code(), who + reply.status().message());
  auto* answer = std::get_if<wire::RegroupResponse>(&reply.value());
  if (answer == nullptr) return Status(Code::kInternal, who + "gradsyncd answered a regroup with something else");
  const wire::RegroupResponse& g = *answer;
  const bool sane = g.world_size >= 1 && g.world_size <= kMaxWorldSize && g.rank < g.world_size &&
                    g.local_world_size >= 1 && g.local_world_size <= g.world_size &&
                    g.local_rank < g.local_world_size && g.old_ranks.size() == size_t(g.world_size) &&
                    (r.newcomer || g.generation == r.from_generation + 1);
  if (!sane) return Status(Code::kInternal, who + "the coordinator's regroup answer is inconsistent");
  if (!r.newcomer && g.old_ranks[g.rank] != r.old_rank) {
    return Status(Code::kInternal, who + "the coordinator placed this rank at another rank's place");
  }
  return std::move(*answer);
}

JoinOptions next_options(JoinOptions o, const std::string& base, const wire::RegroupResponse& g) {
  o.job = next_job_id(base, g.generation);
  o.rank = int(g.rank);
  o.world_size = int(g.world_size);
  o.local_rank = int(g.local_rank);
  o.local_world_size = int(g.local_world_size);
  return o;
}

// shrink (newcomers 0) and grow.
Result<Communicator> regroup(Communicator& comm, uint32_t newcomers, std::chrono::milliseconds wait,
                             bool abort_first, const char* what) {
  auto st = CommunicatorInternals::state(comm);
  if (!st.ok()) return st.status();
  const JoinOptions& o = st->options;
  const std::string who = "job=" + st->lineage.base_job + " gen=" + std::to_string(st->lineage.generation) +
                          " rank " + std::to_string(o.rank) + ": " + what + ": ";
  if (st->left) return Status(Code::kFailedPrecondition, who + "the communicator already left its job");
  if (wait.count() < 0) return Status(Code::kInvalidArgument, who + "negative wait");
  if (!st->idle && !abort_first) {
    return Status(Code::kFailedPrecondition,
                  who + "collectives are still queued or running (ShrinkMode::kDefault): wait for them, or use "
                        "ShrinkMode::kAbort");
  }
  if (abort_first && !st->aborted) {
    // Not Communicator::abort, which names this rank as the culprit: the others would then
    // not wait for it.
    (void)CommunicatorInternals::abort_unnamed(
        comm, "job=" + st->lineage.base_job + " gen=" + std::to_string(st->lineage.generation) + ": rank " +
                  std::to_string(o.rank) + " (pid " + std::to_string(::getpid()) +
                  ") aborted the job's collectives to shrink it (ShrinkMode::kAbort)");
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto daemon = DaemonClient::connect(st->socket_path, deadline_after(std::chrono::seconds(10)));
  if (!daemon.ok()) return Status(daemon.status().code(), who + daemon.status().message());
  wire::RegroupRequest r;
  r.job_id = st->lineage.base_job;
  r.token = o.token;
  r.from_generation = st->lineage.generation;
  r.old_world_size = uint32_t(o.world_size);
  r.old_rank = o.rank;
  if (st->culprit >= 0 && st->culprit != o.rank) r.failed.push_back(st->culprit);
  r.newcomers = newcomers;
  r.wait_ms = uint32_t(wait.count());
  auto g = ask(*daemon, r, who);
  if (!g.ok()) return g.status();
  // The set is fixed: this rank belongs to it. The old generation goes (its channels here,
  // and in gradsyncd once every local rank of it left or closed).
  if (Status left = comm.leave(); !left.ok()) {
    log::get("client")->warn("{}leaving generation {}: {}", who, st->lineage.generation, left.to_string());
  }
  const Lineage next{st->lineage.base_job, g->generation};
  auto joined = CommunicatorInternals::join(std::move(daemon).value(), next_options(o, next.base_job, *g), &next);
  if (!joined.ok()) return Status(joined.status().code(), who + joined.status().message());
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  log::get("client")->info("{}generation {} ready: rank {} of {} (was rank {} of {}) in {:.0f} ms", who,
                           g->generation, g->rank, g->world_size, o.rank, o.world_size, ms);
  return joined;
}

}  // namespace

Result<Communicator> shrink(Communicator& comm, const ShrinkOptions& options) {
  return regroup(comm, 0, options.wait, options.mode == ShrinkMode::kAbort, "shrink");
}

Result<Communicator> grow(Communicator& comm, const GrowOptions& options) {
  if (options.newcomers < 0 || uint32_t(options.newcomers) > kMaxLocalWorldSize) {
    return Status(Code::kInvalidArgument, "grow: newcomers out of range");
  }
  return regroup(comm, uint32_t(options.newcomers), options.wait, false, "grow");
}

Result<Communicator> join_newcomer(const JoinOptions& options, const std::string& socket_path) {
  if (Status id = check_job_id(options.job); !id.ok()) {
    return Status(Code::kInvalidArgument, "join_newcomer refused: " + id.message());
  }
  const std::string who = "job=" + options.job + " newcomer (pid " + std::to_string(::getpid()) + "): ";
  if (options.join_timeout.count() <= 0) return Status(Code::kInvalidArgument, who + "join timeout must be > 0");
  const std::string path = socket_path.empty() ? default_daemon_socket() : socket_path;
  auto daemon = DaemonClient::connect(path, deadline_after(std::chrono::seconds(10)));
  if (!daemon.ok()) return Status(daemon.status().code(), who + daemon.status().message());
  wire::RegroupRequest r;
  r.job_id = options.job;
  r.token = options.token;
  r.newcomer = true;
  r.old_rank = -1;
  r.wait_ms = uint32_t(options.join_timeout.count());
  auto g = ask(*daemon, r, who);
  if (!g.ok()) return g.status();
  const Lineage next{options.job, g->generation};
  auto joined = CommunicatorInternals::join(std::move(daemon).value(), next_options(options, options.job, *g), &next);
  if (!joined.ok()) return Status(joined.status().code(), who + joined.status().message());
  return joined;
}

}  // namespace gradsync
