// GPU ranks for the verbs tests: the World of collective_matrix.h over device memory, on a
// DaemonWorld (daemon_cluster.h) whose communicators were joined with a CUDA device.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "daemon_cluster.h"

namespace gradsync::testing {

// Ranks as threads of one process share one CUDA context, which one process per GPU (the
// real layout) never does. With CUDA's lazy loading, a kernel's first launch may wait for the
// kernels already running in the context, and here those wait for ranks of this very process
// (a node kernel waiting for its peer, a step waiting for a message): the first hierarchical
// allreduce hung that way on the H200. With CUDA's default of 8 hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS), the streams of 6 or 8 ranks share queues, and a kernel of one
// rank waits behind another rank's kernel that is waiting for it: 2x4 and 3x2 hung so in their
// first call. So every kernel loads at start and the context gets CUDA's 32 queues. Set before
// CUDA starts: gpu_count(), which every GPU test calls first, does it (a variable set by the
// environment is left as it is).
inline bool share_one_context() {
  static const bool done = ::setenv("CUDA_MODULE_LOADING", "EAGER", 0) == 0 &&
                           ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0;
  return done;
}

inline int gpu_count() {
  share_one_context();
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return {Code::kInternal, std::string(what) + ": " + cudaGetErrorString(e)};
}

// The World of collective_matrix.h over device memory: each host call runs on device copies of
// its buffers (aliasing kept: an in-place call stays in place), on a stream of the rank.
//
// Every rank's device buffer, pinned host buffer and non-blocking stream are made once, before
// any collective runs, and each call only queues async copies on that stream. With several
// ranks on one GPU (the GPU machine may lend one), a legacy-stream copy, a pageable copy, a
// cudaFree or a cudaFreeHost of one rank would wait for another rank's stream, whose kernels
// may be waiting for this rank: a deadlock the product does not have (its waits depend on the
// peers' worker threads, not on their host threads), made by the test.
class GpuWorld {
 public:
  static constexpr size_t kCapacity = size_t(4) << 20;  // bytes per rank: the matrix needs < 1 MiB

  explicit GpuWorld(DaemonWorld& w) : w_(w), ranks_(size_t(w.size())) {
    for (int r = 0; r < size(); ++r) {
      Rank& k = ranks_[r];
      k.device = w_.comm(r).device();
      error_ = cuda_status(cudaSetDevice(k.device), "cudaSetDevice");
      if (error_.ok()) error_ = cuda_status(cudaMalloc(reinterpret_cast<void**>(&k.dev), kCapacity), "cudaMalloc");
      if (error_.ok()) error_ = cuda_status(cudaHostAlloc(reinterpret_cast<void**>(&k.host), kCapacity, 0), "cudaHostAlloc");
      if (error_.ok()) error_ = cuda_status(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking), "cudaStreamCreate");
      if (!error_.ok()) return;
    }
  }
  ~GpuWorld() {
    for (Rank& k : ranks_) {
      (void)cudaSetDevice(k.device);
      if (k.stream) (void)cudaStreamSynchronize(k.stream);
      if (k.stream) (void)cudaStreamDestroy(k.stream);
      if (k.dev) (void)cudaFree(k.dev);
      if (k.host) (void)cudaFreeHost(k.host);
    }
  }
  int size() const { return w_.size(); }
  std::vector<Status> collective(std::vector<CollectiveCall> calls) {
    return w_.run([&](int r) { return error_.ok() ? run_on_device(r, calls[r]) : error_; });
  }

 private:
  struct Rank {
    int device = 0;
    uint8_t* dev = nullptr;
    uint8_t* host = nullptr;
    cudaStream_t stream = nullptr;
  };

  // The call's buffers in the rank's device buffer: one range over both when they overlap (in
  // place), so that the device call sees the same aliasing as the host call.
  Status run_on_device(int r, const CollectiveCall& k) {
    Communicator& comm = w_.comm(r);
    if (k.kind == CollectiveKind::kBarrier) return comm.barrier();
    Rank& rk = ranks_[r];
    const size_t es = element_size(k.type), n = size_t(size());
    size_t send_bytes = k.count * es, recv_bytes = k.count * es;
    if (k.kind == CollectiveKind::kReduceScatter) send_bytes *= n;
    if (k.kind == CollectiveKind::kAllGather) recv_bytes *= n;
    const auto* s0 = static_cast<const uint8_t*>(k.send);
    auto* r0 = static_cast<uint8_t*>(k.recv);
    const bool overlap = s0 && r0 && s0 < r0 + recv_bytes && r0 < s0 + send_bytes;
    GS_RETURN_IF_ERROR(cuda_status(cudaSetDevice(rk.device), "cudaSetDevice"));
    // Host bytes [lo, lo + span) of the call go to device offset 0 (overlapping), or send at
    // 0 and recv at recv_at.
    const uint8_t* lo = overlap ? std::min<const uint8_t*>(s0, r0) : nullptr;
    const size_t span = overlap ? size_t(std::max<const uint8_t*>(s0 + send_bytes, r0 + recv_bytes) - lo) : 0;
    const size_t recv_at = (send_bytes + 255) / 256 * 256;
    if ((overlap ? span : recv_at + recv_bytes) > kCapacity) {
      return {Code::kInvalidArgument, "GpuWorld: a call of more than " + std::to_string(kCapacity) + " bytes"};
    }
    uint8_t* dsend = overlap ? rk.dev + (s0 - lo) : rk.dev;
    uint8_t* drecv = overlap ? rk.dev + (r0 - lo) : rk.dev + recv_at;
    auto h2d = [&](size_t at, const uint8_t* src, size_t bytes) {
      if (bytes == 0) return Status::Ok();
      std::memcpy(rk.host + at, src, bytes);
      return cuda_status(cudaMemcpyAsync(rk.dev + at, rk.host + at, bytes, cudaMemcpyHostToDevice, rk.stream),
                         "cudaMemcpyAsync");
    };
    Status s;
    if (overlap) {
      s = h2d(0, lo, span);
    } else {
      s = h2d(0, s0, send_bytes);
      if (s.ok() && r0 != nullptr) s = h2d(recv_at, r0, recv_bytes);
    }
    const CallOptions opts{k.algorithm};
    if (s.ok()) {
      switch (k.kind) {
        case CollectiveKind::kAllreduce: s = comm.allreduce(dsend, drecv, k.count, k.type, k.op, rk.stream, opts); break;
        case CollectiveKind::kReduceScatter:
          s = comm.reduce_scatter(dsend, drecv, k.count, k.type, k.op, rk.stream, opts);
          break;
        case CollectiveKind::kAllGather: s = comm.all_gather(dsend, drecv, k.count, k.type, rk.stream, opts); break;
        case CollectiveKind::kBroadcast: s = comm.broadcast(drecv, k.count, k.type, k.root, rk.stream, opts); break;
        case CollectiveKind::kBarrier: break;
      }
    }
    const size_t back_at = overlap ? 0 : recv_at, back_bytes = overlap ? span : recv_bytes;
    if (s.ok() && back_bytes) {
      s = cuda_status(cudaMemcpyAsync(rk.host + back_at, rk.dev + back_at, back_bytes, cudaMemcpyDeviceToHost,
                                      rk.stream), "cudaMemcpyAsync");
    }
    Status synced = cuda_status(cudaStreamSynchronize(rk.stream), "cudaStreamSynchronize");
    if (s.ok()) s = synced;
    if (s.ok()) s = comm.async_error();
    if (s.ok() && back_bytes) std::memcpy(overlap ? const_cast<uint8_t*>(lo) : r0, rk.host + back_at, back_bytes);
    return s;
  }

  DaemonWorld& w_;
  std::vector<Rank> ranks_;
  Status error_;
};

// Microseconds per float32 sum allreduce of `bytes` on device buffers, in place, every rank of
// `world` on a non-blocking stream of its own (no legacy-stream call: ranks may share a GPU):
// two warm-up calls, a barrier, then `iters` calls timed; the slowest rank's time.
inline Result<double> device_allreduce_us(DaemonWorld& world, size_t bytes, int iters) {
  std::vector<double> us(size_t(world.size()), 0.0);
  // Allocation and release between barriers: ranks that share a GPU share its context, and a
  // cudaMalloc or cudaFree there waits for (and blocks kernel launches until) all of its work,
  // while another rank's queued waits need the emulated NIC, whose copies are kernels.
  auto st = world.run([&](int r) -> Status {
    Communicator& comm = world.comm(r);
    GS_RETURN_IF_ERROR(cuda_status(cudaSetDevice(comm.device()), "cudaSetDevice"));
    void* buf = nullptr;
    GS_RETURN_IF_ERROR(cuda_status(cudaMalloc(&buf, bytes), "cudaMalloc"));
    cudaStream_t stream = nullptr;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaMemsetAsync(buf, 0, bytes, stream);
    cudaStreamSynchronize(stream);
    const size_t count = bytes / 4;
    Status s = comm.barrier();
    for (int i = 0; i < 2 && s.ok(); ++i) s = comm.allreduce(buf, buf, count, DataType::kFloat32, ReduceOp::kSum, stream);
    cudaStreamSynchronize(stream);
    if (s.ok()) s = comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters && s.ok(); ++i)
      s = comm.allreduce(buf, buf, count, DataType::kFloat32, ReduceOp::kSum, stream);
    cudaStreamSynchronize(stream);
    us[r] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
    if (s.ok()) s = comm.async_error();
    if (s.ok()) s = comm.barrier();
    cudaStreamDestroy(stream);
    cudaFree(buf);
    return s;
  });
  for (int r = 0; r < world.size(); ++r) {
    if (!st[r].ok()) return Status(st[r].code(), "rank " + std::to_string(r) + ": " + st[r].message());
  }
  return *std::max_element(us.begin(), us.end());
}

// The time per call of `device_allreduce_us` for each of the rows' sizes (`Row::bytes`), into
// `Row::us[column]`: 20 calls per size, 5 from 64 MiB on.
template <class Row>
Status device_allreduce_sweep(DaemonWorld& world, std::vector<Row>& rows, int column) {
  for (auto& row : rows) {
    auto us = device_allreduce_us(world, row.bytes, row.bytes >= (size_t(64) << 20) ? 5 : 20);
    if (!us.ok()) return us.status();
    row.us[column] = *us;
  }
  return Status::Ok();
}

// Rank r uses GPU r modulo the visible GPUs.
inline void on_gpus(int rank, JoinOptions& o) { o.device = rank % std::max(gpu_count(), 1); }

}  // namespace gradsync::testing
