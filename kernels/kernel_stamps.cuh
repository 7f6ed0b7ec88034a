// Launch stamps: where a small call's time goes inside the step kernel (cuda_step.cuh) and the
// one-node low-latency allreduce kernel (cuda_node_ll.cuh), for benches (node_gpu_test's
// OneNodeBench with NODE_BENCH_STAMPS=1). Off unless a log is set; then thread 0 of block 0 of
// every launch of those kernels takes a record: %globaltimer at entry and exit, and clock64()
// at marks in program order:
//   step kernel         entry, prologue done (table in shared memory, bases, first waits'
//                       words read), then per step: waits done (every block's `go`), operations
//                       done (the block's barrier), signals stored (warp 0's lane 0); the last
//                       mark before the record's end (counters and bases)
//   node low-latency    entry, push done (thread 0's own stores issued), consume done (the
//                       block's barrier), the last mark after the counters
// Steps past kStampSteps are not marked (the record says how many were). With no log set, the
// cost is thread 0's load of the log's pointer at entry, beside the prologue's other loads.
// The node kernels' timeline (runtime/gpu/timeline.h) records the chunked protocol per chunk;
// these records are per launch, small calls.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace gradsync::kernels {

constexpr int kStampSteps = 16;
constexpr int kStampMarks = 3 + 3 * kStampSteps;
enum StampKind : uint32_t { kStampStepKernel = 1, kStampNodeLowLatency = 2 };

struct KernelStamp {
  // The launching stream's device words (StepTableHead::counters, NodeArgs::progress): one
  // per communicator and stream, so the records of one rank group by it.
  uint64_t owner = 0;
  uint32_t kind = 0;
  uint32_t nmarks = 0;  // written last: a record with 0 marks is not complete
  uint32_t nsteps = 0;  // the step kernel's steps (marked: at most kStampSteps)
  uint32_t blocks = 0;
  uint64_t entry_ns = 0, exit_ns = 0;
  uint64_t marks[kStampMarks] = {};
};

// Device memory: `capacity` records and the index of the next (launches past the capacity
// record nothing).
struct KernelStampLog {
  KernelStamp* records = nullptr;
  uint32_t* next = nullptr;
  uint32_t capacity = 0;
};

// Sets the log of every later launch of both kernels on this device (null records: off). Not
// while launches are queued that should or should not record.
cudaError_t set_kernel_stamps(const KernelStampLog& log);

namespace node {
// The low-latency allreduce kernel's log (cuda_node_allreduce.cu's copy of it).
cudaError_t set_ll_stamps(const KernelStampLog& log);
}  // namespace node

#ifdef __CUDACC__
// Thread 0 of block 0 of a launch: its record, or null when no log is set or it is full.
__device__ inline KernelStamp* stamp_begin(const KernelStampLog& log, uint64_t owner, uint32_t kind) {
  if (log.records == nullptr || blockIdx.x != 0 || threadIdx.x != 0) return nullptr;
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  const uint32_t i = atomicAdd(log.next, 1u);
  if (i >= log.capacity) return nullptr;
  KernelStamp* r = log.records + i;
  r->marks[0] = uint64_t(clock64());
  r->owner = owner;
  r->kind = kind;
  r->blocks = gridDim.x;
  r->entry_ns = t;
  return r;
}
__device__ inline void stamp_mark(KernelStamp* r, int m) {
  if (r != nullptr && m < kStampMarks) r->marks[m] = uint64_t(clock64());
}
__device__ inline void stamp_end(KernelStamp* r, int nmarks, uint32_t nsteps) {
  if (r == nullptr) return;
  const int m = nmarks < kStampMarks ? nmarks : kStampMarks - 1;
  r->marks[m] = uint64_t(clock64());
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  r->exit_ns = t;
  r->nsteps = nsteps;
  __threadfence();
  r->nmarks = uint32_t(m + 1);
}
#endif

}  // namespace gradsync::kernels
