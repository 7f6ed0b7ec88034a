// One step of the planner's schedule as one kernel (runtime/gpu/step_runner.h): its waits,
// its copies and reductions, and its signals, fused. The step runner asked the stream for
// them one by one; a kernel each (a wait kernel per peer, a copy or reduce kernel per
// operand, a signal kernel per message) made a ring step of 5 launches. Here the stream
// collects a step's parts (StepLaunch) and launches once.
//
// Every block waits for the step's words itself (its thread 0: each wait bounded by the op
// timeout and the abort word, as launch_wait_host's), then runs every operation of the step
// over its own range of the step's elements, in order, with a block barrier between them: an
// operation that reads what the one before wrote (a fold into a slot, then that slot copied
// on) reads only what its own block wrote, so no block waits for another. The last block to
// finish (a counter in device memory) stores the signals, after every block's fence: a peer
// that sees a signal sees the whole message. Blocks: one per 64 KiB of the step, at most
// kStepMaxBlocks: a step of a small call is one block, one spinning thread.
//
// Numeric results are the loops of cuda_reduce_body.cuh, the same bytes as launch_reduce and
// launch_reduce_final for the same operands in the same order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "gradsync/gradsync.h"
#include "kernels/cuda_node.cuh"

namespace gradsync::kernels {

constexpr int kStepMaxWaits = 16;
constexpr int kStepMaxOps = 16;
constexpr int kStepMaxSignals = 16;
constexpr unsigned kStepMaxBlocks = 32;

struct StepWait {
  const uint64_t* word = nullptr;  // device view: GPU memory, a peer's by CUDA IPC, or mapped host memory
  uint64_t value = 0;              // wait until *word >= value
  int32_t peer = -1;               // for NodeError
  uint32_t what = 0;
};
enum class StepOpKind : uint32_t { kCopy, kReduce, kReduceFinal };
struct StepOp {
  StepOpKind kind = StepOpKind::kCopy;
  void* dst = nullptr;
  void* dst2 = nullptr;  // kReduceFinal only; may be null
  const void* a = nullptr;
  const void* b = nullptr;  // kReduce, kReduceFinal
};
struct StepSignal {
  uint64_t* word = nullptr;
  uint64_t value = 0;
};

// A kernel parameter (by value): about 1.3 KiB.
struct StepLaunch {
  StepWait waits[kStepMaxWaits];
  StepOp ops[kStepMaxOps];
  StepSignal signals[kStepMaxSignals];
  int nwaits = 0, nops = 0, nsignals = 0;
  size_t count = 0;  // elements of every operation of the step
  // kAvg: the divisor of kReduceFinal (kReduce sums).
  int divisor = 1;
  const uint32_t* abort = nullptr;  // mapped host memory; nonzero ends the waits
  NodeError* error = nullptr;       // mapped host memory
  uint64_t timeout_ns = 0;
  // Device memory, zero between launches: the blocks that finished. Launches that use one
  // counter must not overlap (one stream).
  uint32_t* finished = nullptr;
};

// Queues the step on `stream`: type and op apply to every reduction. cudaErrorInvalidValue
// (nothing queued) for a bad type or op, pointers not aligned to the element size, counts
// over the limits, or a missing counter, error word or abort word.
cudaError_t launch_step(const StepLaunch& step, DataType type, ReduceOp op, cudaStream_t stream);

// Loads every instantiation of the step kernel now (load_reduce_kernels says why).
cudaError_t load_step_kernels();

}  // namespace gradsync::kernels
