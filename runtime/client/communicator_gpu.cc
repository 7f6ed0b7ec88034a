// GPU collectives of a Communicator (gradsync/gradsync.h): CommunicatorImpl's DeviceComm set-up
// and release, and the stream overloads; without CUDA they report kUnimplemented.
#include "client/communicator_impl.h"
#include "gpu/timeline.h"
#include "topology/rail_devices.h"
#if GRADSYNC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace gradsync {

#if GRADSYNC_HAVE_CUDA
using communicator_detail::make_call;

Status CommunicatorImpl::attach_device() {
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
  if (cfg.device == JoinOptions::kDeviceLocalRank) {
    // Resolved here as DeviceComm::create would: the ordinal picks the GPU's rail below.
    int devices = 0;
    if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) cfg.device = opts_.local_rank % devices;
  }
  cfg.op_timeout = opts_.op_timeout;
  cfg.hosts = links_.hosts;
  // The node of every rank, as the coordinator numbered the job's nodes (a grouping key).
  for (uint32_t node : join_.rank_node) cfg.rank_nodes.push_back("node " + std::to_string(node));
  cfg.data_address = join_.data_host;
  cfg.token = opts_.token;
  if (join_.verbs) {
    // The GPU's own NIC where gradsyncd found it usable in place of its device, else the
    // daemon's device (topology/rail_devices.h says why every rank still reaches every other).
    const auto chosen = topology::rank_rdma_device(join_.verbs->rail_devices, cfg.device, join_.verbs->device);
    log_->info("job={} rank={}: GPUDirect RDMA device {}: {}", opts_.job, opts_.rank, chosen.device, chosen.why);
    cfg.verbs_device = chosen.device;
    cfg.verbs_port = int(join_.verbs->port);
    cfg.gid_index = join_.verbs->gid_index;
    cfg.verbs_api = join_.verbs->api;
  }
  auto d = DeviceComm::create(cfg, std::move(ops));
  if (!d.ok()) return d.status();
  gpu_ = std::move(d).value();
  return Status::Ok();
}

void CommunicatorImpl::release_device() {
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
Result<Communicator::GpuBytesSent> Communicator::gpu_bytes_sent_by_link() const {
  DeviceComm* gpu = impl_->gpu();
  return gpu ? gpu->bytes_sent() : Result<GpuBytesSent>(GpuBytesSent{});
}
Result<uint64_t> Communicator::gpu_bytes_sent() const {
  auto b = gpu_bytes_sent_by_link();
  if (!b.ok()) return b.status();
  return b->total();
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
Result<Communicator::GpuBytesSent> Communicator::gpu_bytes_sent_by_link() const { return GpuBytesSent{}; }
Result<uint64_t> Communicator::gpu_bytes_sent() const { return uint64_t{0}; }
Result<gpu::Timeline> gpu::last_timeline(Communicator&) {
  return Status(Code::kUnimplemented, "gradsync was built without CUDA: no GPU timeline");
}
#endif

}  // namespace gradsync
