// The GPU communicator's internals (gpu/device_comm.h), shared by the files that implement
// it: device_comm.cc (set-up, the choice of path, the one-node CUDA IPC path, errors),
// device_comm_staged.cc (the host-staged path) and device_comm_gdr.cc (the step channels'
// set-up).
// Not a public header.
#pragma once

#include <cuda_runtime_api.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/env.h"
#include "gpu/device_comm.h"
#include "gpu/ipc_memory.h"
#include "gpu/plan/cost_model.h"
#include "kernels/cuda_node.cuh"
#if GRADSYNC_HAVE_GDR
#include "gpu/gdr_channels.h"
#endif

namespace gradsync {
namespace device_comm_detail {

using Clock = std::chrono::steady_clock;

// A communicator's GPU memory at most (DeviceComm::memory()): GRADSYNC_GPU_MEMORY_MAX MiB.
inline uint64_t gpu_memory_budget() { return uint64_t(env_positive("GRADSYNC_GPU_MEMORY_MAX", 320)) << 20; }

// Words the kernels and the host share, in mapped pinned host memory.
struct HostWords {
  kernels::NodeError error;
  uint32_t abort;
  uint32_t pad;
  // host-staged, counted in pieces since set-up (monotonic):
  uint64_t landed;   // the stream copied this many pieces to the staging slots
  uint64_t reduced;  // the worker ran the host collective on this many pieces, in place
  uint64_t done;     // calls whose results the stream copied back
  // GPU clock per call (for the overlap figure), in a ring indexed by the call's sequence
  // number, so that a call's stamps survive while the stream runs the next ones.
  static constexpr size_t kStampRing = 64;
  struct Stamps {
    uint64_t start_ns, done_ns, waited_ns;  // the call's span on the stream and its waits
  } stamps[kStampRing];
};

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceScope {
 public:
  Status enter(int device) {
    (void)cudaGetDevice(&prev_);
    mine_ = device;
    if (prev_ != device) {
      if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
        return {Code::kInternal, std::string("cudaSetDevice: ") + cudaGetErrorString(e)};
      }
    }
    return Status::Ok();
  }
  ~DeviceScope() {
    if (prev_ >= 0 && prev_ != mine_) (void)cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
  int mine_ = -1;
};

// One row of the set-up exchange: summed (uint8) over ranks, every other row is zero.
struct IpcEntry {
  IpcHandle ipc;
  char bus_id[32];
};

// Polls until `done()` or the deadline (every wait has one): spins for 50 us (a small
// piece's copy to pinned memory lands within that), polls with sched_yield until
// GRADSYNC_YIELD_US (default 1 ms) has passed, then sleeps 20 us between looks. A 20 us sleep
// lasts about 70 us with the kernel's default timer slack: with a sleep after 100 looks, as
// before, a small staged call took 94-99 us (8 B) on the H200 host; with this, 42-45 us
// (StagedRdmaBench.DISABLED_SmallCallsInOneProcess, docs/benchmarks.md).
template <class F>
bool poll_until(F done, Clock::time_point deadline) {
  static const auto yield = std::chrono::microseconds(std::max(0L, env_positive("GRADSYNC_YIELD_US", 1000)));
  const auto spin_until = Clock::now() + std::chrono::microseconds(50), yield_until = spin_until + yield;
  for (;;) {
    if (done()) return true;
    const auto now = Clock::now();
    if (now > deadline) return false;
    if (now < spin_until) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else if (now < yield_until) {
      sched_yield();
    } else {
      ::usleep(20);
    }
  }
}

// From this many bytes, allreduce and broadcast among 3 or more ranks of a node go two-shot:
// measured with 8 ranks as threads on one H200, two-shot took 0.65x the one-shot path's speed
// at 256 KiB and 1.56x at 1 MiB (docs/benchmarks.md).
inline constexpr long kTwoShotMinBytes = 1 << 20;

// The host-staged path cuts a call into pieces: the stream copies one while the worker runs
// the host collective of another. A quarter of the call, from 4 to 8 MiB: smaller pieces
// were slower (below, when ring threads started at 4 MiB; 2 MiB pieces with threads from
// 1 MiB: no better at 8 MiB), and at most 8 MiB so that a large call still pipelines.
// Measured on the H200 host (2 nodes x 1 rank, 16 rings, 8 ring threads, GB/s at 8 / 32 /
// 128 / 512 MiB): pieces of 2 MiB 1.8/2.0/2.1/2.4, 4 MiB 3.1/3.6/5.1/5.2, 8 MiB
// 1.9/6.4/7.7/7.5, 16 MiB 1.8/5.9/6.7/6.6; a one-piece call is the slow case.
inline constexpr size_t kMinPiece = size_t(4) << 20;
inline constexpr size_t kMaxPiece = size_t(8) << 20;

inline size_t piece_for(size_t call_bytes) { return std::clamp(call_bytes / 4 / 64 * 64, kMinPiece, kMaxPiece); }


// "reduce_scatter #3 (count=10 type=float32 op=sum)", for messages.
inline std::string describe_gpu(const CollectiveCall& c, uint64_t number) {
  std::string s = std::string(to_string(c.kind)) + " #" + std::to_string(number) +
                  " (count=" + std::to_string(c.count) + " type=" + to_string(c.type);
  if (c.kind == CollectiveKind::kAllreduce || c.kind == CollectiveKind::kReduceScatter) {
    s += std::string(" op=") + to_string(c.op);
  }
  if (c.kind == CollectiveKind::kBroadcast) s += " root=" + std::to_string(c.root);
  return s + ")";
}

inline kernels::NodeCollective node_kind(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kReduceScatter:
      return kernels::NodeCollective::kReduceScatter;
    case CollectiveKind::kAllGather:
      return kernels::NodeCollective::kAllGather;
    case CollectiveKind::kBroadcast:
      return kernels::NodeCollective::kBroadcast;
    default:
      return kernels::NodeCollective::kAllreduce;
  }
}

// Buffers made of world_size segments: reduce_scatter's send, all_gather's recv.
inline bool strided(CollectiveKind k) {
  return k == CollectiveKind::kReduceScatter || k == CollectiveKind::kAllGather;
}

}  // namespace device_comm_detail

struct DeviceComm::Impl {
  enum class Path { kSingle, kIpc, kStaged } path = Path::kSingle;
  std::string why = "one rank";  // why this path (path_why())
  // The CUDA IPC kernels (cuda-ipc: every rank on one node; NodeArgs::me is the rank).
  kernels::NodeLayout layout;
  kernels::NodeArgs args;
  int gpu_shares = 1;  // ranks on this rank's GPU, this one included (count_gpu_shares)
  int most_gpu_shares = 1;  // the most ranks on any one GPU of the world (the same on every rank)
  bool node_kernel_queued = false;  // a node kernel was queued (bytes_sent reads their counter)
  // GRADSYNC_ALGO for GPU calls, agreed by every rank (nullopt: auto).
  std::optional<plan::Algo> env_algo;
  void* region = nullptr;
  std::vector<void*> opened;  // peers' regions opened through IPC
  uint64_t* progress = nullptr;
  device_comm_detail::HostWords* words = nullptr;      // host view
  device_comm_detail::HostWords* words_dev = nullptr;  // device view of the same memory
  // What this file's allocations hold (the GPUDirect rings count their own): memory().
  MemoryUse held;

  // host-staged
  static constexpr size_t kStagingSlots = 4;
  uint8_t* staging = nullptr;  // kStagingSlots slots of pinned host memory
  // A piece's bytes (all ranks' rows of it: reduce_scatter, all_gather): GRADSYNC_STAGE_PIECE,
  // or 0: a quarter of the call, from kMinPiece to kMaxPiece (piece_for).
  size_t piece_bytes = 0;
  size_t slot_bytes = 4u << 20;  // one staging slot: >= piece_bytes and >= one element per rank
  size_t max_pitch = 0;          // cudaDevAttrMaxPitch: the largest pitch of a 2D copy
  uint64_t staged_seq = 0;
  uint64_t pieces_queued = 0;  // pieces of every staged call so far (the stream's count)
  std::mutex mu;             // staged_error and timing: the worker writes, the caller reads
  Status staged_error;
  StagedTiming timing;
  bool log_timing = false;

#if GRADSYNC_HAVE_GDR
  // GPUDirect RDMA (gpu/gdr_channels.h): calls of at least gdr_min_bytes per segment; smaller
  // ones stay host-staged.
  std::unique_ptr<GdrChannels> gdr;
  size_t gdr_min_bytes = 0;
  // One node, GRADSYNC_GPU_NODE_STEPS=1 on every rank: `gdr` has the direct pairs, and calls
  // that force oneshot or twoshot run them as steps instead of the node kernels.
  bool node_pair_steps = false;
#endif

  // GRADSYNC_GPU_TIMELINE (gpu/timeline.h), cuda-ipc only.
  bool timeline_asked = false;
  uint64_t* timeline = nullptr;  // layout.blocks records (kernels/cuda_node.cuh), device memory
  cudaEvent_t timeline_event = nullptr;    // recorded after the last recorded launch
  cudaStream_t timeline_stream = nullptr;  // the copies back
  struct LastCall {
    bool recorded = false;
    std::string why_not = "no GPU collective was called yet";
    CollectiveKind kind = CollectiveKind::kAllreduce;
    uint64_t bytes = 0;  // of one segment
  } last;
};

#define GS_CUDA(expr, what)                                                                  \
  do {                                                                                       \
    if (cudaError_t e_ = (expr); e_ != cudaSuccess) {                                        \
      return Status(Code::kInternal, who() + ": " + (what) + ": " + cudaGetErrorName(e_) +  \
                                         " (" + cudaGetErrorString(e_) + ")");              \
    }                                                                                        \
  } while (0)

}  // namespace gradsync
