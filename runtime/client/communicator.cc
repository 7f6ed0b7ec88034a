// Session, Communicator and Work: the public API over the daemon connection, the job's
// shared memory and a worker thread that runs host collectives in call order.
#include <algorithm>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "channel/channel.h"
#include "channel/flight_recorder.h"
#include "channel/shared_memory.h"
#include "client/communicator_internals.h"
#include "client/daemon_client.h"
#include "common/launch_env.h"
#include "client/links.h"
#include "collectives/collective.h"
#include "collectives/cost_model.h"
#include "common/limits.h"
#include "common/log.h"
#include "gradsync/gradsync.h"
#include "gpu/timeline.h"
#if GRADSYNC_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "gpu/device_comm.h"
#endif

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
// How long a channel wait polls with sched_yield after its spin, before it sleeps
// (WaitContext::yield_spin; GRADSYNC_YIELD_US). docs/benchmarks.md has the measurements.
constexpr std::chrono::microseconds kYieldSpin{1000};

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

class WorkImpl {
 public:
  explicit WorkImpl(CollectiveCall call) : call(call) {}
  explicit WorkImpl(std::function<Status()> task) : task(std::move(task)) {}
  void finish(Status s) {
    std::lock_guard lock(mu);
    status = std::move(s);
    finished = true;
    cv.notify_all();
  }
  CollectiveCall call;
  std::function<Status()> task;  // GPU work staged through the host: runs instead of `call`
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
                   wire::JoinResponse join, RankLinks links)
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

  ~CommunicatorImpl() { (void)leave(); }

  Work enqueue(CollectiveCall call) {
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

  // A blocking call runs on the caller's thread when nothing is queued before it: two thread
  // hand-offs (to the worker and back) would cost more than a small collective.
  Status execute(CollectiveCall call) {
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

  Status leave() {
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
    // A peer still waiting on one of this rank's channels made more calls: it learns now.
    mark_left(links_);
    if (failed_.ok() && links_.driver) links_.driver->goodbye(deadline_after(std::chrono::seconds(1)));
    uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof(one)) < 0) { /* monitor also stops on EOF */ }
    if (monitor_.joinable()) monitor_.join();
    if (lost_daemon_.load()) return Status::Ok();
    auto reply = daemon_.call(wire::LeaveRequest{}, deadline_after(kLeaveTimeout));
    return reply.ok() ? Status::Ok() : reply.status();
  }

  // Tells the daemon which data path this rank took and why; the daemon logs it and passes
  // it to the coordinator for `gradsyncctl describe`. No reply; a failure costs only the report.
  void report_path(const std::string& path, const std::string& why, uint64_t gpu_bytes = 0,
                   uint64_t pinned_bytes = 0) {
    std::lock_guard lock(send_mu_);
    if (Status s = daemon_.send(wire::PathReport{path, why, gpu_bytes, pinned_bytes}); !s.ok()) {
      log_->warn("job={} rank={}: reporting the data path to gradsyncd: {}", opts_.job, opts_.rank, s.to_string());
    }
  }

  Status abort(const std::string& reason) {
    {
      std::lock_guard lock(mu_);
      if (left_) return already_left();
    }
    // Our own waits stop at once through the local flag; the daemon spreads it to the others.
    stop_local_waits("job=" + opts_.job + " rank " + std::to_string(opts_.rank) + " aborted the job: " + reason);
    std::lock_guard lock(send_mu_);
    return daemon_.send(wire::AbortRequest{reason, false, 0});
  }

  // ShrinkMode::kAbort (client/elastic.cc): ends the job's collectives on every rank like
  // abort(), but names no culprit: every rank is alive and about to shrink, and a named rank
  // would not be waited for by the others' regroup.
  Status abort_unnamed(const std::string& reason) {
    {
      std::lock_guard lock(mu_);
      if (left_) return already_left();
    }
    stop_local_waits(reason);
    abort_job(shm_.data(), layout_, -1, reason);
    std::lock_guard lock(send_mu_);
    return daemon_.send(wire::AbortRequest{reason, true, -1});
  }

  const JoinOptions& options() const { return opts_; }

  // Non-empty once the job was aborted (by any rank or the daemon) or the daemon was lost.
  std::string abort_reason() const {
    const bool stop = wait_.control->aborted.load(std::memory_order_acquire) ||
                      lost_daemon_.load(std::memory_order_acquire);
    return stop ? aborted_status(wait_).message() : std::string();
  }

#if GRADSYNC_HAVE_CUDA
  // Sets up GPU collectives (collective: every rank at the same point of its join).
  Status attach_device() {
    HostOps ops;
    ops.allreduce_now = [this](const void* send, void* recv, size_t count, DataType type, ReduceOp op) {
      CollectiveCall c{CollectiveKind::kAllreduce, send, recv, count, type, op, 0, Algorithm::kRing, next_seq_++};
      return run(c, kRecordGpuStaged | kRecordInternal);
    };
    ops.run_on_worker = [this](const CollectiveCall& call) {
      CollectiveCall c = call;  // its algorithm: kAuto, or what the GPU call forced
      c.algorithm = resolve(c);
      return run(c, kRecordGpuStaged);
    };
    ops.enqueue = [this](size_t host_calls, std::function<Status(uint32_t)> task) {
      std::lock_guard lock(mu_);
      const uint32_t first = next_seq_;
      next_seq_ += uint32_t(host_calls);
      queue_.push_back(std::make_shared<WorkImpl>([task = std::move(task), first] { return task(first); }));
      cv_.notify_all();
    };
    ops.abort_reason = [this] { return abort_reason(); };
    ops.abort_job = [this](const std::string& reason) { (void)abort(reason); };
    DeviceCommConfig cfg;
    cfg.job = opts_.job;
    cfg.host = links_.hosts.empty() ? std::string() : links_.hosts[opts_.rank];
    cfg.rank = opts_.rank;
    cfg.world_size = links_.world_size;
    cfg.local_rank = opts_.local_rank;
    cfg.local_world_size = opts_.local_world_size;
    cfg.device = opts_.device;
    cfg.op_timeout = opts_.op_timeout;
    cfg.hosts = links_.hosts;
    // The node of every rank, as the coordinator numbered the job's nodes (a grouping key).
    for (uint32_t node : join_.rank_node) cfg.rank_nodes.push_back("node " + std::to_string(node));
    if (join_.verbs) {
      cfg.verbs_device = join_.verbs->device;
      cfg.verbs_port = int(join_.verbs->port);
      cfg.gid_index = join_.verbs->gid_index;
      cfg.verbs_api = join_.verbs->api;
    }
    auto d = DeviceComm::create(cfg, std::move(ops));
    if (!d.ok()) return d.status();
    gpu_ = std::move(d).value();
    return Status::Ok();
  }

  DeviceComm* gpu() { return gpu_.get(); }

  // Before leaving: the GPU work of this rank is done and so is every peer's (their kernels
  // write flags into this rank's memory until their last chunk), then the memory goes.
  void release_device() {
    if (!gpu_) return;
    (void)cudaSetDevice(gpu_->device());
    (void)cudaDeviceSynchronize();
    {
      // Wait for queued staged work: the worker runs it.
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, opts_.op_timeout, [&] { return queue_.empty() && !busy_; });
    }
    gpu_->quiesce();
    if (failed_.ok() && gpu_->async_error().ok() && abort_reason().empty()) {
      uint8_t token = 0;
      CollectiveCall c{CollectiveKind::kBarrier, &token, &token, 1, DataType::kUInt8, ReduceOp::kSum, 0,
                       Algorithm::kRing, 0};
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return !busy_; });
      busy_ = true;
      c.seq = next_seq_++;
      lock.unlock();
      WaitContext wait = wait_;
      wait.deadline = deadline_after(std::chrono::seconds(10));
      Status s = run_collective(links_, wait, c);
      if (!s.ok()) log_->warn("job={} rank={}: barrier before releasing GPU memory: {}", opts_.job, opts_.rank, s.to_string());
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
    gpu_.reset();
  }
#endif
  uint64_t generation() const { return lineage_.generation; }
  void set_lineage(Lineage l) { lineage_ = std::move(l); }

  CommunicatorInternals::State elastic_state() {
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

 private:
  void run_worker() {
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

  Status refused(const CollectiveCall& call, const Status& bad) const {
    // Refused before anything was sent: the communicator stays healthy.
    return {bad.code(), "job=" + opts_.job + " rank " + std::to_string(opts_.rank) + ": " +
                            to_string(call.kind) + " refused: " + bad.message()};
  }
  Status already_left() const {
    return {Code::kFailedPrecondition, "communicator already left job " + opts_.job};
  }

  // Runs one host collective. `flags`: the flight recorder's (kRecordInternal, ...);
  // `queued`: the recorder has its entry already (enqueue/execute).
  Status run(CollectiveCall call, uint8_t flags = kRecordInternal, bool queued = false) {
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
      request_trace_dump(s);
    }
    return s;
  }

  // A collective of this rank failed on its own (not by the job's abort): the whole job stops
  // with this reason. The rank writes the abort into the job's shared memory itself, so the
  // ranks of its node stop at once even when the daemon is paused or gone, and tells the
  // daemon, which tells the coordinator and so the other nodes.
  void fail_together(const Status& s) {
    if (s.code() == Code::kAborted) return;  // the job's abort (or this rank's): already everywhere
    const int culprit = failed_peer(links_, s);
    const std::string me = "rank " + std::to_string(opts_.rank) + " (pid " + std::to_string(::getpid()) +
                           ", host " + host_of(opts_.rank) + ")";
    std::string reason = "job=" + opts_.job + " gen=" + std::to_string(join_.generation) + ": ";
    if (culprit >= 0) {
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

  std::string host_of(int rank) const {
    return size_t(rank) < links_.hosts.size() ? links_.hosts[size_t(rank)] : std::string("?");
  }

  Record record_of(const CollectiveCall& call, uint8_t flags) const {
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

  // After a failed collective: gradsyncd writes the job's local flight recorders to its log
  // directory. No reply; without a daemon there is nobody to ask.
  void request_trace_dump(const Status& why) {
    if (!recorder_->enabled() || lost_daemon_.load()) return;
    std::lock_guard lock(send_mu_);
    (void)daemon_.send(wire::TraceDumpRequest{why.to_string().substr(0, 1024)});
  }

  Algorithm resolve(const CollectiveCall& call) const {
    if (call.algorithm != Algorithm::kAuto) return call.algorithm;
    if (call.kind != CollectiveKind::kAllreduce && call.kind != CollectiveKind::kBarrier) {
      return Algorithm::kRing;
    }
    if (forced_ != Algorithm::kAuto) return forced_;
    return model_.choose(call.count * element_size(call.type));
  }

 public:
  // Measures the cost model's constants on this communicator and agrees on them (max over
  // ranks). Runs before the worker starts, as collectives every rank performs identically.
  Status calibrate() {
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

  void start_worker() { worker_ = std::thread([this] { run_worker(); }); }
  void set_record_path(RecordPath p) {
    record_path_ = p;
    recorder_->set_path(p);
  }

  Communicator::Prediction predict(size_t count, DataType type) const {
    size_t bytes = count * element_size(type);
    return {model_.predict_us(Algorithm::kRing, bytes), model_.predict_us(Algorithm::kTree, bytes),
            model_.choose(bytes)};
  }
  std::string describe_model() const { return model_.describe(); }
  int world_size() const { return links_.world_size; }

 private:
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
    const std::string reason = "job=" + opts_.job + " rank " + std::to_string(opts_.rank) +
                               ": lost the connection to gradsyncd at " + daemon_.socket_path() +
                               " (the daemon died or was stopped)";
    stop_local_waits(reason);
    // The dead daemon cannot abort the job on this node: the ranks here hear it from the job's
    // shared memory, before this rank leaves and marks its channels left (which a sibling still
    // waiting there would read as one call more: MISMATCH; seen in a chaos trial).
    abort_job(shm_.data(), layout_, -1, reason);
    // Sleeping waiters notice the flag within one wait slice (channel.cc).
  }

  // The first caller (abort() or the monitor thread) writes the reason, then raises the flag
  // that waiters test before they read it; later callers change nothing. So the string is
  // written once, before anyone can read it.
  void stop_local_waits(std::string reason) {
    bool expected = false;
    if (!lost_daemon_claimed_.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) return;
    lost_daemon_reason_ = std::move(reason);
    lost_daemon_.store(true, std::memory_order_release);
  }

  JoinOptions opts_;
  DaemonClient daemon_;
  SharedMemory shm_;
  ShmLayout layout_;
  wire::JoinResponse join_;
  Lineage lineage_;
  std::shared_ptr<spdlog::logger> log_;
  RankLinks links_;
  CostModel model_;
  Algorithm forced_ = Algorithm::kAuto;
  WaitContext wait_;
  std::atomic<bool> lost_daemon_{false};  // or aborted by this rank: waits stop
  std::string lost_daemon_reason_;  // written once, by stop_local_waits, before lost_daemon_
  std::atomic<bool> lost_daemon_claimed_{false};
  std::mutex send_mu_;  // one writer at a time on the daemon connection
  Fd wake_;
  Status failed_;  // worker thread only
  std::unique_ptr<FlightRecorder> recorder_;  // this rank's, in the job's memory (disabled: none)
  RecordPath record_path_ = RecordPath::kLocal;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<WorkImpl>> queue_;
  uint32_t next_seq_ = 0;
  bool busy_ = false;  // a collective is running (on the worker or a blocking caller)
  bool left_ = false;
  std::thread monitor_;
  std::thread worker_;
#if GRADSYNC_HAVE_CUDA
  std::unique_ptr<DeviceComm> gpu_;
#endif
};

Communicator::Communicator(std::shared_ptr<CommunicatorImpl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;
Communicator::Communicator(Communicator&&) noexcept = default;
Communicator& Communicator::operator=(Communicator&&) noexcept = default;

int Communicator::rank() const { return impl_->options().rank; }
int Communicator::world_size() const { return impl_->options().world_size; }
uint64_t Communicator::generation() const { return impl_->generation(); }
const std::string& Communicator::job() const { return impl_->options().job; }

namespace {
CollectiveCall make_call(CollectiveKind kind, const void* send, void* recv, size_t count, DataType type,
                         ReduceOp op, int root, CallOptions opts) {
  CollectiveCall c;
  c.kind = kind;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.type = type;
  c.op = op;
  c.root = root;
  c.algorithm = opts.algorithm;
  return c;
}
}  // namespace

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

#if GRADSYNC_HAVE_CUDA
namespace {
// A GPU collective: queued on `stream` by the communicator's DeviceComm.
Status run_on_device(CommunicatorImpl& impl, const CollectiveCall& call, CUstream_st* stream) {
  DeviceComm* gpu = impl.gpu();
  if (gpu == nullptr) {
    const JoinOptions& o = impl.options();
    return {Code::kFailedPrecondition, "job=" + o.job + " rank " + std::to_string(o.rank) +
                                           ": GPU " + to_string(call.kind) +
                                           " on a communicator joined without a "
                                           "device (set JoinOptions::device or GRADSYNC_DEVICE)"};
  }
  return gpu->run(call, stream);
}
}  // namespace

Status Communicator::allreduce(const void* send, void* recv, size_t count, DataType type,
                               ReduceOp op, CUstream_st* stream, CallOptions opts) {
  return run_on_device(
      *impl_, make_call(CollectiveKind::kAllreduce, send, recv, count, type, op, 0, opts), stream);
}
Status Communicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DataType type,
                                    ReduceOp op, CUstream_st* stream, CallOptions opts) {
  return run_on_device(
      *impl_, make_call(CollectiveKind::kReduceScatter, send, recv, recv_count, type, op, 0, opts),
      stream);
}
Status Communicator::all_gather(const void* send, void* recv, size_t send_count, DataType type,
                                CUstream_st* stream, CallOptions opts) {
  return run_on_device(
      *impl_,
      make_call(CollectiveKind::kAllGather, send, recv, send_count, type, ReduceOp::kSum, 0, opts),
      stream);
}
Status Communicator::broadcast(void* buf, size_t count, DataType type, int root,
                               CUstream_st* stream, CallOptions opts) {
  return run_on_device(
      *impl_,
      make_call(CollectiveKind::kBroadcast, buf, buf, count, type, ReduceOp::kSum, root, opts),
      stream);
}
Status Communicator::async_error() {
  DeviceComm* gpu = impl_->gpu();
  return gpu ? gpu->async_error() : Status::Ok();
}
int Communicator::device() const {
  DeviceComm* gpu = impl_->gpu();
  return gpu ? gpu->device() : JoinOptions::kNoDevice;
}
std::string Communicator::gpu_path() const {
  DeviceComm* gpu = impl_->gpu();
  return gpu ? gpu->path() : "none";
}
Result<uint64_t> Communicator::gpu_bytes_sent() const {
  DeviceComm* gpu = impl_->gpu();
  return gpu ? gpu->bytes_sent() : Result<uint64_t>(uint64_t{0});
}
// gpu/timeline.h: the bench's and the tests' way to the DeviceComm's timeline.
Result<gpu::Timeline> gpu::last_timeline(Communicator& comm) {
  CommunicatorImpl* impl = CommunicatorInternals::impl(comm);
  DeviceComm* d = impl != nullptr ? impl->gpu() : nullptr;
  if (d == nullptr) {
    return Status(Code::kFailedPrecondition,
                  "no GPU timeline: the communicator was joined without a device");
  }
  return d->last_timeline();
}
#else
namespace {
Status no_cuda() {
  return {Code::kUnimplemented, "gradsync was built without CUDA: no GPU collectives"};
}
}  // namespace
Status Communicator::allreduce(const void*, void*, size_t, DataType, ReduceOp, CUstream_st*, CallOptions) {
  return no_cuda();
}
Status Communicator::reduce_scatter(const void*, void*, size_t, DataType, ReduceOp, CUstream_st*,
                                    CallOptions) {
  return no_cuda();
}
Status Communicator::all_gather(const void*, void*, size_t, DataType, CUstream_st*, CallOptions) {
  return no_cuda();
}
Status Communicator::broadcast(void*, size_t, DataType, int, CUstream_st*, CallOptions) {
  return no_cuda();
}
Status Communicator::async_error() { return Status::Ok(); }
int Communicator::device() const { return JoinOptions::kNoDevice; }
std::string Communicator::gpu_path() const { return "none"; }
Result<uint64_t> Communicator::gpu_bytes_sent() const { return uint64_t{0}; }
Result<gpu::Timeline> gpu::last_timeline(Communicator&) {
  return Status(Code::kUnimplemented, "gradsync was built without CUDA: no GPU timeline");
}
#endif

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
