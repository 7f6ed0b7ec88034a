#include "gpu/kernel_stream.h"


namespace gradsync {
namespace {

// The waits' `what` codes (NodeError::what; device_comm.cc words them).
constexpr uint32_t kWaitArrival = 3;
constexpr uint32_t kWaitSendSlot = 4;
// Ranges a table remembers before it gives its next step a barrier and forgets them.
constexpr size_t kMaxTouched = 256;

}  // namespace

KernelStream::KernelStream(const KernelStreamWords& w, cudaStream_t stream, DataType type, ReduceOp op,
                           int divisor, Launch launch)
    : w_(w), stream_(stream), type_(type), op_(op), divisor_(divisor), launch_(std::move(launch)),
      table_(std::make_unique<kernels::StepTable>()) {
  if (!launch_) {
    launch_ = [this](const kernels::StepTable& t) { return kernels::launch_steps(t, type_, op_, stream_); };
  }
}

Status KernelStream::error(const std::string& why) const {
  return {Code::kInternal, w_.who + ": step kernel: " + why};
}

static_assert(2 * kMaxGdrPeers <= kernels::kStepMaxBases, "a base per peer and direction");

Status KernelStream::begin_call(bool relative) {
  if (relative && w_.bases == nullptr) return error("a relative call without bases");
  relative_ = relative;
  // A relative call's slot operands are moved on by the kernel (StepTableHead::slots): the
  // link's slots and strides, the same for every table of the call.
  slots_ = Slots{};
  if (relative && w_.link != nullptr) {
    const GdrLink& l = *w_.link;
    if (l.slots() >= kernels::kNoSlot || l.slot_bytes() > UINT32_MAX || l.ll_slot_bytes() > UINT32_MAX) {
      return error("relative counts need under 65535 slots of under 4 GiB");
    }
    slots_ = Slots{l.slots(), uint32_t(l.slot_bytes()), uint32_t(l.ll_slot_bytes())};
  }
  for (uint64_t& v : last_signal_) v = 0;
  return Status::Ok();
}

Status KernelStream::begin_step() {
  step_ = kernels::TableStep{};
  waits_.clear();
  ops_.clear();
  signals_.clear();
  return Status::Ok();
}

// Two ranges of the call's memory conflict across steps when one writes what the other
// touches and they are not the same range: the same range of the same length is split among
// the blocks the same way in both steps, so each block touches only what it touched before.
bool KernelStream::needs_barrier(const std::vector<Range>& step) const {
  for (const Range& r : step) {
    for (const Range& t : touched_) {
      if (!(r.write || t.write) || r.lo >= t.hi || t.lo >= r.hi) continue;
      if (r.lo == t.lo && r.hi == t.hi) continue;
      return true;
    }
  }
  return false;
}

Status KernelStream::end_step() {
  if (waits_.empty() && ops_.empty() && signals_.empty()) return Status::Ok();
  kernels::StepTable& t = *table_;
  auto fits = [&] {
    return t.nsteps < kernels::kTableMaxSteps && t.nwaits + int(waits_.size()) <= kernels::kTableMaxWaits &&
           t.nops + int(ops_.size()) <= kernels::kTableMaxOps &&
           t.nsignals + int(signals_.size()) <= kernels::kTableMaxSignals;
  };
  if (!fits()) GS_RETURN_IF_ERROR(flush(false));
  if (!fits()) return error("a step larger than a table");
  const size_t es = element_size(type_);
  std::vector<Range> ranges;
  // Every operand of every operation: a fold's run names each source once (the first
  // operation a and b, each chained one b) and its destinations in its last operation.
  for (const kernels::StepOp& o : ops_) {
    const size_t bytes = step_.count * es;
    // A low-latency slot holds the step's elements as lines: 16 bytes per 8.
    auto add = [&](const void* p, uint32_t flag, bool write) {
      const size_t span = flag != 0 ? (bytes + 7) / 8 * 16 : bytes;
      if (p != nullptr) ranges.push_back({static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + span, write});
    };
    add(o.dst, o.dst_flag, true);
    add(o.dst2, o.dst2_flag, true);
    add(o.a, o.a_flag, false);
    if (o.kind != kernels::StepOpKind::kCopy) add(o.b, o.b_flag, false);
  }
  if (t.nsteps > 0 && (touched_.size() + ranges.size() > kMaxTouched || needs_barrier(ranges))) {
    step_.barrier = 1;
    touched_.clear();
  }
  touched_.insert(touched_.end(), ranges.begin(), ranges.end());
  // The step's runs (the kernel's units of work, kernels::step_run_end), found once here.
  bool lines = !ops_.empty();
  for (int i = 0, e, n = int(ops_.size()); i < n; i = e) {
    e = kernels::step_run_end(ops_.data(), i, n);
    ops_[size_t(i)].run = uint8_t(e - i);
    lines = lines && kernels::step_run_low_latency(ops_.data(), i, e);
  }
  step_.lines = lines ? 1 : 0;
  step_.wait = uint16_t(t.nwaits);
  step_.nwaits = uint16_t(waits_.size());
  step_.op = uint16_t(t.nops);
  step_.nops = uint16_t(ops_.size());
  step_.signal = uint16_t(t.nsignals);
  step_.nsignals = uint16_t(signals_.size());
  for (const auto& x : waits_) t.waits[t.nwaits++] = x;
  for (const auto& x : ops_) t.ops[t.nops++] = x;
  for (const auto& x : signals_) t.signals[t.nsignals++] = x;
  t.steps[t.nsteps++] = step_;
  return Status::Ok();
}

Status KernelStream::end_call() { return flush(true); }

// `last`: the call's last table, which moves the bases on.
Status KernelStream::flush(bool last) {
  kernels::StepTable& t = *table_;
  if (t.nsteps == 0) return Status::Ok();
  t.bases = relative_ ? w_.bases : nullptr;
  for (int b = 0; b < kernels::kStepMaxBases; ++b) {
    if (last_signal_[b] > UINT32_MAX) return error("a call of over 2^32 messages to one peer");
    t.advance[b] = relative_ && last ? uint32_t(last_signal_[b]) : 0;
  }
  t.divisor = divisor_;
  t.abort = w_.abort;
  t.error = w_.error;
  t.timeout_ns = w_.timeout_ns;
  t.counters = w_.counters;
  t.max_blocks = w_.max_blocks;
  t.block_bytes = w_.block_bytes;
  t.slots = slots_.slots;
  t.slot_stride = slots_.stride;
  t.ll_stride = slots_.ll_stride;
  const cudaError_t e = launch_(t);
  t.nsteps = t.nwaits = t.nops = t.nsignals = 0;
  touched_.clear();
  if (e != cudaSuccess) {
    return error(std::string("launch: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
  ++launches_;
  return Status::Ok();
}

const uint64_t* KernelStream::dev(const uint64_t* w) const {
  auto* at = reinterpret_cast<const uint8_t*>(w);
  if (at >= w_.host && at < w_.host + w_.bytes) return reinterpret_cast<const uint64_t*>(w_.device + (at - w_.host));
  return w;
}

Status KernelStream::wait_arrived(int p, int64_t v) {
  if (waits_.size() == size_t(kernels::kTableMaxWaits)) return error("too many waits in one step");
  if (!relative_ && v <= 0) return Status::Ok();
  waits_.push_back({dev(w_.link->stream_words(p).arrived), v, w_.link->peer(p).rank, kWaitArrival,
                    int16_t(relative_ ? step_base(p, true) : -1)});
  return Status::Ok();
}
Status KernelStream::wait_send_free(int p, int64_t v) {
  if (waits_.size() == size_t(kernels::kTableMaxWaits)) return error("too many waits in one step");
  if (!relative_ && v <= 0) return Status::Ok();
  waits_.push_back({dev(w_.link->stream_words(p).send_free), v, w_.link->peer(p).rank, kWaitSendSlot,
                    int16_t(relative_ ? step_base(p, false) : -1)});
  return Status::Ok();
}
Status KernelStream::signal(uint64_t* word, int base, uint64_t v) {
  if (signals_.size() == size_t(kernels::kTableMaxSignals)) return error("too many signals in one step");
  signals_.push_back({const_cast<uint64_t*>(dev(word)), v, relative_ ? base : -1});
  if (relative_) last_signal_[base] = v;
  return Status::Ok();
}
Status KernelStream::signal_ready(int p, uint64_t v) {
  return signal(w_.link->stream_words(p).ready, step_base(p, false), v);
}
Status KernelStream::signal_consumed(int p, uint64_t v) {
  return signal(w_.link->stream_words(p).consumed, step_base(p, true), v);
}

// Every operation of a step covers the step's elements (the step runner's bodies do). Copies
// are the kernel's, not cudaMemcpyAsync: a copy between two addresses of one device may wait
// for the other streams' work (CUDA's implicit synchronization), and another stream of this
// GPU may hold a kernel that waits for this very call (ranks sharing a GPU, or the caller's
// own streams).
Status KernelStream::copy(StepBuf dst, StepBuf src, size_t bytes) {
  if ((dst.p == src.p && dst.flag == src.flag) || bytes == 0) return Status::Ok();
  const size_t es = element_size(type_);
  if (bytes % es != 0) return error("a copy of " + std::to_string(bytes) + " bytes, not whole elements");
  const kernels::StepOp op = make_op(kernels::StepOpKind::kCopy, dst, {}, src, {});
  return add_ops(&op, 1, bytes / es);
}
Status KernelStream::fold(StepBuf dst, StepBuf dst2, const StepBuf* srcs, int k, size_t count, bool final) {
  if (k < 2 || k > kernels::kStepMaxFold) {
    return error("a fold of " + std::to_string(k) + " operands (2 to " + std::to_string(kernels::kStepMaxFold) + ")");
  }
  // The run: (srcs[0], srcs[1]), then each further source chained in `b`; only the last
  // operation stores, and is kReduceFinal when the fold is final.
  kernels::StepOp run[kernels::kStepMaxFold - 1];
  for (int j = 1; j < k; ++j) {
    const bool last = j == k - 1;
    const auto kind = last && final ? kernels::StepOpKind::kReduceFinal : kernels::StepOpKind::kReduce;
    run[j - 1] = make_op(kind, last ? dst : StepBuf{}, last ? dst2 : StepBuf{}, j == 1 ? srcs[0] : StepBuf{},
                         srcs[j]);
    run[j - 1].chain = j > 1 ? 1 : 0;
  }
  return add_ops(run, k - 1, count);
}
kernels::StepOp KernelStream::make_op(kernels::StepOpKind kind, StepBuf dst, StepBuf dst2, StepBuf a,
                                      StepBuf b) const {
  auto base = [&](const StepBuf& x) { return int8_t((x.flag != 0 || x.slot >= 0) && relative_ ? x.base : -1); };
  auto slot = [&](const StepBuf& x) { return x.slot >= 0 && relative_ ? uint16_t(x.slot) : kernels::kNoSlot; };
  kernels::StepOp op;
  op.kind = kind;
  op.dst_base = base(dst);
  op.dst2_base = base(dst2);
  op.a_base = base(a);
  op.b_base = base(b);
  op.dst_slot = slot(dst);
  op.dst2_slot = slot(dst2);
  op.a_slot = slot(a);
  op.b_slot = slot(b);
  op.dst = dst.p;
  op.dst2 = dst2.p;
  op.a = a.p;
  op.b = b.p;
  op.dst_flag = dst.flag;
  op.dst2_flag = dst2.flag;
  op.a_flag = a.flag;
  op.b_flag = b.flag;
  op.a_peer = a.peer;
  op.b_peer = b.peer;
  return op;
}
Status KernelStream::add_ops(const kernels::StepOp* ops, int n, size_t count) {
  if (count == 0) return Status::Ok();
  if (!ops_.empty() && step_.count != count) {
    return error("operations of " + std::to_string(step_.count) + " and " + std::to_string(count) +
                 " elements in one step");
  }
  if (ops_.size() + size_t(n) > size_t(kernels::kTableMaxOps)) return error("too many operations in one step");
  step_.count = count;
  ops_.insert(ops_.end(), ops, ops + n);
  return Status::Ok();
}

}  // namespace gradsync
