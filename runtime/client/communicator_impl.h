// The client library's internals (the class behind Communicator and Work), shared by the files
// that implement them: communicator.cc (the public API: JoinOptions, Work, Communicator,
// Session and the join), communicator_impl.cc (CommunicatorImpl's host side: the worker that
// runs host collectives in call order, the cost model's calibration, abort, leave and the
// daemon-connection monitor) and communicator_gpu.cc (GPU collectives through DeviceComm).
// Not a public header.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "channel/channel.h"
#include "common/env.h"
#include "channel/flight_recorder.h"
#include "channel/shared_memory.h"
#include "client/communicator_internals.h"
#include "client/daemon_client.h"
#include "client/links.h"
#include "collectives/collective.h"
#include "collectives/cost_model.h"
#include "common/log.h"
#include "gradsync/gradsync.h"
#if GRADSYNC_HAVE_CUDA
#include "gpu/device_comm.h"
#endif

namespace gradsync {
namespace communicator_detail {

// A CollectiveCall of the public API's arguments (its seq is set when it is queued).
inline CollectiveCall make_call(CollectiveKind kind, const void* send, void* recv, size_t count, DataType type,
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

}  // namespace communicator_detail

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

class CommunicatorImpl {
 public:
  CommunicatorImpl(JoinOptions opts, DaemonClient daemon, SharedMemory shm, ShmLayout layout,
                   wire::JoinResponse join, RankLinks links);

  ~CommunicatorImpl() { (void)leave(); }

  Work enqueue(CollectiveCall call);

  // A blocking call runs on the caller's thread when nothing is queued before it: two thread
  // hand-offs (to the worker and back) would cost more than a small collective.
  Status execute(CollectiveCall call);

  Status leave();

  // Tells the daemon which data path this rank took and why; the daemon logs it and passes
  // it to the coordinator for `gradsyncctl describe`. No reply; a failure costs only the report.
  void report_path(const std::string& path, const std::string& why, uint64_t gpu_bytes = 0,
                   uint64_t pinned_bytes = 0);

  Status abort(const std::string& reason);

  // ShrinkMode::kAbort (client/elastic.cc): ends the job's collectives on every rank like
  // abort(), but names no culprit: every rank is alive and about to shrink, and a named rank
  // would not be waited for by the others' regroup.
  Status abort_unnamed(const std::string& reason);

  const JoinOptions& options() const { return opts_; }

  // Non-empty once the job was aborted (by any rank or the daemon) or the daemon was lost.
  std::string abort_reason() const;

#if GRADSYNC_HAVE_CUDA
  // Sets up GPU collectives (collective: every rank at the same point of its join).
  Status attach_device();

  DeviceComm* gpu() { return gpu_.get(); }

  // Before leaving: the GPU work of this rank is done and so is every peer's (their kernels
  // write flags into this rank's memory until their last chunk), then the memory goes.
  void release_device();
#endif
  uint64_t generation() const { return lineage_.generation; }
  void set_lineage(Lineage l) { lineage_ = std::move(l); }

  CommunicatorInternals::State elastic_state();

 private:
  void run_worker();

  Status refused(const CollectiveCall& call, const Status& bad) const;
  Status already_left() const {
    return {Code::kFailedPrecondition, "communicator already left job " + opts_.job};
  }

  // Runs one host collective. `flags`: the flight recorder's (kRecordInternal, ...);
  // `queued`: the recorder has its entry already (enqueue/execute).
  Status run(CollectiveCall call, uint8_t flags = kRecordInternal, bool queued = false);

  // A collective of this rank failed on its own (not by the job's abort): the whole job stops
  // with this reason. The rank writes the abort into the job's shared memory itself, so the
  // ranks of its node stop at once even when the daemon is paused or gone, and tells the
  // daemon, which tells the coordinator and so the other nodes.
  // An abort a peer told this rank over a socket (it is kAborted too) is spread the same way:
  // this node had not heard of it.
  void fail_together(const Status& s);

  // After a failed collective: tells the rank at the other end of each of this rank's sockets
  // the job's abort (ChannelDriver::tell_abort), so that ranks on other nodes stop at once,
  // even when this node's daemon is dead and cannot tell the coordinator.
  void tell_peers(const Status& s);

  std::string host_of(int rank) const;

  Record record_of(const CollectiveCall& call, uint8_t flags) const;

  // After a failed collective: gradsyncd writes the job's local flight recorders to its log
  // directory. No reply; without a daemon there is nobody to ask.
  void request_trace_dump(const Status& why);

  Algorithm resolve(const CollectiveCall& call) const;

 public:
  // Measures the cost model's constants on this communicator and agrees on them (max over
  // ranks). Runs before the worker starts, as collectives every rank performs identically.
  Status calibrate();

  void start_worker() { worker_ = std::thread([this] { run_worker(); }); }
  void set_record_path(RecordPath p) {
    record_path_ = p;
    recorder_->set_path(p);
  }

  Communicator::Prediction predict(size_t count, DataType type) const;
  std::string describe_model() const { return model_.describe(); }
  int world_size() const { return links_.world_size; }

 private:
  // Watches the daemon connection: the daemon never writes to it unasked after the join, so
  // any readiness here means it closed (the daemon died).
  void monitor_daemon();

  // The first caller (abort() or the monitor thread) writes the reason, then raises the flag
  // that waiters test before they read it; later callers change nothing. So the string is
  // written once, before anyone can read it.
  void stop_local_waits(std::string reason);

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

}  // namespace gradsync
