// The GPU side of a communicator: allreduce on device memory, queued on the caller's stream.
//
// Two paths, chosen once at join and agreed by every rank:
// - cuda-ipc: every rank on one node (and at most kernels::kMaxNodeRanks of them). Each rank
//   allocates one region of its GPU's memory (flags + slots, kernels/cuda_node.cuh), exports
//   it with cudaIpcGetMemHandle, and opens every peer's; one kernel per call pushes into the
//   peers' slots and reduces what they pushed. Nothing per call touches the host.
// - host-staged: ranks on several nodes. The caller's stream gets an event and a kernel that
//   copies the buffer piece by piece to pinned host memory, with kernels that signal and wait
//   on words in mapped host memory in between; the communicator's worker runs the host
//   allreduce on each piece as it lands (daemons, TCP proxy: design §3), and the stream copies
//   each result back while the next piece is on the network. All queued at the call.
//
// Built only with CUDA (GRADSYNC_HAVE_CUDA); communicator.cc refuses a device otherwise.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/gradsync.h"

namespace gradsync {

// What the device side needs from its communicator.
struct HostOps {
  // A host allreduce, run now on the calling thread (set-up, before the worker starts).
  std::function<Status(const void* send, void* recv, size_t count, DataType, ReduceOp)> allreduce_now;
  // Runs `task` on the communicator's worker, after everything queued before it.
  std::function<void(std::function<Status()> task)> enqueue;
  // A host allreduce from inside a task on the worker.
  std::function<Status(const void* send, void* recv, size_t count, DataType, ReduceOp)> allreduce_on_worker;
  // Non-empty once the job was aborted or the daemon lost: GPU waits stop.
  std::function<std::string()> abort_reason;
};

struct DeviceCommConfig {
  std::string job;
  std::string host;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int device = 0;  // an ordinal or JoinOptions::kDeviceLocalRank (resolved by create)
  std::chrono::milliseconds op_timeout{300'000};
};

class DeviceComm {
 public:
  // Collective: every rank of the communicator calls it at the same point.
  static Result<std::unique_ptr<DeviceComm>> create(const DeviceCommConfig& cfg, HostOps ops);
  ~DeviceComm();
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  Status allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op,
                   cudaStream_t stream);
  Status async_error();
  int device() const { return cfg_.device; }
  const char* path() const;

  // Per-stage timing of the last host-staged call (for the overlap figure of the bench).
  struct StagedTiming {
    double wall_us = 0;     // the call's span on the stream (GPU clock; the worker's if unknown)
    double copy_us = 0;     // the stream's busy time in the call: D2H + H2D copies
    double network_us = 0;  // sum over pieces of the host allreduce
    int pieces = 0;
  };
  StagedTiming last_staged_timing() const;

  struct Impl;

 private:
  DeviceComm(DeviceCommConfig cfg, HostOps ops);
  Status setup_ipc(bool* usable);
  Status setup_staged();
  Status check_buffers(const void* send, void* recv, size_t bytes) const;
  Status fail_from_error_word();
  std::string who() const;

  DeviceCommConfig cfg_;
  HostOps ops_;
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> stop_{false};
  std::thread watcher_;  // copies the job's abort state into the mapped abort word
  Status failed_;
  uint64_t calls_ = 0;
};

}  // namespace gradsync
