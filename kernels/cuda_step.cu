// The step kernel (cuda_step.cuh).
#include "kernels/cuda_step.cuh"

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda_node_device.cuh"
#include "kernels/cuda_node_ll.cuh"
#include "kernels/cuda_reduce_body.cuh"
#include "kernels/kernel_stamps.cuh"

namespace gradsync::kernels {
namespace {

using namespace ops;   // NOLINT: the traits and ops are this file's vocabulary
using namespace body;  // NOLINT: and the loops
using node::fail;
using node::host_word;
using node::load_acquire;
using node::now_ns;
using node::fence_acq_rel_gpu;
using node::fence_acq_rel_sys;

constexpr int kThreads = 512;
// A line of low-latency payload (8 bytes) per thread, as the node kernels spread theirs: at
// 1x8 on an H100 a 64 KiB one-shot launch took 10.3 us on 16 blocks against 21.5 on 4 (16 KiB
// a block), and the ring and two-shot LL calls of 1 MiB a third less (docs/benchmarks.md).
constexpr size_t kLowLatencyBytesPerBlock = size_t(kThreads) * 8;
// NodeError::what of a low-latency read (device_comm.cc: the wait for a peer's message).
constexpr uint32_t kWhatArrival = 3;

// Launch stamps (kernel_stamps.cuh): off while records is null.
__device__ KernelStampLog g_stamps;

__device__ inline unsigned mis16(const void* p) { return unsigned(reinterpret_cast<uintptr_t>(p) & 15u); }

// The table's error and abort words and deadline, as the node kernels' waits take them.
template <class Table>
__device__ inline NodeArgs wait_args(const Table& s) {
  NodeArgs a;
  a.error = s.error;
  a.abort = s.abort;
  a.timeout_ns = s.timeout_ns;
  return a;
}

// Thread 0 of a block: every wait of step `st`. False when one failed or another block's
// wait had (its error recorded). The words are polled in GPU memory (or the mapped words'
// device view); the error and abort words, in host memory, only every 128 polls, as the node
// kernels' waits do: a read of host memory per poll from every block of every rank on a GPU
// queued enough reads on its PCIe link to slow every wait.
// A relative count made absolute: the base's word (loaded into shared memory at the launch's
// start) plus it.
__device__ inline int64_t absolute(const uint64_t* base, int b, int64_t v) { return b >= 0 ? int64_t(base[b]) + v : v; }
__device__ inline uint32_t flag_of(const uint64_t* base, int b, uint32_t f) {
  if (f == 0 || b < 0) return f;
  const uint32_t x = uint32_t(base[b] + f);
  return x == 0 ? 1u : x;
}

// Warp 0 of a block: every wait of a step of several, a lane per wait (32 at a time), polled
// together, so a step that waits for several peers (one-shot and two-shot: every other rank
// of the node) pays one round trip to memory for all of them, not one each in turn. The
// lanes leave together: when every word has its value, or when lane 0, every 128 polls, finds
// an error recorded, the abort word set or the op timeout past; a timeout names the first
// peer still waited for. Every lane returns the same.
// `first`: for the table's first step, the lane's word of the step's first 32 as the launch
// read it.
template <class Table>
__device__ bool wait_all(const Table& s, const TableStep& st, const uint64_t* base, const uint64_t* first) {
  constexpr unsigned kAll = 0xffffffffu;
  const unsigned lane = threadIdx.x & 31u;
  for (int w0 = st.wait; w0 < st.wait + st.nwaits; w0 += 32) {
    const int w = w0 + int(lane);
    const StepWait* x = w < st.wait + st.nwaits ? &s.waits[w] : nullptr;
    const int64_t v = x != nullptr ? absolute(base, x->base, x->value) : 0;
    bool done = v <= 0 || (first != nullptr && w0 == st.wait ? *first : load_acquire(x->word)) >= uint64_t(v);
    if (__all_sync(kAll, done)) continue;
    const uint64_t start = now_ns();
    for (uint32_t n = 1;; ++n) {
      done = done || load_acquire(x->word) >= uint64_t(v);
      const unsigned waiting = __ballot_sync(kAll, !done);
      if (waiting == 0) break;
      if (n > 64) __nanosleep(n > 4096 ? 1000 : 32);
      if ((n & 127) == 0) {
        // 0 go on, 1 another wait failed, 2 aborted, 3 past the timeout.
        int why = 0;
        if (lane == 0) {
          why = host_word(&s.error->code) != 0 ? 1 : host_word(s.abort) != 0 ? 2 : now_ns() - start > s.timeout_ns ? 3 : 0;
        }
        why = __shfl_sync(kAll, why, 0);
        if (why != 0) {
          const StepWait& first = s.waits[w0 + __ffs(waiting) - 1];
          if (lane == 0 && why > 1) fail(s.error, why == 2 ? 2u : 1u, first.peer, first.what);
          return false;
        }
      }
    }
  }
  return true;
}

// Thread 0 of a block: every block has finished step k (its counter), polled as wait_all's
// words are. The abort word and the op timeout end it too, though no barrier should reach
// them first: the block it waits for is itself waiting for a peer, bounded.
template <class Table>
__device__ bool wait_blocks(const Table& s, int k) {
  const volatile uint32_t* c = s.counters + k;
  if (*c >= gridDim.x) return true;
  const uint64_t start = now_ns();
  for (uint32_t n = 1;; ++n) {
    if (*c >= gridDim.x) break;
    if (n > 64) __nanosleep(n > 4096 ? 1000 : 32);
    if ((n & 127) == 0) {
      if (host_word(&s.error->code) != 0) return false;
      if (host_word(s.abort) != 0) return fail(s.error, 2, -1, 5), false;
      if (now_ns() - start > s.timeout_ns) return fail(s.error, 1, -1, 5), false;
    }
  }
  __threadfence();  // the other blocks' stores before their counts
  return true;
}

__device__ void copy_range(uint8_t* dst, const uint8_t* src, size_t bytes) {
  const CopySplit c = copy_split(dst, src, bytes);
  const size_t t = threadIdx.x, n = blockDim.x;
  switch (c.width) {
    case 16: return copy_body<uint4>(t, n, dst, src, c.head, c.nvec, bytes);
    case 8: return copy_body<uint2>(t, n, dst, src, c.head, c.nvec, bytes);
    case 4: return copy_body<uint32_t>(t, n, dst, src, c.head, c.nvec, bytes);
    case 2: return copy_body<uint16_t>(t, n, dst, src, c.head, c.nvec, bytes);
    default: return copy_body<uint8_t>(t, n, dst, src, c.head, c.nvec, bytes);
  }
}

template <class S, class Op>
__device__ void reduce_range(S* out1, S* out2, const S* a, const S* b, size_t n, Op op) {
  const unsigned m = mis16(out1);
  const bool vec = mis16(a) == m && mis16(b) == m && (out2 == nullptr || mis16(out2) == m);
  const Split sp = split(n, sizeof(S), m, vec);
  reduce_body(threadIdx.x, blockDim.x, out1, out2, a, b, sp.head, sp.nvec, n, op);
}

// A fold of 3 or more operands in one pass (fold_body): packs where every pointer has out1's
// offset modulo 16, scalar otherwise.
template <class S, class Op, class Last>
__device__ __forceinline__ void fold_range(S* out1, S* out2, const FoldSrcs<S>& src, size_t n, Op op, Last last) {
  const unsigned m = mis16(out1);
  bool vec = out2 == nullptr || mis16(out2) == m;
#pragma unroll
  for (int j = 0; j < kMaxFold; ++j) {
    if (j < src.k) vec = vec && mis16(src.p[j]) == m;
  }
  const Split sp = split(n, sizeof(S), m, vec);
  fold_body(threadIdx.x, blockDim.x, out1, out2, src, sp.head, sp.nvec, n, op, last);
}

// Unit u (8 bytes of elements) of an operand of `bytes` bytes: a low-latency slot's line u
// once its flags match, or plain memory. False (error recorded) when the read failed.
template <class S>
__device__ bool load_io(const NodeArgs& a, const void* p, uint32_t flag, int peer, size_t u, size_t bytes,
                        node::Unit<S>* x) {
  if (flag != 0) return node::read_line(a, static_cast<const uint8_t*>(p) + u * 16, flag, peer, &x->v, kWhatArrival);
  *x = node::load_unit(static_cast<const S*>(p), u, bytes, (reinterpret_cast<uintptr_t>(p) & 7) == 0);
  return true;
}
template <class S>
__device__ void store_io(void* p, uint32_t flag, size_t u, size_t bytes, const node::Unit<S>& x) {
  if (flag != 0) return node::store_line(static_cast<uint8_t*>(p) + u * 16, x.v.x, x.v.y, flag);
  node::store_unit(static_cast<S*>(p), u, bytes, (reinterpret_cast<uintptr_t>(p) & 7) == 0, x);
}

// One operation, or one run of them (a fold: ops[0, nops); or copies of one source, step_run_end),
// with a low-latency operand over this block's elements [lo, lo + n) of the step's `count`:
// the lines of those elements (lo * sizeof(S) is a multiple of 16), a thread each; a run's
// operands are folded line by line, each line read once its flags match, and the line stored
// once (a run of copies: to each destination). A final line's elements beyond the count are
// zero from plain memory, or whatever the writer's were: they are reduced but never stored to
// plain memory. False when a read failed.
template <class S, class Op, class OpF>
__device__ bool low_latency_op(const NodeArgs& a, const StepOp* ops, int nops, const uint64_t* base, size_t lo,
                               size_t n, size_t count, Op op, OpF op_final) {
  using U = node::Unit<S>;
  const StepOp& o = ops[0];
  const StepOp& last = ops[nops - 1];  // the run's destinations and kind
  const size_t bytes = count * sizeof(S);
  const uint32_t fa = flag_of(base, o.a_base, o.a_flag), fd = flag_of(base, last.dst_base, last.dst_flag),
                 fd2 = flag_of(base, last.dst2_base, last.dst2_flag);
  const bool final = last.kind == StepOpKind::kReduceFinal, copies = o.kind == StepOpKind::kCopy;
  const size_t u1 = ((lo + n) * sizeof(S) + 7) / 8;
  for (size_t u = lo * sizeof(S) / 8 + threadIdx.x; u < u1; u += blockDim.x) {
    U x;
    if (!load_io<S>(a, o.a, fa, o.a_peer, u, bytes, &x)) return false;
    if (!copies) {
      for (int j = 0; j < nops; ++j) {
        const StepOp& q = ops[j];
        U y;
        if (!load_io<S>(a, q.b, flag_of(base, q.b_base, q.b_flag), q.b_peer, u, bytes, &y)) return false;
        if (final && j == nops - 1) {
#pragma unroll
          for (int e = 0; e < U::kN; ++e) x.e[e] = op_final(x.e[e], y.e[e]);
        } else {
#pragma unroll
          for (int e = 0; e < U::kN; ++e) x.e[e] = op(x.e[e], y.e[e]);
        }
      }
    }
    // A run of copies stores to each operation's destinations (the others of the run first).
    for (int j = 0; copies && j + 1 < nops; ++j) {
      const StepOp& q = ops[j];
      store_io<S>(q.dst, flag_of(base, q.dst_base, q.dst_flag), u, bytes, x);
      if (q.dst2 != nullptr) store_io<S>(q.dst2, flag_of(base, q.dst2_base, q.dst2_flag), u, bytes, x);
    }
    store_io<S>(last.dst, fd, u, bytes, x);
    if (last.dst2 != nullptr) store_io<S>(last.dst2, fd2, u, bytes, x);
  }
  return true;
}

// Op: the reductions before the last; OpF: the last (kAvg divides there). One block per
// multiprocessor is all a launch needs (its blocks are capped at the multiprocessors, over the
// ranks sharing them): without the 1, ptxas held some instantiations to 64 registers, for two
// blocks each, and spilled (float16 sum: 36 bytes stored, 196 loaded, with the one-pass folds).
// The table is read from shared memory: the block copies the parameter there first, every
// thread a few 8-byte words at once. Read in place, each field's first read was a miss of the
// constant cache, one after another as the steps went on (a small call's table is some 40
// such lines).
template <class Table>
__device__ inline const Table& table_in_shared(const Table& param, unsigned char* raw) {
  static_assert(sizeof(Table) % 8 == 0 && alignof(Table) <= 8, "a table copies as 8-byte words");
  const uint2* src = reinterpret_cast<const uint2*>(&param);
  uint2* dst = reinterpret_cast<uint2*>(raw);
  for (unsigned i = threadIdx.x; i < unsigned(sizeof(Table) / 8); i += blockDim.x) dst[i] = src[i];
  return *reinterpret_cast<const Table*>(raw);
}

template <class Table, class Tr, class Op, class OpF>
__global__ void __launch_bounds__(kThreads, 1) step_kernel(const __grid_constant__ Table param, Op op, OpF op_final) {
  using S = typename Tr::S;
  __shared__ __align__(8) unsigned char raw[sizeof(Table)];
  const Table& s = table_in_shared(param, raw);
  __shared__ int go;
  // The bases of the table's relative counts, as they were when the launch started.
  __shared__ uint64_t base[kStepMaxBases];
  // Thread 0: false once a wait of this block failed, or when an earlier launch's had when
  // this one started (the rest of the stream's queue then drains at once). That is read from
  // the device word a failed launch sets, not the error in host memory: a read of mapped host
  // memory took 0.9 us on the H200, and 8 us with 8 blocks reading at once, at every launch.
  // An error recorded by anything else is seen at the waits' next look at the host words.
  // Read beside the bases and the table's copy, before the barrier (one round trip for all;
  // from the parameter, as the copy is not done yet).
  // Warp 0 reads the words of the first step's waits there too (the first 32, a lane each):
  // their first poll then costs no round trip of its own.
  volatile uint32_t* failed_before = param.counters + kStepFailed;
  bool alive = true;
  uint64_t first = 0;
  KernelStamp* stamp = nullptr;
  if (threadIdx.x == 0) {
    alive = *failed_before == 0;
    stamp = stamp_begin(g_stamps, reinterpret_cast<uintptr_t>(param.counters), kStampStepKernel);
  }
  if (threadIdx.x < 32 && param.nsteps > 0 && int(threadIdx.x) < param.steps[0].nwaits) {
    first = load_acquire(param.waits[param.steps[0].wait + threadIdx.x].word);
  }
  if (threadIdx.x < unsigned(kStepMaxBases)) base[threadIdx.x] = param.bases != nullptr ? param.bases[threadIdx.x] : 0;
  __syncthreads();
  if (param.slots != 0) {
    // The slot operands moved on by their bases (step_slot), in the table's copy.
    Table& w = *reinterpret_cast<Table*>(raw);
    for (int i = int(threadIdx.x); i < param.nops; i += int(blockDim.x)) {
      StepOp& o = w.ops[i];
      auto at = [&](const void* p, uint16_t slot, int b, uint32_t flag) {
        return slot == kNoSlot ? const_cast<void*>(p)
                               : step_slot(const_cast<void*>(p), slot, base[b], param.slots,
                                           flag != 0 ? param.ll_stride : param.slot_stride);
      };
      o.dst = at(o.dst, o.dst_slot, o.dst_base, o.dst_flag);
      o.dst2 = at(o.dst2, o.dst2_slot, o.dst2_base, o.dst2_flag);
      o.a = at(o.a, o.a_slot, o.a_base, o.a_flag);
      o.b = at(o.b, o.b_slot, o.b_base, o.b_flag);
    }
    __syncthreads();
  }
  stamp_mark(stamp, 1);
  for (int k = 0; k < s.nsteps; ++k) {
    const TableStep& st = s.steps[k];
    const int mark = k < kStampSteps ? 2 + 3 * k : kStampMarks;  // past the record: none
    if (st.nwaits > 1) {
      // Thread 0's barrier first, then warp 0's waits (every lane learns thread 0's state).
      if (threadIdx.x < 32) {
        bool ok = threadIdx.x != 0 || (alive && (st.barrier == 0 || k == 0 || gridDim.x == 1 || wait_blocks(s, k - 1)));
        ok = __all_sync(0xffffffffu, ok) && wait_all(s, st, base, k == 0 ? &first : nullptr);
        if (threadIdx.x == 0) alive = ok;
      }
    } else if (threadIdx.x == 0) {
      // One wait or none (a ring's step): thread 0 alone, as a lane per word gains nothing.
      alive = alive && (st.barrier == 0 || k == 0 || gridDim.x == 1 || wait_blocks(s, k - 1));
      if (alive && st.nwaits == 1) {
        const StepWait& x = s.waits[st.wait];
        const int64_t v = absolute(base, x.base, x.value);
        alive = v <= 0 || (k == 0 && first >= uint64_t(v)) ||
                node::wait_at_least(x.word, uint64_t(v), wait_args(s), x.peer, x.what);
      }
    }
    if (threadIdx.x == 0) go = alive ? 1 : 0;
    __syncthreads();
    stamp_mark(stamp, mark);
    // This block's elements: a multiple of 16 of them from the start, so every pointer keeps
    // its offset modulo 16 and the block's loops vectorise as a whole-step kernel's would.
    const size_t per = ((st.count + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
    const size_t lo = size_t(blockIdx.x) * per;
    const size_t n = lo < st.count ? (st.count - lo < per ? st.count - lo : per) : 0;
    bool failed = false;  // a low-latency read of this block failed (the same in every thread)
    if (go && n > 0) {
      const NodeArgs args = wait_args(s);
      // The step's operations run by run (a run: an operation and the chained ones after it,
      // one fold; a lone operation otherwise). A run with a low-latency operand goes line by
      // line. Every run line by line: each thread then reads only lines it wrote itself in the
      // step's earlier runs (the same lines of the same elements), so they need no barrier
      // between them; plain runs split their ranges by alignment and do.
      const int end = st.op + st.nops;
      const bool lines = st.lines != 0;
      auto run_ll = [&](int i, int e) {
        bool ll = lines;
        for (int j = i; j < e && !ll; ++j) ll = s.ops[j].low_latency();
        return ll;
      };
      bool mine = false;  // a read of this thread failed
      for (int i = st.op, e; i < end && !mine; i = e) {
        e = i + s.ops[i].run;
        const StepOp& o = s.ops[i];
        const StepOp& last = s.ops[e - 1];  // the run's destinations and kind
        if (run_ll(i, e)) {
          mine = !low_latency_op<S>(args, &s.ops[i], e - i, base, lo, n, st.count, op, op_final);
        } else if (o.kind == StepOpKind::kCopy) {
          copy_range(static_cast<uint8_t*>(o.dst) + lo * sizeof(S), static_cast<const uint8_t*>(o.a) + lo * sizeof(S),
                     n * sizeof(S));
        } else if (e - i == 1) {
          S* d2 = o.dst2 ? static_cast<S*>(o.dst2) + lo : nullptr;
          S* d = static_cast<S*>(o.dst) + lo;
          const S* a = static_cast<const S*>(o.a) + lo;
          const S* b = static_cast<const S*>(o.b) + lo;
          if (o.kind == StepOpKind::kReduce) {
            reduce_range<S>(d, d2, a, b, n, op);
          } else {
            reduce_range<S>(d, d2, a, b, n, op_final);
          }
        } else {
          // A fold of e - i + 1 operands in one pass.
          FoldSrcs<S> src;
          src.k = e - i + 1;
          src.p[0] = static_cast<const S*>(o.a) + lo;
#pragma unroll
          for (int j = 0; j + 1 < kMaxFold; ++j) {
            src.p[j + 1] = j < e - i ? static_cast<const S*>(s.ops[i + j].b) + lo : nullptr;
          }
          S* d2 = last.dst2 ? static_cast<S*>(last.dst2) + lo : nullptr;
          S* d = static_cast<S*>(last.dst) + lo;
          if (last.kind == StepOpKind::kReduce) {
            fold_range<S>(d, d2, src, n, op, op);
          } else {
            fold_range<S>(d, d2, src, n, op, op_final);
          }
        }
        // The next run may read what this one wrote; after a failed read none runs.
        if (!lines && __syncthreads_or(mine)) {
          failed = true;
          break;
        }
      }
      if (lines) failed = __syncthreads_or(mine);
    }
    stamp_mark(stamp, mark + 1);
    if (threadIdx.x == 0) alive = alive && !failed;
    // The signals, once every block is done with the step. Signals go out after a failed wait
    // too: the error is recorded and the job fails, and a peer's wait then ends at once
    // instead of spending its own timeout. A step marked `release` stores them after one
    // system-scope fence, so that a peer that sees a signal sees the block's stores (the
    // block barrier before makes every thread's stores thread 0's to release); any other step
    // only read its receive slots (done by now) and wrote what no peer reads by a signal, and
    // stores them as they are. A fence is a round trip of its own: one per signal, as
    // release stores each are, measured a third of a ring step's time on the H200.
    // A launch of one block (every small call) needs no count. Warp 0 stores them, a lane per
    // signal (a one-shot step signals every peer); where the step is `release`, every lane
    // fences first (one instruction for the warp: one round trip, as before).
    __syncthreads();
    if (threadIdx.x < 32) {
      const unsigned lane = threadIdx.x;
      bool last = true;
      if (gridDim.x > 1) {
        // The block's stores before its count: at system scope for the signals, at least at
        // the GPU's for the later steps' blocks that wait for the counts (wait_blocks).
        if (lane == 0) {
          if (st.release) fence_acq_rel_sys();
          else fence_acq_rel_gpu();
          last = atomicAdd(s.counters + k, 1u) == gridDim.x - 1;
        }
        last = __shfl_sync(0xffffffffu, last, 0);
      }
      if (last) {
        // After a count: the other blocks' stores, seen by their counts.
        if (st.release) fence_acq_rel_sys();
        for (int i = st.signal + int(lane); i < st.signal + st.nsignals; i += 32) {
          const StepSignal& g = s.signals[i];
          node::store_relaxed(g.word, g.base >= 0 ? base[g.base] + g.value : g.value);
        }
      }
    }
    stamp_mark(stamp, mark + 2);
  }
  if (threadIdx.x == 0 && !alive) *failed_before = 1;
  // The last block to end zeroes the counters for the stream's next launch (launches on one
  // stream do not overlap) and moves the bases on; every other block has stopped reading them
  // by then (each read the bases at its start).
  // A launch of one block is its own last (its steps counted nothing).
  // Warp 0, a lane per word.
  if (threadIdx.x < 32) {
    const unsigned lane = threadIdx.x;
    bool last = gridDim.x == 1;
    if (!last && lane == 0) last = atomicAdd(s.counters + kStepBlocksEnded, 1u) == gridDim.x - 1;
    if (__shfl_sync(0xffffffffu, last, 0)) {
      for (int k = int(lane); k < s.nsteps; k += 32) s.counters[k] = 0;
      if (lane == 0) s.counters[kStepBlocksEnded] = 0;
      static_assert(kStepMaxBases == 32, "a lane per base");
      if (s.bases != nullptr && s.advance[lane] != 0) s.bases[lane] = base[lane] + s.advance[lane];
    }
  }
  stamp_end(stamp, 2 + 3 * (s.nsteps < kStampSteps ? s.nsteps : kStampSteps), uint32_t(s.nsteps));
}

// Copies a table into a smaller one (the parts' indices stay valid: they are within its counts).
template <class To, class From>
void shrink(const From& f, To* t) {
  std::copy(f.steps, f.steps + f.nsteps, t->steps);
  std::copy(f.waits, f.waits + f.nwaits, t->waits);
  std::copy(f.ops, f.ops + f.nops, t->ops);
  std::copy(f.signals, f.signals + f.nsignals, t->signals);
  static_cast<StepTableHead&>(*t) = f;
}
template <class Table>
bool fits(const StepTable& s) {
  return s.nsteps <= Table::kSteps && s.nwaits <= Table::kWaits && s.nops <= Table::kOps &&
         s.nsignals <= Table::kSignals;
}

template <class Tr, class Op, class OpF>
cudaError_t launch_as(const StepTable& s, Op op, OpF op_final, cudaStream_t stream) {
  size_t count = 0;
  for (int k = 0; k < s.nsteps; ++k) count = std::max(count, s.steps[k].count);
  bool ll = false;
  for (int i = 0; i < s.nops; ++i) ll = ll || s.ops[i].low_latency();
  const size_t bytes = count * sizeof(typename Tr::S), per = ll                ? kLowLatencyBytesPerBlock
                                                         : s.block_bytes > 0 ? size_t(s.block_bytes)
                                                                             : size_t(kStepDefaultBlockBytes);
  const unsigned blocks = unsigned(std::clamp<size_t>((bytes + per - 1) / per, 1, s.max_blocks));
  if (fits<SmallStepTable>(s)) {
    SmallStepTable small;
    shrink(s, &small);
    step_kernel<SmallStepTable, Tr, Op, OpF><<<blocks, kThreads, 0, stream>>>(small, op, op_final);
  } else {
    step_kernel<StepTable, Tr, Op, OpF><<<blocks, kThreads, 0, stream>>>(s, op, op_final);
  }
  return cudaGetLastError();
}

// Calls f.template operator()<Tr, Op, OpF>(op, op_final) for (type, op); `divisor` for kAvg.
template <class Tr, class F>
cudaError_t with_ops(ReduceOp op, int divisor, F&& f) {
  switch (op) {
    case ReduceOp::kSum: return f.template operator()<Tr>(OpSum<Tr>{}, OpSum<Tr>{});
    case ReduceOp::kProd: return f.template operator()<Tr>(OpProd<Tr>{}, OpProd<Tr>{});
    case ReduceOp::kMin: return f.template operator()<Tr>(OpMinMax<Tr, false>{}, OpMinMax<Tr, false>{});
    case ReduceOp::kMax: return f.template operator()<Tr>(OpMinMax<Tr, true>{}, OpMinMax<Tr, true>{});
    case ReduceOp::kAvg: return f.template operator()<Tr>(OpSum<Tr>{}, OpSumDivide<Tr>{divisor});
  }
  return cudaErrorInvalidValue;
}

bool aligned(const void* p, size_t a) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % a == 0; }

static_assert(kStepMaxFold == kMaxFold, "a run folds at most what fold_body does");

// A step's operations as runs (cuda_step.cuh, StepOp): a chained operation continues a
// reduction of the step, a run folds at most kStepMaxFold operands, only its last operation
// stores (and is kReduceFinal, if any is), and every operand the kernel reads is there.
bool valid_runs(const StepTable& s, const TableStep& st) {
  int sources = 0;  // of the run so far; 0: none open (no step yet, or after a copy)
  const int end = st.op + st.nops;
  for (int i = st.op; i < end; ++i) {
    const StepOp& o = s.ops[i];
    const bool binary = o.kind != StepOpKind::kCopy;
    if (o.chain != 0) {
      if (sources == 0 || !binary || ++sources > kStepMaxFold) return false;
    } else {
      if (o.a == nullptr) return false;
      sources = binary ? 2 : 0;
    }
    if (binary && o.b == nullptr) return false;
    const bool ends = i + 1 == end || s.ops[i + 1].chain == 0;
    if (ends ? o.dst == nullptr : (o.dst != nullptr || o.dst2 != nullptr || o.kind != StepOpKind::kReduce))
      return false;
  }
  return true;
}

// The runs and `lines` the table holds are those step_run_end finds.
bool runs_as_found(const StepTable& s, const TableStep& st) {
  const int end = st.op + st.nops;
  bool lines = st.nops > 0;
  for (int i = st.op, e; i < end; i = e) {
    e = step_run_end(s.ops, i, end);
    if (s.ops[i].run != e - i) return false;
    lines = lines && step_run_low_latency(s.ops, i, e);
  }
  return (st.lines != 0) == lines;
}

}  // namespace

cudaError_t launch_steps(const StepTable& s, DataType type, ReduceOp op, cudaStream_t stream) {
  const size_t es = esize(type);
  if (es == 0 || unsigned(op) >= unsigned(kNumReduceOps) || s.divisor < 1) return cudaErrorInvalidValue;
  if (s.nsteps < 0 || s.nsteps > kTableMaxSteps || s.nwaits < 0 || s.nwaits > kTableMaxWaits || s.nops < 0 ||
      s.nops > kTableMaxOps || s.nsignals < 0 || s.nsignals > kTableMaxSignals)
    return cudaErrorInvalidValue;
  if (s.counters == nullptr || s.error == nullptr || s.abort == nullptr) return cudaErrorInvalidValue;
  if (s.max_blocks < 1 || s.max_blocks > kStepMaxBlocks) return cudaErrorInvalidValue;
  for (int k = 0; k < s.nsteps; ++k) {
    const TableStep& st = s.steps[k];
    if (st.wait + st.nwaits > s.nwaits || st.op + st.nops > s.nops || st.signal + st.nsignals > s.nsignals)
      return cudaErrorInvalidValue;
    if (!valid_runs(s, st) || !runs_as_found(s, st)) return cudaErrorInvalidValue;
  }
  // A base is -1 (absolute) or one of the table's words.
  auto bad_base = [&](int b) { return b < -1 || b >= kStepMaxBases || (b >= 0 && s.bases == nullptr); };
  for (int i = 0; i < s.nwaits; ++i)
    if (s.waits[i].word == nullptr || bad_base(s.waits[i].base)) return cudaErrorInvalidValue;
  for (int i = 0; i < s.nsignals; ++i)
    if (s.signals[i].word == nullptr || bad_base(s.signals[i].base)) return cudaErrorInvalidValue;
  if (s.bases == nullptr)
    for (uint32_t a : s.advance)
      if (a != 0) return cudaErrorInvalidValue;
  for (int i = 0; i < s.nops; ++i) {
    const StepOp& o = s.ops[i];
    // (Null operands and destinations: valid_runs, per step.)
    if (bad_base(o.dst_base) || bad_base(o.dst2_base) || bad_base(o.a_base) || bad_base(o.b_base))
      return cudaErrorInvalidValue;
    // A slot index names a base and a slot of the table's, with its stride.
    auto bad_slot = [&](uint16_t slot, int b, uint32_t flag) {
      return slot != kNoSlot && (b < 0 || slot >= s.slots || (flag != 0 ? s.ll_stride : s.slot_stride) == 0);
    };
    if (bad_slot(o.dst_slot, o.dst_base, o.dst_flag) || bad_slot(o.dst2_slot, o.dst2_base, o.dst2_flag) ||
        bad_slot(o.a_slot, o.a_base, o.a_flag) || bad_slot(o.b_slot, o.b_base, o.b_flag))
      return cudaErrorInvalidValue;
    if (!aligned(o.dst, es) || !aligned(o.dst2, es) || !aligned(o.a, es) || !aligned(o.b, es))
      return cudaErrorInvalidValue;
    // Low-latency slots are lines of 16 bytes.
    if ((o.dst_flag && !aligned(o.dst, 16)) || (o.dst2_flag && !aligned(o.dst2, 16)) || (o.a_flag && !aligned(o.a, 16)) ||
        (o.b_flag && !aligned(o.b, 16)))
      return cudaErrorInvalidValue;
  }
  if (s.nsteps == 0) return cudaSuccess;
  return with_traits(type, [&]<class Tr>() {
    return with_ops<Tr>(op, s.divisor, [&]<class T, class Op, class OpF>(Op o, OpF f) {
      return launch_as<T>(s, o, f, stream);
    });
  });
}

cudaError_t set_kernel_stamps(const KernelStampLog& log) {
  const cudaError_t e = cudaMemcpyToSymbol(g_stamps, &log, sizeof(log));
  return e != cudaSuccess ? e : node::set_ll_stamps(log);
}

cudaError_t load_step_kernels() {
  cudaError_t e = cudaSuccess;
  for (int t = 0; t < kNumDataTypes && e == cudaSuccess; ++t) {
    for (int o = 0; o < kNumReduceOps && e == cudaSuccess; ++o) {
      e = with_traits(DataType(t), [&]<class Tr>() {
        return with_ops<Tr>(ReduceOp(o), 2, [&]<class T, class Op, class OpF>(Op, OpF) {
          cudaFuncAttributes attr{};
          const cudaError_t big = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(step_kernel<StepTable, T, Op, OpF>));
          if (big != cudaSuccess) return big;
          return cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(step_kernel<SmallStepTable, T, Op, OpF>));
        });
      });
    }
  }
  return e;
}

}  // namespace gradsync::kernels
