// CommunicatorImpl's host side (client/communicator_impl.h): the worker that runs host
// collectives in call order, the cost model's calibration, abort and leave, and the thread that
// watches the daemon connection.
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "client/communicator_impl.h"

namespace gradsync {
namespace {


// How long leave() waits for the daemon's answer.
constexpr std::chrono::milliseconds kLeaveTimeout{10'000};
// How long a failed rank may spend telling its socket peers why (tell_peers): the frame is
// small, so this is only spent on a peer that stopped reading.
constexpr std::chrono::milliseconds kTellTimeout{50};
// How long a channel wait polls with sched_yield after its spin, before it sleeps
// (WaitContext::yield_spin; GRADSYNC_YIELD_US). docs/benchmarks.md has the measurements.
constexpr std::chrono::microseconds kYieldSpin{1000};

}  // namespace

CommunicatorImpl::CommunicatorImpl(JoinOptions opts, DaemonClient daemon, SharedMemory shm,
                                   ShmLayout layout, wire::JoinResponse join, RankLinks links)
    : opts_(std::move(opts)),
      daemon_(std::move(daemon)),
      shm_(std::move(shm)),
      layout_(layout),
      join_(std::move(join)),
      log_(log::get("client")),
      links_(std::move(links)),
      model_(CostModel::prior(links_.world_size)) {
  if (const char* a = std::getenv("GRADSYNC_ALGO"); a && *a) {
    std::string v = a;
    forced_ = v == "ring" ? Algorithm::kRing : v == "tree" ? Algorithm::kTree : Algorithm::kAuto;
    // oneshot, twoshot and hierarchical name GPU algorithms (gpu/device_comm.cc).
    const bool gpu_only = v == "oneshot" || v == "one-shot" || v == "twoshot" || v == "two-shot" || v == "hierarchical";
    if (forced_ == Algorithm::kAuto && v != "auto" && !gpu_only) {
      log_->warn("GRADSYNC_ALGO={} is not ring, tree or auto; using auto", v);
    }
  }
  wait_.control = static_cast<const JobControl*>(shm_.data());
  wait_.local_abort = &lost_daemon_;
  wait_.local_abort_reason = &lost_daemon_reason_;
  wait_.peers_leave = true;
  wait_.spin = spin_for(opts_.local_world_size);
  if (const char* s = std::getenv("GRADSYNC_SPIN_US"); s && *s) wait_.spin = std::chrono::microseconds(std::atol(s));
  // Where gradsyncd's pumps move some of this rank's cross-node slots (verbs, --proxy-tcp),
  // a rank polling for them takes the pumps' cores on a small machine: it sleeps after the
  // spin instead (2 nodes x 1 on the 2-core VM through the proxy: 0.6-0.75 GB/s polling,
  // about 1 GB/s sleeping).
  const auto& refs = join_.setup.channels;
  const bool pumped = std::any_of(refs.begin(), refs.end(),
                                  [](const wire::ChannelRef& r) { return r.remote && r.socket == 0; });
  wait_.yield_spin = std::chrono::microseconds(
      std::max(0L, env_long("GRADSYNC_YIELD_US", pumped ? 0 : long(kYieldSpin.count()))));
  if (layout_.recorders != 0) {
    recorder_ = std::make_unique<FlightRecorder>(
        static_cast<char*>(shm_.data()) + layout_.recorder_offset(join_.setup.recorder_index),
        layout_.recorder_entries);
  } else {
    recorder_ = std::make_unique<FlightRecorder>();
  }
  wake_.reset(::eventfd(0, EFD_CLOEXEC));
  monitor_ = std::thread([this] { monitor_daemon(); });
}

Work CommunicatorImpl::enqueue(CollectiveCall call) {
  auto work = std::make_shared<WorkImpl>(call);
  Status bad = validate(call, links_.world_size, links_.rank);
  std::lock_guard lock(mu_);
  if (!bad.ok()) {
    work->finish(refused(call, bad));
  } else if (left_) {
    work->finish(already_left());
  } else {
    work->call.seq = next_seq_++;
    recorder_->queued(record_of(work->call, 0));
    queue_.push_back(work);
    cv_.notify_all();
  }
  return Work(work);
}

Status CommunicatorImpl::execute(CollectiveCall call) {
  Status bad = validate(call, links_.world_size, links_.rank);
  if (!bad.ok()) return refused(call, bad);
  std::unique_lock lock(mu_);
  if (left_) return already_left();
  if (!queue_.empty() || busy_) {
    lock.unlock();
    return enqueue(call).wait();
  }
  busy_ = true;
  call.seq = next_seq_++;
  lock.unlock();
  recorder_->queued(record_of(call, 0));
  Status s = run(call, 0, true);
  lock.lock();
  busy_ = false;
  cv_.notify_all();
  return s;
}

Status CommunicatorImpl::leave() {
  {
    std::lock_guard lock(mu_);
    if (left_) return Status::Ok();
  }
#if GRADSYNC_HAVE_CUDA
  release_device();
#endif
  {
    std::lock_guard lock(mu_);
    if (left_) return Status::Ok();
    left_ = true;
    cv_.notify_all();
  }
  if (worker_.joinable()) worker_.join();
  // A peer still waiting on one of this rank's channels made more calls: it learns now. Not
  // after an abort (this rank's, or the job's as far as this rank knows): a peer then waits
  // for the abort to reach it, which names its cause, rather than blaming this rank's leaving.
  const bool aborted = !abort_reason().empty();
  if (!aborted) mark_left(links_);
  if (failed_.ok() && !aborted && links_.driver) links_.driver->goodbye(deadline_after(std::chrono::seconds(1)));
  uint64_t one = 1;
  if (::write(wake_.get(), &one, sizeof(one)) < 0) { /* monitor also stops on EOF */ }
  if (monitor_.joinable()) monitor_.join();
  if (lost_daemon_.load()) return Status::Ok();
  auto reply = daemon_.call(wire::LeaveRequest{}, deadline_after(kLeaveTimeout));
  return reply.ok() ? Status::Ok() : reply.status();
}

void CommunicatorImpl::report_path(const std::string& path, const std::string& why,
                                   uint64_t gpu_bytes, uint64_t pinned_bytes) {
  std::lock_guard lock(send_mu_);
  if (Status s = daemon_.send(wire::PathReport{path, why, gpu_bytes, pinned_bytes}); !s.ok()) {
    log_->warn("job={} rank={}: reporting the data path to gradsyncd: {}", opts_.job, opts_.rank, s.to_string());
  }
}

Status CommunicatorImpl::abort(const std::string& reason) {
  {
    std::lock_guard lock(mu_);
    if (left_) return already_left();
  }
  // Our own waits stop at once through the local flag; the daemon spreads it to the others.
  stop_local_waits("job=" + opts_.job + " rank " + std::to_string(opts_.rank) + " aborted the job: " + reason);
  std::lock_guard lock(send_mu_);
  return daemon_.send(wire::AbortRequest{reason, false, 0});
}

Status CommunicatorImpl::abort_unnamed(const std::string& reason) {
  {
    std::lock_guard lock(mu_);
    if (left_) return already_left();
  }
  stop_local_waits(reason);
  abort_job(shm_.data(), layout_, -1, reason);
  std::lock_guard lock(send_mu_);
  return daemon_.send(wire::AbortRequest{reason, true, -1});
}

std::string CommunicatorImpl::abort_reason() const {
  const bool stop = wait_.control->aborted.load(std::memory_order_acquire) ||
                    lost_daemon_.load(std::memory_order_acquire);
  return stop ? aborted_status(wait_).message() : std::string();
}

CommunicatorInternals::State CommunicatorImpl::elastic_state() {
  CommunicatorInternals::State st;
  st.options = opts_;
  st.socket_path = daemon_.socket_path();
  st.lineage = lineage_;
  st.aborted = wait_.control->aborted.load(std::memory_order_acquire) || lost_daemon_.load(std::memory_order_acquire);
  st.culprit = st.aborted ? wait_.control->failed_rank.load(std::memory_order_acquire) : -1;
  std::lock_guard lock(mu_);
  st.idle = queue_.empty() && !busy_;
  st.left = left_;
  return st;
}

void CommunicatorImpl::run_worker() {
  for (;;) {
    std::shared_ptr<WorkImpl> work;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return (left_ && !busy_) || (!queue_.empty() && !busy_); });
      if (queue_.empty()) return;
      work = queue_.front();
      queue_.pop_front();
      busy_ = true;
    }
    Status s = work->task ? work->task() : run(work->call, 0, true);
    {
      std::lock_guard lock(mu_);
      busy_ = false;
      cv_.notify_all();
    }
    work->finish(std::move(s));
  }
}

Status CommunicatorImpl::refused(const CollectiveCall& call, const Status& bad) const {
  // Refused before anything was sent: the communicator stays healthy.
  return {bad.code(), "job=" + opts_.job + " rank " + std::to_string(opts_.rank) + ": " +
                          to_string(call.kind) + " refused: " + bad.message()};
}

Status CommunicatorImpl::run(CollectiveCall call, uint8_t flags, bool queued) {
  if (!queued) recorder_->queued(record_of(call, flags));
  if (!failed_.ok()) {
    recorder_->ended(call.seq, false, uint8_t(Code::kFailedPrecondition));
    return {Code::kFailedPrecondition, "communicator failed earlier: " + failed_.to_string()};
  }
  call.algorithm = resolve(call);
  WaitContext wait = wait_;
  wait.deadline = deadline_after(opts_.op_timeout);
  wait.waiting_for = recorder_->waiting_slot(call.seq);
  recorder_->started(call.seq, uint8_t(call.algorithm));
  Status s = run_collective(links_, wait, call);
  recorder_->ended(call.seq, s.ok(), uint8_t(s.code()));
  if (!s.ok()) {
    // A failed collective leaves channels mid-stream: the communicator stays failed.
    failed_ = s;
    log_->error("job={} gen={} rank={}: {}", opts_.job, join_.generation, opts_.rank,
                s.to_string());
    fail_together(s);
    tell_peers(s);
    request_trace_dump(s);
  }
  return s;
}

void CommunicatorImpl::fail_together(const Status& s) {
  const ChannelDriver::ToldAbort told = links_.driver ? links_.driver->told_abort() : ChannelDriver::ToldAbort{};
  if (s.code() == Code::kAborted) {
    // The job's abort (or this rank's) is already everywhere; one a peer told over a socket
    // is not, unless this node heard it meanwhile.
    if (!told.told || wait_.control->aborted.load(std::memory_order_acquire)) return;
  }
  int culprit = failed_peer(links_, s);
  const std::string me = "rank " + std::to_string(opts_.rank) + " (pid " + std::to_string(::getpid()) +
                         ", host " + host_of(opts_.rank) + ")";
  std::string reason = "job=" + opts_.job + " gen=" + std::to_string(join_.generation) + ": ";
  if (s.code() == Code::kAborted) {
    // The peer's reason as it is (it names the culprit), and who brought it.
    culprit = told.culprit;
    reason = told.reason + " (told " + me + " over the data path by " + told.from + ")";
  } else if (culprit >= 0) {
    reason += me + " lost its connection to " + links_.name(culprit) + ": " + s.message();
  } else {
    reason += me + " failed: " + s.message();
  }
  abort_job(shm_.data(), layout_, culprit, reason);
  if (lost_daemon_.load(std::memory_order_acquire)) return;
  std::lock_guard lock(send_mu_);
  if (Status sent = daemon_.send(wire::AbortRequest{reason, true, culprit}); !sent.ok()) {
    log_->warn("job={} rank={}: telling gradsyncd about the failure: {}", opts_.job, opts_.rank, sent.to_string());
  }
}

void CommunicatorImpl::tell_peers(const Status& s) {
  if (!links_.driver) return;
  // What this node holds as the job's abort (fail_together has just written it, unless
  // another writer was first), else this rank's own stop or failure.
  std::string reason = s.message();
  int culprit = -1;
  if (wait_stopped(wait_)) {
    reason = aborted_status(wait_).message();
    if (wait_.control->aborted.load(std::memory_order_acquire)) {
      culprit = wait_.control->failed_rank.load(std::memory_order_acquire);
    }
  }
  links_.driver->tell_abort(reason, culprit, deadline_after(kTellTimeout));
}

std::string CommunicatorImpl::host_of(int rank) const {
  return size_t(rank) < links_.hosts.size() ? links_.hosts[size_t(rank)] : std::string("?");
}

Record CommunicatorImpl::record_of(const CollectiveCall& call, uint8_t flags) const {
  Record r;
  r.seq = call.seq;
  r.kind = uint8_t(call.kind);
  r.type = uint8_t(call.type);
  r.op = uint8_t(call.op);
  r.algorithm = uint8_t(call.algorithm);
  r.root = call.root;
  r.count = call.count;
  r.path = record_path_;
  r.flags = flags;
  return r;
}

void CommunicatorImpl::request_trace_dump(const Status& why) {
  if (!recorder_->enabled() || lost_daemon_.load()) return;
  std::lock_guard lock(send_mu_);
  (void)daemon_.send(wire::TraceDumpRequest{why.to_string().substr(0, 1024)});
}

Algorithm CommunicatorImpl::resolve(const CollectiveCall& call) const {
  if (call.algorithm != Algorithm::kAuto) return call.algorithm;
  if (call.kind != CollectiveKind::kAllreduce && call.kind != CollectiveKind::kBarrier) {
    return Algorithm::kRing;
  }
  if (forced_ != Algorithm::kAuto) return forced_;
  return model_.choose(call.count * element_size(call.type));
}

Status CommunicatorImpl::calibrate() {
  if (links_.world_size == 1) return Status::Ok();
  const char* tune = std::getenv("GRADSYNC_TUNE");
  if (tune && std::string(tune) == "0") return Status::Ok();
  // Three sizes, one per regime of CostModel: latency (1 KiB), the knee (64 KiB) and
  // bandwidth (4 MiB). Small sizes get many cheap tries and keep the fastest, since one
  // preempted try on a busy machine would otherwise be read as latency.
  const size_t* sizes = CostModel::kSizes;
  const int tries[CostModel::kPoints] = {12, 6, 6};
  // Two untimed calls per size first: they touch every slot the timed ones use and, between
  // nodes, let the TCP connections grow their windows. Ring and tree then take turns, so a
  // busy moment of the machine (peers still starting, a neighbour) slows both, not one.
  constexpr int kWarmup = 2;
  std::vector<float> buf(sizes[CostModel::kPoints - 1] / sizeof(float), 1.0f);
  std::vector<double> agreed(2 * CostModel::kPoints, 1e30);  // [algo][size] in us
  for (int z = 0; z < CostModel::kPoints; ++z) {
    for (int i = 0; i < kWarmup + tries[z]; ++i) {
      for (int a = 0; a < 2; ++a) {
        CollectiveCall c{CollectiveKind::kAllreduce, buf.data(), buf.data(), sizes[z] / sizeof(float),
                         DataType::kFloat32, ReduceOp::kMax, 0, a == 0 ? Algorithm::kRing : Algorithm::kTree,
                         next_seq_++};
        auto t0 = Clock::now();
        GS_RETURN_IF_ERROR(run(c));
        double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        double& best = agreed[size_t(a) * CostModel::kPoints + size_t(z)];
        if (i >= kWarmup) best = std::min(best, us);
      }
    }
  }
  // Agree: every rank takes the slowest rank's figure.
  CollectiveCall c{CollectiveKind::kAllreduce, agreed.data(), agreed.data(), agreed.size(),
                   DataType::kFloat64, ReduceOp::kMax, 0, Algorithm::kRing, next_seq_++};
  GS_RETURN_IF_ERROR(run(c));
  model_.fit(0, &agreed[0]);
  model_.fit(1, &agreed[CostModel::kPoints]);
  if (opts_.rank == 0) log_->info("job={} cost model {}", opts_.job, model_.describe());
  return Status::Ok();
}

Communicator::Prediction CommunicatorImpl::predict(size_t count, DataType type) const {
  size_t bytes = count * element_size(type);
  return {model_.predict_us(Algorithm::kRing, bytes), model_.predict_us(Algorithm::kTree, bytes),
          model_.choose(bytes)};
}

void CommunicatorImpl::monitor_daemon() {
  pollfd fds[2] = {{daemon_.fd(), POLLIN | POLLRDHUP, 0}, {wake_.get(), POLLIN, 0}};
  for (;;) {
    int rc = ::poll(fds, 2, -1);
    if (rc < 0 && errno == EINTR) continue;
    if (fds[1].revents) return;
    if (rc < 0 || fds[0].revents) break;
  }
  const std::string reason = "job=" + opts_.job + " rank " + std::to_string(opts_.rank) + " (host " +
                             host_of(opts_.rank) + "): lost the connection to gradsyncd at " + daemon_.socket_path() +
                             " (the daemon died or was stopped)";
  stop_local_waits(reason);
  // The dead daemon cannot abort the job on this node: the ranks here hear it from the job's
  // shared memory, before this rank leaves and marks its channels left (which a sibling still
  // waiting there would read as one call more: MISMATCH; seen in a chaos trial).
  abort_job(shm_.data(), layout_, -1, reason);
  // Sleeping waiters notice the flag within one wait slice (channel.cc).
}

void CommunicatorImpl::stop_local_waits(std::string reason) {
  bool expected = false;
  if (!lost_daemon_claimed_.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) return;
  lost_daemon_reason_ = std::move(reason);
  lost_daemon_.store(true, std::memory_order_release);
  // A wait asleep in poll() on this rank's sockets sees the flag now, not at its next slice.
  if (links_.driver) links_.driver->interrupt();
}

}  // namespace gradsync
