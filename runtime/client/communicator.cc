// Session, Communicator and Work: the public API over the daemon connection, the job's
// shared memory and a worker thread that runs host collectives in call order.
#include <poll.h>
#include <sys/eventfd.h>

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>

#include "channel/channel.h"
#include "channel/shared_memory.h"
#include "client/daemon_client.h"
#include "collectives/ring.h"
#include "common/log.h"
#include "gradsync/gradsync.h"

namespace gradsync {
namespace {

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end && *end == '\0') ? x : fallback;
}

std::string env_str(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return (v && *v) ? v : fallback;
}

// How long leave() waits for the daemon's answer.
constexpr std::chrono::milliseconds kLeaveTimeout{10'000};

}  // namespace

JoinOptions JoinOptions::from_env() {
  JoinOptions o;
  o.job = env_str("GRADSYNC_JOB_ID", "default");
  o.token = env_str("GRADSYNC_JOB_TOKEN");
  o.rank = static_cast<int>(env_long("RANK", -1));
  o.world_size = static_cast<int>(env_long("WORLD_SIZE", 0));
  o.local_rank = static_cast<int>(env_long("LOCAL_RANK", 0));
  o.local_world_size = static_cast<int>(env_long("LOCAL_WORLD_SIZE", 1));
  o.join_timeout = std::chrono::milliseconds(env_long("GRADSYNC_JOIN_TIMEOUT_MS", 60'000));
  o.op_timeout = std::chrono::milliseconds(env_long("GRADSYNC_OP_TIMEOUT_MS", 300'000));
  return o;
}

class WorkImpl {
 public:
  explicit WorkImpl(CollectiveCall call) : call(call) {}
  void finish(Status s) {
    std::lock_guard lock(mu);
    status = std::move(s);
    finished = true;
    cv.notify_all();
  }
  CollectiveCall call;
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  Status status;
};

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

class CommunicatorImpl {
 public:
  CommunicatorImpl(JoinOptions opts, DaemonClient daemon, SharedMemory shm, ShmLayout layout,
                   v1::JoinResponse join)
      : opts_(std::move(opts)),
        daemon_(std::move(daemon)),
        shm_(std::move(shm)),
        layout_(layout),
        join_(std::move(join)),
        log_(log::get("client")) {
    const auto& ring = join_.ring();
    const int n = ring.size();
    peers_.job = opts_.job;
    peers_.rank = opts_.rank;
    peers_.world_size = n;
    for (int i = 0; i < n; ++i) {
      if (int(ring[i]) == opts_.rank) peers_.position = i;
    }
    peers_.prev_rank = ring[(peers_.position + n - 1) % n];
    peers_.next_rank = ring[(peers_.position + 1) % n];
    peers_.prev_host = join_.rank_hosts(peers_.prev_rank);
    peers_.next_host = join_.rank_hosts(peers_.next_rank);
    send_ = Channel(shm_.data(), layout_, join_.setup().send_channel());
    recv_ = Channel(shm_.data(), layout_, join_.setup().recv_channel());
    wait_.control = static_cast<const JobControl*>(shm_.data());
    wait_.local_abort = &lost_daemon_;
    wait_.local_abort_reason = &lost_daemon_reason_;
    wake_.reset(::eventfd(0, EFD_CLOEXEC));
    monitor_ = std::thread([this] { monitor_daemon(); });
    worker_ = std::thread([this] { run_worker(); });
  }

  ~CommunicatorImpl() { (void)leave(); }

  Work enqueue(CollectiveCall call) {
    auto work = std::make_shared<WorkImpl>(call);
    Status bad = validate_allreduce(call);
    std::lock_guard lock(mu_);
    if (!bad.ok()) {
      // Refused before anything was sent: the communicator stays healthy.
      work->finish({bad.code(), "job=" + opts_.job + " rank " + std::to_string(opts_.rank) +
                                    ": allreduce refused: " + bad.message()});
    } else if (left_) {
      work->finish({Code::kFailedPrecondition, "communicator already left job " + opts_.job});
    } else {
      work->call.seq = next_seq_++;
      queue_.push_back(work);
      cv_.notify_one();
    }
    return Work(work);
  }

  Status leave() {
    {
      std::lock_guard lock(mu_);
      if (left_) return Status::Ok();
      left_ = true;
      cv_.notify_all();
    }
    if (worker_.joinable()) worker_.join();
    uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof(one)) < 0) { /* monitor also stops on EOF */ }
    if (monitor_.joinable()) monitor_.join();
    if (lost_daemon_.load()) return Status::Ok();
    v1::ClientMessage req;
    req.mutable_leave();
    auto reply = daemon_.call(req, deadline_after(kLeaveTimeout));
    return reply.ok() ? Status::Ok() : reply.status();
  }

  const JoinOptions& options() const { return opts_; }
  uint64_t generation() const { return join_.generation(); }

 private:
  void run_worker() {
    for (;;) {
      std::shared_ptr<WorkImpl> work;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return left_ || !queue_.empty(); });
        if (queue_.empty()) return;
        work = queue_.front();
        queue_.pop_front();
      }
      work->finish(run(work->call));
    }
  }

  Status run(const CollectiveCall& call) {
    if (!failed_.ok()) {
      return {Code::kFailedPrecondition, "communicator failed earlier: " + failed_.to_string()};
    }
    WaitContext wait = wait_;
    wait.deadline = deadline_after(opts_.op_timeout);
    Status s = ring_allreduce(peers_, send_, recv_, wait, call);
    if (!s.ok()) {
      // A failed collective leaves channels mid-stream: the communicator stays failed.
      failed_ = s;
      log_->error("job={} gen={} rank={}: {}", opts_.job, join_.generation(), opts_.rank,
                  s.to_string());
    }
    return s;
  }

  // Watches the daemon connection: the daemon never writes to it unasked after the join, so
  // any readiness here means it closed (the daemon died).
  void monitor_daemon() {
    pollfd fds[2] = {{daemon_.fd(), POLLIN | POLLRDHUP, 0}, {wake_.get(), POLLIN, 0}};
    for (;;) {
      int rc = ::poll(fds, 2, -1);
      if (rc < 0 && errno == EINTR) continue;
      if (fds[1].revents) return;
      if (rc < 0 || fds[0].revents) break;
    }
    lost_daemon_reason_ = "job=" + opts_.job + " rank " + std::to_string(opts_.rank) +
                          ": lost the connection to gradsyncd at " + daemon_.socket_path() +
                          " (the daemon died or was stopped)";
    lost_daemon_.store(true, std::memory_order_release);
    send_.wake_all();
    recv_.wake_all();
  }

  JoinOptions opts_;
  DaemonClient daemon_;
  SharedMemory shm_;
  ShmLayout layout_;
  v1::JoinResponse join_;
  std::shared_ptr<spdlog::logger> log_;
  RingPeers peers_;
  Channel send_, recv_;
  WaitContext wait_;
  std::atomic<bool> lost_daemon_{false};
  std::string lost_daemon_reason_;
  Fd wake_;
  Status failed_;  // worker thread only

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<WorkImpl>> queue_;
  uint32_t next_seq_ = 0;
  bool left_ = false;
  std::thread monitor_;
  std::thread worker_;
};

Communicator::Communicator(std::shared_ptr<CommunicatorImpl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;
Communicator::Communicator(Communicator&&) noexcept = default;
Communicator& Communicator::operator=(Communicator&&) noexcept = default;

int Communicator::rank() const { return impl_->options().rank; }
int Communicator::world_size() const { return impl_->options().world_size; }
uint64_t Communicator::generation() const { return impl_->generation(); }
const std::string& Communicator::job() const { return impl_->options().job; }

Status Communicator::allreduce(const void* send, void* recv, size_t count, DataType type,
                               ReduceOp op) {
  return allreduce_async(send, recv, count, type, op).wait();
}

Work Communicator::allreduce_async(const void* send, void* recv, size_t count, DataType type,
                                   ReduceOp op) {
  CollectiveCall call;
  call.send = send;
  call.recv = recv;
  call.count = count;
  call.type = type;
  call.op = op;
  return impl_->enqueue(call);
}

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
  impl->node_name = probe->attach().node_name();
  return Session(impl);
}

const std::string& Session::node_name() const { return impl_->node_name; }

Result<Communicator> Session::join(const JoinOptions& o) {
  std::string who = "job=" + o.job + " rank " + std::to_string(o.rank) + ": join refused: ";
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

  Deadline deadline = deadline_after(o.join_timeout + std::chrono::seconds(5));
  auto daemon = DaemonClient::connect(impl_->socket_path, deadline);
  if (!daemon.ok()) return daemon.status();
  v1::ClientMessage req;
  auto* j = req.mutable_join();
  j->set_job_id(o.job);
  j->set_token(o.token);
  j->set_rank(o.rank);
  j->set_world_size(o.world_size);
  j->set_local_rank(o.local_rank);
  j->set_local_world_size(o.local_world_size);
  j->set_timeout_ms(static_cast<uint32_t>(o.join_timeout.count()));
  Fd shm_fd;
  auto reply = daemon->call(req, deadline, &shm_fd);
  if (!reply.ok()) return reply.status();
  if (!reply->has_join() || !shm_fd.valid()) {
    return Status(Code::kInternal, "gradsyncd answered join without channel set-up");
  }
  const auto& setup = reply->join().setup();
  ShmLayout layout;
  layout.slots = setup.slots();
  layout.slot_bytes = setup.slot_bytes();
  layout.num_channels = setup.num_channels();
  if (layout.total_bytes() != setup.shm_bytes() || setup.send_channel() >= layout.num_channels ||
      setup.recv_channel() >= layout.num_channels) {
    return Status(Code::kInternal, "gradsyncd's channel set-up does not match its layout");
  }
  auto shm = SharedMemory::map(std::move(shm_fd), setup.shm_bytes());
  if (!shm.ok()) return shm.status();
  GS_RETURN_IF_ERROR(check_job_control(shm->data(), layout));
  auto impl = std::make_shared<CommunicatorImpl>(o, std::move(daemon).value(), std::move(shm).value(),
                                                 layout, reply->join());
  return Communicator(impl);
}

}  // namespace gradsync
