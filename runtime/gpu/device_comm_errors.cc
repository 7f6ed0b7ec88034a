// How a GPU communicator learns and tells that its collectives failed: the link's and the
// host-staged worker's errors, the kernels' error word (a wait past the op timeout, or an
// abort), the job aborted once for a timeout, and calls that could not be queued whole.
#include "gpu/device_comm.h"

#include "common/log.h"
#include "gpu/device_comm_impl.h"

namespace gradsync {

using namespace device_comm_detail;

Status DeviceComm::fail_from_error_word() {
  Impl& m = *impl_;
#if GRADSYNC_HAVE_GDR
  if (m.gdr) {
    if (Status s = m.gdr->error(); !s.ok()) {
      failed_ = {s.code(), who() + ": " + s.message()};
      return failed_;
    }
  }
#endif
  {
    std::lock_guard lock(m.mu);
    if (!m.staged_error.ok()) {
      failed_ = m.staged_error;
      return failed_;
    }
  }
  Status e = error_word_status();
  if (e.ok()) return e;
  failed_ = e;
  if (e.code() == Code::kDeadlineExceeded) report_timeout(e);
  return failed_;
}

// What the kernels' error word holds, as a status (Ok while it holds nothing); read by the
// caller's thread and by the watcher.
Status DeviceComm::error_word_status() const {
  const Impl& m = *impl_;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  const volatile kernels::NodeError& w = m.words->error;
  const kernels::NodeError e{w.code, w.peer, w.block, w.what};
  if (e.code == 0) return Status::Ok();
  const double ms = double(cfg_.op_timeout.count());
  std::string what;
  if (e.what == 2) {
    what = "the stream waited for host-staged results";
  } else if (e.what == 5) {
    what = "block " + std::to_string(e.block) + " of a step kernel waited for the kernel's other blocks";
  } else if (e.what == 3 || e.what == 4) {
    const std::string peer = "rank " + std::to_string(e.peer) +
                             (size_t(e.peer) < cfg_.hosts.size() ? " (host " + cfg_.hosts[e.peer] + ")" : "");
    // The step channels: the GPUDirect RDMA channels across nodes, CUDA IPC alone on one.
    const char* channel = m.path == Impl::Path::kIpc ? "CUDA IPC step" : "GPUDirect RDMA";
    what = e.what == 3 ? std::string("the stream waited for a ") + channel + " message from " + peer
                       : std::string("the stream waited for a free ") + channel + " send slot (" + peer +
                             " frees them)";
  } else {
    // The node kernels name a peer by its place among the node's ranks: its rank (one node).
    what = std::string("block ") + std::to_string(e.block) + " waited for rank " +
           std::to_string(e.peer) + (e.what == 0 ? " to free a slot" : " to push its chunk");
  }
  if (e.code == 1) {
    return {Code::kDeadlineExceeded, who() + ": a GPU collective did not finish: " + what +
                                         " for more than " + std::to_string(int64_t(ms)) +
                                         " ms (op timeout); that rank is slow, hung, or "
                                         "never called the same collective"};
  }
  std::string reason = ops_.abort_reason();
  return {Code::kAborted, who() + ": a GPU collective stopped: " + what + " when the job was aborted" +
                              (reason.empty() ? "" : ": " + reason)};
}

// A wait of this rank's kernels that timed out fails the job, once: the other ranks stop
// waiting for this one (and their links log what they still waited for). From the caller's
// next call, or at once from the watcher, whichever sees it first.
void DeviceComm::report_timeout(const Status& s) {
  if (timeout_reported_.exchange(true)) return;
  log::get("gpu")->error("{}; the job is aborted", s.message());
  if (ops_.abort_job) ops_.abort_job(s.message());
}

Status DeviceComm::async_error() {
  if (!failed_.ok()) return failed_;
  return fail_from_error_word();
}

Status DeviceComm::failed_to_queue(const CollectiveCall& c, uint64_t number, const Status& s) {
  __atomic_store_n(&impl_->words->abort, 1u, __ATOMIC_RELEASE);
  failed_ = {s.code(), who() + ": GPU " + describe_gpu(c, number) + " could not be queued completely: " + s.message()};
  if (ops_.abort_job) ops_.abort_job(failed_.message());
  return failed_;
}

}  // namespace gradsync
