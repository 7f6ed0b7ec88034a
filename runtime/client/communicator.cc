// Session, Communicator and Work: the public API over the daemon connection, the job's
// shared memory and a worker thread that runs host collectives in call order (the class
// behind it: client/communicator_impl.h), and the join.
#include <algorithm>
#include <cstdlib>

#include "channel/shared_memory.h"
#include "client/communicator_impl.h"
#include "client/daemon_client.h"
#include "common/launch_env.h"
#include "common/limits.h"
#include "gradsync/gradsync.h"

namespace gradsync {
namespace {

using communicator_detail::make_call;

std::string env_str(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return (v && *v) ? v : fallback;
}

}  // namespace

JoinOptions JoinOptions::from_env() {
  JoinOptions o;
  o.job = env_str("GRADSYNC_JOB_ID", "default");
  o.token = env_str("GRADSYNC_JOB_TOKEN");
  // The launcher's variables (common/launch_env.h: gradsyncrun, torchrun, Slurm, Open MPI,
  // PyTorchJob). On a conflict or a malformed value rank stays -1 and world size 0, so that
  // Session::join refuses and reports launch_env's message.
  if (auto placed = launch::rank_placement(launch::process_env()); placed.ok()) {
    o.rank = placed->rank;
    o.world_size = placed->world_size;
    o.local_rank = placed->local_rank;
    o.local_world_size = placed->local_world_size;
  }
  o.join_timeout = std::chrono::milliseconds(env_long("GRADSYNC_JOIN_TIMEOUT_MS", 60'000));
  o.op_timeout = std::chrono::milliseconds(env_long("GRADSYNC_OP_TIMEOUT_MS", 300'000));
  const std::string dev = env_str("GRADSYNC_DEVICE");
  if (dev == "local") o.device = kDeviceLocalRank;
  else if (!dev.empty()) o.device = static_cast<int>(env_long("GRADSYNC_DEVICE", kNoDevice));
  return o;
}

Status Work::wait(std::chrono::milliseconds timeout) {
  if (!impl_) return {Code::kFailedPrecondition, "wait() on an empty Work"};
  std::unique_lock lock(impl_->mu);
  if (!impl_->cv.wait_until(lock, deadline_after(timeout), [&] { return impl_->finished; })) {
    return {Code::kDeadlineExceeded, "collective #" + std::to_string(impl_->call.seq) +
                                         " still running after " + std::to_string(timeout.count()) +
                                         " ms"};
  }
  return impl_->status;
}

bool Work::done() const {
  if (!impl_) return true;
  std::lock_guard lock(impl_->mu);
  return impl_->finished;
}

Communicator::Communicator(std::shared_ptr<CommunicatorImpl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;
Communicator::Communicator(Communicator&&) noexcept = default;
Communicator& Communicator::operator=(Communicator&&) noexcept = default;

int Communicator::rank() const { return impl_->options().rank; }
int Communicator::world_size() const { return impl_->options().world_size; }
uint64_t Communicator::generation() const { return impl_->generation(); }
const std::string& Communicator::job() const { return impl_->options().job; }

Work Communicator::allreduce_async(const void* send, void* recv, size_t count, DataType type,
                                   ReduceOp op, CallOptions opts) {
  return impl_->enqueue(make_call(CollectiveKind::kAllreduce, send, recv, count, type, op, 0, opts));
}
Status Communicator::allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                               CallOptions opts) {
  return impl_->execute(make_call(CollectiveKind::kAllreduce, send, recv, count, type, op, 0, opts));
}
Work Communicator::reduce_scatter_async(const void* send, void* recv, size_t recv_count, DataType type,
                                        ReduceOp op, CallOptions opts) {
  return impl_->enqueue(make_call(CollectiveKind::kReduceScatter, send, recv, recv_count, type, op, 0, opts));
}
Status Communicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DataType type,
                                    ReduceOp op, CallOptions opts) {
  return impl_->execute(make_call(CollectiveKind::kReduceScatter, send, recv, recv_count, type, op, 0, opts));
}
Work Communicator::all_gather_async(const void* send, void* recv, size_t send_count, DataType type,
                                    CallOptions opts) {
  return impl_->enqueue(
      make_call(CollectiveKind::kAllGather, send, recv, send_count, type, ReduceOp::kSum, 0, opts));
}
Status Communicator::all_gather(const void* send, void* recv, size_t send_count, DataType type,
                                CallOptions opts) {
  return impl_->execute(
      make_call(CollectiveKind::kAllGather, send, recv, send_count, type, ReduceOp::kSum, 0, opts));
}
Work Communicator::broadcast_async(void* buf, size_t count, DataType type, int root, CallOptions opts) {
  return impl_->enqueue(make_call(CollectiveKind::kBroadcast, buf, buf, count, type, ReduceOp::kSum, root, opts));
}
Status Communicator::broadcast(void* buf, size_t count, DataType type, int root, CallOptions opts) {
  return impl_->execute(make_call(CollectiveKind::kBroadcast, buf, buf, count, type, ReduceOp::kSum, root, opts));
}
Status Communicator::barrier() {
  // One byte through the whole ring (or both trees): nobody returns before everybody entered.
  uint8_t token = 0;
  return impl_->execute(
      make_call(CollectiveKind::kBarrier, &token, &token, 1, DataType::kUInt8, ReduceOp::kSum, 0, {}));
}

Communicator::Prediction Communicator::predict_allreduce(size_t count, DataType type) const {
  return impl_->predict(count, type);
}
std::string Communicator::cost_model() const { return impl_->describe_model(); }

Status Communicator::abort(const std::string& reason) { return impl_->abort(reason); }

Status Communicator::leave() { return impl_ ? impl_->leave() : Status::Ok(); }

class SessionImpl {
 public:
  std::string socket_path;
  std::string node_name;
};

Result<Session> Session::connect(const std::string& socket_path) {
  auto impl = std::make_shared<SessionImpl>();
  impl->socket_path = socket_path.empty() ? default_daemon_socket() : socket_path;
  // Attach once now so that a missing daemon is reported here, not at the first join.
  auto probe = DaemonClient::connect(impl->socket_path, deadline_after(std::chrono::seconds(10)));
  if (!probe.ok()) return probe.status();
  impl->node_name = probe->attach().node_name;
  return Session(impl);
}

const std::string& Session::node_name() const { return impl_->node_name; }

Result<Communicator> Session::join(const JoinOptions& o) {
  // Bad input is refused here, before the daemon sees anything; a bad job id is not echoed.
  if (Status id = check_job_id(o.job); !id.ok()) {
    return Status(Code::kInvalidArgument, "join refused: " + id.message() + " (GRADSYNC_JOB_ID or JoinOptions::job)");
  }
  std::string who = "job=" + o.job + " rank " + std::to_string(o.rank) + ": join refused: ";
  if (o.rank < 0 && o.world_size <= 0) {
    // No rank given: say what the launcher's variables lacked or got wrong.
    auto placed = launch::rank_placement(launch::process_env());
    const std::string why = placed.ok() ? "" : placed.status().message();
    return Status(Code::kInvalidArgument, who + "no rank and world size (JoinOptions::from_env: " + why + ")");
  }
  if (o.world_size <= 0) return Status(Code::kInvalidArgument, who + "world size must be >= 1, got " + std::to_string(o.world_size));
  if (o.rank < 0 || o.rank >= o.world_size) {
    return Status(Code::kInvalidArgument, who + "rank must be in [0, " + std::to_string(o.world_size) + ")");
  }
  if (o.local_world_size <= 0 || o.local_world_size > o.world_size || o.local_rank < 0 ||
      o.local_rank >= o.local_world_size) {
    return Status(Code::kInvalidArgument, who + "local rank " + std::to_string(o.local_rank) +
                                              " / local world size " + std::to_string(o.local_world_size) + " invalid");
  }
  if (o.job.empty()) return Status(Code::kInvalidArgument, who + "empty job id");

  auto daemon = DaemonClient::connect(impl_->socket_path, deadline_after(o.join_timeout + std::chrono::seconds(5)));
  if (!daemon.ok()) return daemon.status();
  return CommunicatorInternals::join(std::move(daemon).value(), o, nullptr);
}

Status CommunicatorInternals::abort_unnamed(Communicator& c, const std::string& reason) {
  if (!c.impl_) return Status(Code::kFailedPrecondition, "an empty communicator (moved from)");
  return c.impl_->abort_unnamed(reason);
}

Result<CommunicatorInternals::State> CommunicatorInternals::state(Communicator& c) {
  if (!c.impl_) return Status(Code::kFailedPrecondition, "an empty communicator (moved from)");
  return c.impl_->elastic_state();
}

Result<Communicator> CommunicatorInternals::join(DaemonClient daemon_client, const JoinOptions& o,
                                                 const Lineage* lineage) {
  const std::string who = "job=" + o.job + " rank " + std::to_string(o.rank) + ": join refused: ";
  Deadline deadline = deadline_after(o.join_timeout + std::chrono::seconds(5));
  DaemonClient* daemon = &daemon_client;
  wire::JoinRequest req{o.job,
                        o.token,
                        uint32_t(o.rank),
                        uint32_t(o.world_size),
                        uint32_t(o.local_rank),
                        uint32_t(o.local_world_size),
                        static_cast<uint32_t>(o.join_timeout.count())};
  std::vector<Fd> fds;  // the job's shared memory, then this rank's channel sockets
  auto reply = daemon->call(req, deadline, &fds);
  if (!reply.ok()) return reply.status();
  auto* joined = std::get_if<wire::JoinResponse>(&reply.value());
  if (joined == nullptr || fds.empty() || !fds.front().valid()) {
    return Status(Code::kInternal, "gradsyncd answered join without channel set-up");
  }
  wire::JoinResponse jr = std::move(*joined);
  Fd shm_fd = std::move(fds.front());
  fds.erase(fds.begin());
  const wire::ChannelSetup& setup = jr.setup;
  ShmLayout layout;
  layout.slots = setup.slots;
  layout.slot_bytes = setup.slot_bytes;
  layout.num_channels = setup.num_channels;
  layout.recorders = setup.recorders;
  layout.recorder_entries = setup.recorder_entries;
  if ((layout.recorders != 0) != (layout.recorder_entries != 0) || layout.recorder_entries > kMaxRecorderEntries ||
      (layout.recorders != 0 && setup.recorder_index >= layout.recorders)) {
    return Status(Code::kInternal, "gradsyncd's flight recorder set-up is inconsistent (recorders " +
                                       std::to_string(layout.recorders) + ", entries " +
                                       std::to_string(layout.recorder_entries) + ", index " +
                                       std::to_string(setup.recorder_index) + ")");
  }
  if (layout.total_bytes() != setup.shm_bytes) {
    return Status(Code::kInternal, "gradsyncd's channel set-up does not match its layout");
  }
  // A first join pre-faults the region (its first calls then run at full speed); a new
  // elastic generation is wanted at once: its pages fault in as its calls first touch them
  // (MAP_POPULATE of 248 MiB for 7 ranks took about 1 s of the 1.3 s of a shrink on the VM).
  auto shm = SharedMemory::map(std::move(shm_fd), setup.shm_bytes, /*populate=*/lineage == nullptr);
  if (!shm.ok()) return shm.status();
  GS_RETURN_IF_ERROR(check_job_control(shm->data(), layout));
  if (jr.ring.size() != size_t(o.world_size) || jr.rank_hosts.size() != jr.ring.size()) {
    return Status(Code::kInternal, "gradsyncd returned a ring of the wrong size");
  }
  const size_t own_sockets = fds.size();
  auto links = build_links(o.job, o.rank, jr.ring, jr.rank_hosts, setup, shm->data(), layout, std::move(fds));
  if (!links.ok()) return links.status();
  // Where this rank's slots go: cross-node send channels the daemon still pumps (RDMA, or a
  // peer node that keeps TCP in its proxy); the others are sockets this rank moves itself.
  const int others = o.world_size - o.local_world_size;
  const int proxied = int(std::count_if(setup.channels.begin(), setup.channels.end(),
                                        [](const wire::ChannelRef& r) { return r.remote && r.socket == 0; }));
  const uint64_t generation = jr.generation;
  const bool daemon_has_verbs = jr.verbs.has_value();
  auto impl = std::make_shared<CommunicatorImpl>(o, std::move(daemon_client), std::move(shm).value(),
                                                 layout, std::move(jr), std::move(links).value());
  impl->set_record_path(others == 0        ? RecordPath::kLocal
                        : own_sockets == 0 ? RecordPath::kDaemon
                        : proxied == 0     ? RecordPath::kRankSockets
                                           : RecordPath::kMixed);
  impl->set_lineage(lineage ? *lineage : Lineage{o.job, generation});
  if (lineage == nullptr) GS_RETURN_IF_ERROR(impl->calibrate());
  if (o.device == JoinOptions::kNoDevice) {
    const std::string via_daemon =
        std::string("through gradsyncd over ") + (daemon_has_verbs ? "RDMA where their node has it, else TCP" : "TCP");
    const std::string own = "TCP sockets this rank moves itself (" + std::to_string(own_sockets) + " channel(s)";
    std::string why = "shared-memory channels; " + std::to_string(others) + " rank(s) on other nodes ";
    if (others == 0) why = "shared-memory channels; every rank on this node";
    else if (own_sockets == 0) why += via_daemon;
    else if (proxied == 0) why += "over " + own + ", connected by gradsyncd)";
    else why += via_daemon + ", or on " + own + ")";
    impl->report_path("host-channels", why);
  } else {
#if GRADSYNC_HAVE_CUDA
    GS_RETURN_IF_ERROR(impl->attach_device());
    const DeviceComm::MemoryUse mem = impl->gpu()->memory();
    impl->report_path(impl->gpu()->path(), impl->gpu()->path_why(), mem.gpu_bytes, mem.pinned_host_bytes);
#else
    return Status(Code::kUnimplemented, who + "a device was asked for (JoinOptions::device " +
                                            std::to_string(o.device) + ") but gradsync was built without CUDA");
#endif
  }
  impl->start_worker();
  return Communicator(impl);
}

}  // namespace gradsync
