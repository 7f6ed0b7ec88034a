// The steps of the planner's schedule as kernels (runtime/gpu/step_runner.h): one launch runs
// a run of steps of a call, each step's waits, copies and reductions, and signals, so a ring
// call of 2 (n-1) steps per channel is one kernel, not a chain of them. The stream collects
// the steps (StepTable) and launches once per table; a call of more steps than a table holds
// takes several launches in order.
//
// Every block runs every step: its warp 0 waits for the step's words, a lane per word (thread
// 0 alone where there is one; each wait bounded by the op timeout and the abort word, as
// launch_wait_host's), then the block runs the step's
// operations over its own range of the step's elements, in order, with a block barrier between
// them: an operation that reads what the one before wrote (a fold into a slot, then that slot
// copied on) reads only what its own block wrote. A fold of several operands is one run of
// chained operations (StepOp), run as one pass: no barrier and no partial result stored
// between its operands, and its destination may be one of them (in place). The last block to
// finish a step (a counter per step in device memory) stores the step's signals; after every
// block's system-scope fence where the step is marked `release` (a message in plain memory:
// a peer that sees the signal then sees the whole message), as they are otherwise (low-latency lines are read by their flags, and reads are done before). Blocks go on to the next step without waiting for each
// other, except before a step marked `barrier`: there every block first waits until every
// block has finished the steps before it. The stream marks a step so when it touches memory
// that an earlier step of the table touched through another partition (a range written by one
// and read or written by the other that is not the same range of the same length): a block
// would otherwise read a range another block had not yet written, or overwrite one it had not
// yet read. Slots between messages need no barrier: a slot is written again only after the
// peer's signal that it has read it, which came after every block of this rank had finished.
//
// A step's operations (runs) with a low-latency operand run line by line (8 bytes of elements
// at a time, a thread per line; a run's operands folded line by line): a source line is read
// once its flags match, so a receiver works
// on a message as it lands and no `arrived` word is waited for; a destination line is stored
// with its flag and payload together.
//
// Blocks: one per 64 KiB of the table's largest step (4 KiB of low-latency payload: a line a thread), at most kStepMaxBlocks (a small call is
// one block, one spinning thread), and at most the table's max_blocks. Every block of a launch
// must be resident at once (the barriers wait for each other), as must every rank's kernel on
// one GPU: the communicator caps the blocks at the multiprocessors over the ranks sharing it.
//
// Message counts relative to bases (a table with `bases`): a wait's or signal's value, and a
// low-latency operand's flag, may name one of kStepMaxBases words in device memory that the
// stream keeps (per peer and direction), and is then that word plus the value, read when the
// launch starts. The last block to end adds the table's `advance` to the words. So a table
// whose counts are relative is the same table on every replay of a CUDA graph that holds it:
// the counts move on in device memory, not in the launch's parameters (gpu/kernel_stream.h).
//
// Slots of relative counts: an operand that is one of the link's slots (bulk or low-latency)
// names its base and its index among the slots as if the base were a multiple of them; the
// kernel moves it on by the base modulo the slots (step_slot), when the launch starts. So a
// call's n-th message to a peer takes slot (base + n) mod slots, the slot of the same message
// in absolute counts, and calls need not end on a multiple of the slots: the next call's first
// message takes the slot after the last one's, and waits only for the message the slots back.
//
// Numeric results are the loops of cuda_reduce_body.cuh, the same bytes as launch_reduce and
// launch_reduce_final for the same operands in the same order (a fold: as a chain of them,
// left to right, the last one final).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "gradsync/gradsync.h"
#include "kernels/cuda_node.cuh"
#include "kernels/step_slot.h"

namespace gradsync::kernels {

constexpr int kTableMaxSteps = 64;
constexpr int kTableMaxWaits = 128;
constexpr int kTableMaxOps = 128;
constexpr int kTableMaxSignals = 128;
constexpr unsigned kStepMaxBlocks = 64;
// The most blocks a communicator lets a launch take unless GRADSYNC_GPU_STEP_BLOCKS says more.
constexpr unsigned kStepDefaultBlocks = 32;
// Bulk payload per block unless GRADSYNC_GPU_STEP_BLOCK_BYTES says otherwise.
constexpr uint32_t kStepDefaultBlockBytes = uint32_t(64) << 10;
// Bases of relative counts (two per peer: its sends and its receives).
constexpr int kStepMaxBases = 32;
// Device memory words a communicator keeps for the launches: a counter per step and one of the
// blocks that ended (zero between launches), then one that a failed launch sets for good.
constexpr size_t kStepBlocksEnded = size_t(kTableMaxSteps);
constexpr size_t kStepFailed = kStepBlocksEnded + 1;
constexpr size_t kStepCounterWords = kStepFailed + 1;

struct StepWait {
  const uint64_t* word = nullptr;  // device view: GPU memory, a peer's by CUDA IPC, or mapped host memory
  // Wait until *word >= value (plus the base's word, with `base` >= 0); none when that is <= 0.
  int64_t value = 0;
  int32_t peer = -1;  // for NodeError
  uint16_t what = 0;
  int16_t base = -1;  // -1: value is absolute
};
enum class StepOpKind : uint8_t { kCopy, kReduce, kReduceFinal };
// The most operands of a fold (a run of chained operations): cuda_reduce_body.cuh's kMaxFold.
constexpr int kStepMaxFold = 8;
// An operand with a flag is a low-latency slot (cuda_node_ll.cuh's lines: 8 bytes of payload
// and the flag twice per 16 bytes): read line by line as each line's flags match (bounded,
// as the waits), written line by line with the flag. `a_peer`/`b_peer`: the world rank that
// writes that source, for NodeError.
//
// A fold of k operands x0 .. x(k-1) (StepStream::fold) is a run of k - 1 operations of one
// step: the first a reduction of (a = x0, b = x1), each following one marked `chain` with the
// next operand in `b` (its flag, base and peer; `a` unused, null). Only the run's last
// operation stores: it holds dst (and dst2) and the run's kind (kReduceFinal: the last step
// divides kAvg); the others have no dst and kind kReduce. The kernel folds a run in one pass
// over the elements (every operand of an element loaded, folded in order, then stored), the
// same bytes as k - 1 pairwise reductions acc = op(acc, x[j]).
struct StepOp {
  StepOpKind kind = StepOpKind::kCopy;
  // Each flag's base (-1: the flag is absolute): the flag is the base's word plus it, as a
  // 32-bit count, 0 taken as 1.
  int8_t dst_base = -1, dst2_base = -1, a_base = -1, b_base = -1;
  // Nonzero: b is the next operand of the reduction of the operations before (a run).
  uint8_t chain = 0;
  // On a run's first operation: how many operations the run has (step_run_end), set by the
  // stream that builds the table and checked by launch_steps, so that the kernel does not
  // find the runs again at every step.
  uint8_t run = 0;
  // A slot operand of a relative table: its index (step_slot, with the base above: the flag's
  // where it has one); kNoSlot otherwise.
  uint16_t dst_slot = kNoSlot, dst2_slot = kNoSlot, a_slot = kNoSlot, b_slot = kNoSlot;
  void* dst = nullptr;   // null only before a run's last operation
  void* dst2 = nullptr;  // a reduction's second destination; may be null
  const void* a = nullptr;  // null in a chained operation
  const void* b = nullptr;  // kReduce, kReduceFinal
  uint32_t dst_flag = 0, dst2_flag = 0, a_flag = 0, b_flag = 0;  // 0: plain memory
  int32_t a_peer = -1, b_peer = -1;
  __host__ __device__ bool low_latency() const { return (dst_flag | dst2_flag | a_flag | b_flag) != 0; }
};
// The end of the run of operations that starts at ops[i], below `end`: the chained ones after
// it (a fold). Low-latency copies of one source that follow each other (a send to every peer:
// one-shot's, a tree's to its children) are one run too: each line of the source is read once
// and stored to every destination.
inline int step_run_end(const StepOp* ops, int i, int end) {
  int e = i + 1;
  while (e < end && ops[e].chain) ++e;
  const StepOp& o = ops[i];
  if (e == i + 1 && o.kind == StepOpKind::kCopy && o.low_latency()) {
    while (e < end && ops[e].kind == StepOpKind::kCopy && !ops[e].chain && ops[e].low_latency() &&
           ops[e].a == o.a && ops[e].a_flag == o.a_flag && ops[e].a_base == o.a_base)
      ++e;
  }
  return e;
}
// A run ops[i, e) goes line by line when any of its operands is a low-latency slot; a step
// whose runs all do is TableStep::lines.
inline bool step_run_low_latency(const StepOp* ops, int i, int e) {
  for (int j = i; j < e; ++j)
    if (ops[j].low_latency()) return true;
  return false;
}
struct StepSignal {
  uint64_t* word = nullptr;
  uint64_t value = 0;  // plus the base's word, with `base` >= 0
  int32_t base = -1;
};
// A step: its parts are [wait, wait + nwaits) of the table's waits, and so on.
struct TableStep {
  size_t count = 0;  // elements of every operation of the step
  uint16_t wait = 0, nwaits = 0, op = 0, nops = 0, signal = 0, nsignals = 0;
  uint8_t barrier = 0;  // nonzero: every block finishes the steps before this one first
  // Nonzero: the signals are stored after a system-scope fence (StepStream::order_signals);
  // otherwise as they are (relaxed), after the loads and stores that came before them.
  uint8_t release = 0;
  // Nonzero: every run of the step has a low-latency operand, so the step runs line by line
  // with no barrier between its runs (set with the runs, StepOp::run).
  uint8_t lines = 0;
  uint8_t unused = 0;
};

// A kernel parameter (by value, read in place: __grid_constant__). The stream collects a
// call's steps into a StepTable (about 15 KiB); a table that fits the small capacities
// (SmallStepTable, under 4 KiB: a ring call of up to 8 ranks on one node) is launched as
// one, since a launch's cost grows with its parameter's bytes.
// What a table holds besides its parts: their counts and the launch's words.
struct StepTableHead {
  int nsteps = 0, nwaits = 0, nops = 0, nsignals = 0;
  // kAvg: the divisor of kReduceFinal (kReduce sums).
  int divisor = 1;
  const uint32_t* abort = nullptr;  // mapped host memory; nonzero ends the waits
  NodeError* error = nullptr;       // mapped host memory
  uint64_t timeout_ns = 0;
  // The most blocks (1 .. kStepMaxBlocks): ranks that share a GPU divide its multiprocessors.
  unsigned max_blocks = kStepMaxBlocks;
  // Bulk bytes of the largest step per block (0: kStepDefaultBlockBytes); host side only.
  uint32_t block_bytes = 0;
  // The link's slots per peer and direction (0: no operand is moved on, StepOp::*_slot), and
  // the bytes from one slot to the next: bulk, and low-latency (an operand with a flag).
  uint32_t slots = 0, slot_stride = 0, ll_stride = 0;
  // Device memory, kStepCounterWords words, zero at first (the last block to end zeroes the
  // steps' and kStepBlocksEnded; kStepFailed stays). Launches that use them must not overlap
  // (one stream).
  uint32_t* counters = nullptr;
  // Device memory, kStepMaxBases words: the bases of relative counts (null: every count is
  // absolute), and what the last block to end adds to each (a call's last table).
  uint64_t* bases = nullptr;
  uint32_t advance[kStepMaxBases] = {};
};
template <int Steps, int Waits, int Ops, int Signals>
struct StepTableOf : StepTableHead {
  static constexpr int kSteps = Steps, kWaits = Waits, kOps = Ops, kSignals = Signals;
  TableStep steps[Steps];
  StepWait waits[Waits];
  StepOp ops[Ops];
  StepSignal signals[Signals];
};
using StepTable = StepTableOf<kTableMaxSteps, kTableMaxWaits, kTableMaxOps, kTableMaxSignals>;
using SmallStepTable = StepTableOf<16, 32, 24, 32>;
static_assert(sizeof(SmallStepTable) < 4096, "a small table is a parameter of under 4 KiB");

// Queues the table's steps on `stream`: type and op apply to every reduction.
// cudaErrorInvalidValue (nothing queued) for a bad type or op, pointers not aligned to the
// element size, parts outside the table, a missing counter, error word or abort word, a
// base outside [-1, kStepMaxBases) or named without `bases`, a slot index without a base or
// not below the table's slots (or without a stride for it), a chained operation that
// continues no reduction of its step, a run of more than kStepMaxFold operands, or a run
// whose operations before its last store (or are kReduceFinal) or whose last does not, or
// runs (StepOp::run, TableStep::lines) other than step_run_end finds.
cudaError_t launch_steps(const StepTable& table, DataType type, ReduceOp op, cudaStream_t stream);

// Loads every instantiation of the step kernel now (load_reduce_kernels says why).
cudaError_t load_step_kernels();

}  // namespace gradsync::kernels
