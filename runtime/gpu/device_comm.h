// The GPU side of a communicator: allreduce, reduce_scatter, all_gather and broadcast on
// device memory, queued on the caller's stream; the call returns without waiting for the GPU.
// Same semantics as the host collectives (gradsync.h; in place like NCCL), same numeric rules.
//
// The path is chosen once at join and agreed by every rank (gradsyncctl describe shows it and
// why): cuda-ipc and host-staged below; between nodes, calls from a measured size take a
// the step channels (gpu/gdr_channels.h: GPUDirect RDMA, or TCP peers where a daemon runs no
// verbs), whose allreduce is hierarchical where nodes hold L >= 2 ranks each and the cost model
// predicts it faster (CUDA IPC pairs inside each node, a ring per local index between them):
// - cuda-ipc: every rank on one node (and at most kernels::kMaxNodeRanks of them). Each rank
//   allocates one region of its GPU's memory (flags + slots, kernels/cuda_node.cuh), exports
//   it with cudaIpcGetMemHandle, and opens every peer's; one kernel per call pushes into the
//   peers' slots and consumes what they pushed. Nothing per call touches the host, so every
//   collective can be captured in a CUDA graph. What each pushes and consumes:
//     allreduce       input to every peer; folds all inputs in rank order;
//     reduce_scatter  segment s of the input to rank s only; folds segment `rank` of every
//                     input in rank order (the host loops' rank-order fold, bit for bit);
//     all_gather      input to every peer; copies each peer's into its segment of recv;
//     broadcast       the root pushes its buffer, the others copy it.
//   That one-shot push sends n - 1 buffers per rank. From 3 ranks, allreduce and broadcast of
//   at least GRADSYNC_GPU_TWOSHOT_MIN bytes (default 1 MiB) go two-shot instead
//   (kernels/cuda_node_two_shot.cuh): a reduce_scatter (broadcast: a scatter from the root)
//   then an all_gather, both by direct pushes, 2 (n-1)/n of the buffer per rank, what a ring
//   sends, in 2 rounds instead of 2 (n-1) hops. Small calls keep the low-latency lines.
//   The per-block sequence numbers and the low-latency call counts advance the same way on
//   every rank whatever the collective, so calls of different collectives interleave freely
//   (cuda_node.cuh says how the flags and the line parity stay consistent).
// - host-staged: ranks on several nodes. The caller's stream gets kernels that signal and wait
//   on words in mapped host memory and copies between the device buffers and pinned staging
//   slots, piece by piece; the communicator's worker runs the host collective of the same kind
//   on each piece as it lands (daemons, TCP proxy: design §3), and the stream copies each
//   result back while the next piece is on the network. All queued at the call. A piece is a
//   range of element offsets of the segment:
//     allreduce       D2H the range; host allreduce in place; H2D back;
//     reduce_scatter  D2H the range of every segment (one 2D copy) into nranks rows of the
//                     slot; host reduce_scatter in place (recv = row `rank`); H2D that row;
//     all_gather      D2H the range of send into row `rank`; host all_gather in place; H2D
//                     every row into its segment of recv (one 2D copy);
//     broadcast       the root copies D2H, the others H2D; host broadcast in place.
//   Not capturable in a CUDA graph (its host half starts at the call; refused under capture).
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

#include "collectives/collective.h"
#include "gpu/timeline.h"
#include "gradsync/gradsync.h"

namespace gradsync {

struct GdrConfig;  // gpu/gdr_channels.h

// What the device side needs from its communicator.
struct HostOps {
  // A host allreduce, run now on the calling thread (set-up, before the worker starts).
  std::function<Status(const void* send, void* recv, size_t count, DataType, ReduceOp)> allreduce_now;
  // Runs `task` on the communicator's worker, after everything queued before it. The task's
  // `host_calls` host collectives get their sequence numbers now, from the one passed to the
  // task on: a host call the caller makes after this one is numbered after them on every
  // rank, however far the worker got (numbered when the task ran, ranks would disagree).
  std::function<void(size_t host_calls, std::function<Status(uint32_t first_seq)> task)> enqueue;
  // A host collective (allreduce, reduce_scatter, all_gather or broadcast: call.kind, on host
  // buffers, call.seq one that enqueue reserved) from inside a task on the worker.
  std::function<Status(const CollectiveCall& call)> run_on_worker;
  // Non-empty once the job was aborted or the daemon lost: GPU waits stop.
  std::function<std::string()> abort_reason;
  // Aborts the job on every rank (a GPU path that failed on its own, e.g. an RDMA error).
  std::function<void(const std::string& reason)> abort_job;
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
  std::vector<std::string> hosts;  // every rank's host, for errors naming a peer
  // Every rank's node (the coordinator's node id); empty: `hosts` tells the nodes apart.
  std::vector<std::string> rank_nodes;
  // The RDMA device port of this node's daemon (empty: TCP only), for GPUDirect RDMA.
  std::string verbs_device;
  int verbs_port = 1;
  int gid_index = -1;
  std::string verbs_api;
  // The step channels over TCP (GRADSYNC_GPU_STAGED=steps): this node's data address (its
  // gradsyncd's), where the rank listens, and the job token that keys the connections.
  std::string data_address;
  std::string token;
};

class DeviceComm {
 public:
  // Collective: every rank of the communicator calls it at the same point.
  static Result<std::unique_ptr<DeviceComm>> create(const DeviceCommConfig& cfg, HostOps ops);
  ~DeviceComm();
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  // Queues one collective on `stream`: call.kind is allreduce, reduce_scatter, all_gather or
  // broadcast, with the host API's arguments (count per rank as there; call.algorithm and
  // call.seq are ignored). Bad arguments are refused before anything is queued.
  Status run(const CollectiveCall& call, cudaStream_t stream);
  Status async_error();
  int device() const { return cfg_.device; }
  const char* path() const;
  // Why path() was chosen, for logs and `gradsyncctl describe`.
  const std::string& path_why() const;
  // Payload bytes this rank sent to other GPUs so far, by link (Communicator::GpuBytesSent):
  // the kernels' counter of CUDA IPC stores (waits for nothing but its copy) and the RDMA
  // links' counters of writes posted.
  Result<Communicator::GpuBytesSent> bytes_sent();
  // The memory this communicator holds, stated in `gradsyncctl describe`: GPU memory (the
  // CUDA IPC region and its counters, GPUDirect RDMA slots, the timeline) and pinned host
  // memory (staging slots, mapped words, RDMA slots the NIC reaches in host memory). Its GPU
  // memory stays within GRADSYNC_GPU_MEMORY_MAX MiB (default 320): the IPC region shrinks its
  // chunks to fit, and GPUDirect slots that do not fit leave the calls host-staged.
  struct MemoryUse {
    uint64_t gpu_bytes = 0;
    uint64_t pinned_host_bytes = 0;
    MemoryUse& operator+=(const MemoryUse& o) {
      gpu_bytes += o.gpu_bytes;
      pinned_host_bytes += o.pinned_host_bytes;
      return *this;
    }
  };
  MemoryUse memory() const;
  // Before the memory goes (leave, after the stream is idle): the GPUDirect ring's worker
  // sends its last credits and stops.
  void quiesce();

  // Per-stage timing of the last host-staged call (for the overlap figure of the bench).
  struct StagedTiming {
    double wall_us = 0;     // the call's span on the stream (GPU clock; the worker's if unknown)
    double copy_us = 0;     // the stream's busy time in the call: D2H + H2D copies
    double network_us = 0;  // sum over pieces of the host collective
    int pieces = 0;
  };
  StagedTiming last_staged_timing() const;

  // The in-kernel timeline of the last call (cuda-ipc, chunked protocol; GRADSYNC_GPU_TIMELINE=1
  // at creation): gpu/timeline.h. Waits for that call's kernel only (an event recorded after
  // it), then copies its records on a private stream.
  Result<gpu::Timeline> last_timeline();

  struct Impl;

 private:
  DeviceComm(DeviceCommConfig cfg, HostOps ops);
  Status setup_ipc(bool* usable);
  Status count_gpu_shares();
  void release_ipc();
  Status setup_staged();
  Status setup_gdr();
  Status setup_node_steps();
  Status agree_algorithm();
  GdrConfig gdr_config() const;  // gpu/gdr_channels.h, with GPUDirect RDMA only
  std::string slots_over_budget(const GdrConfig& g) const;
  Status fit_slots(GdrConfig& g, bool pairs) const;
  Status plan_hierarchical(GdrConfig& g, std::string* why_not) const;
  Status measure_gdr_min_bytes();
  Status setup_timeline();
  Status check_call(const CollectiveCall& call) const;
  Status check_device_buffer(const char* name, const void* p) const;
  Status run_staged(const CollectiveCall& call, cudaStream_t stream, uint64_t number);
  // A call that could not be queued whole on the step channels: part of it may be
  // on the stream, so the abort word ends its waits and the job is aborted (the peers wait for
  // its messages); the communicator is failed from here on.
  Status failed_to_queue(const CollectiveCall& call, uint64_t number, const Status& s);
  Status fail_from_error_word();
  Status error_word_status() const;
  void report_timeout(const Status& s);
  std::string who() const;

  DeviceCommConfig cfg_;
  HostOps ops_;
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> timeout_reported_{false};  // report_timeout() ran
  std::thread watcher_;  // copies the job's abort state into the mapped abort word, reports timeouts
  Status failed_;
  uint64_t calls_ = 0;
};

}  // namespace gradsync
