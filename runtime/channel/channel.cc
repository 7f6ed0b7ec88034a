#include "channel/channel.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <thread>
#include <cstring>

namespace gradsync {
namespace {

// A sleeping waiter looks at its abort flags and deadline at least this often, so a missed
// wake-up costs at most this much latency, and an idle rank wakes 4 times a second.
constexpr int kWaitSliceMs = 250;
// A rank that owns sockets (ChannelDriver) sleeps on a shared-memory channel at most this long
// before it moves its sockets again; only a socket whose kernel buffer was full needs that.
// The slice starts at this, and doubles up to kDriverSliceMaxUs while the wait goes on, so a
// rank that waits long for a slow peer wakes only a few hundred times a second.
constexpr long kDriverSliceUs = 200;
constexpr long kDriverSliceMaxUs = 5000;
// Polls between two clock reads while spinning.
constexpr int kPollsPerClockRead = 32;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, long timeout_us) {
  timespec ts{timeout_us / 1'000'000, (timeout_us % 1'000'000) * 1000L};
  // Shared futex (no FUTEX_PRIVATE_FLAG): the word lives in memory mapped by several processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool stopped(const WaitContext& ctx) { return wait_stopped(ctx); }

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Waits until `ready(word value)` holds. Returns kAborted or kDeadlineExceeded otherwise.
// With a driver (the rank also owns sockets), sleeps in short slices and pokes it in between.
// `gone`: the flag the other end's rank sets when it leaves the job (null: not watched).
template <typename Ready>
Status wait_for(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters, const WaitContext& ctx,
                ChannelDriver* driver, Ready ready, const std::atomic<uint32_t>* gone = nullptr) {
  // The leaver set `gone` after its last publish or release: once it is seen, one more look
  // at the counter tells for good whether anything will ever come.
  auto left = [&] {
    return gone && gone->load(std::memory_order_acquire) != 0 && !ready(word.load(std::memory_order_acquire));
  };
  const auto start = Clock::now();
  const auto spin_until = start + ctx.spin, yield_until = spin_until + ctx.yield_spin;
  for (;;) {
    for (int i = 0; i < kPollsPerClockRead; ++i) {
      if (ready(word.load(std::memory_order_acquire))) return Status::Ok();
      cpu_relax();
    }
    if (Clock::now() >= spin_until) break;
  }
  long slice_us = kDriverSliceUs;
  while (Clock::now() < yield_until) {
    if (ready(word.load(std::memory_order_acquire))) return Status::Ok();
    if (stopped(ctx)) return aborted_status(ctx);
    if (left()) return {Code::kMismatch, kPeerLeftMessage};
    if (driver) GS_RETURN_IF_ERROR(driver->poke(ctx));
    sched_yield();
  }
  for (;;) {
    if (stopped(ctx)) return aborted_status(ctx);
    if (left()) return {Code::kMismatch, kPeerLeftMessage};
    if (driver) GS_RETURN_IF_ERROR(driver->poke(ctx));
    int timeout = poll_timeout_ms(ctx.deadline, kWaitSliceMs);
    if (timeout == 0 && Clock::now() >= ctx.deadline) {
      return {Code::kDeadlineExceeded, "deadline passed"};
    }
    long timeout_us = driver ? std::min<long>(slice_us, std::max(timeout, 1) * 1000L) : timeout * 1000L;
    slice_us = std::min(slice_us * 2, kDriverSliceMaxUs);
    waiters.fetch_add(1, std::memory_order_seq_cst);
    uint32_t v = word.load(std::memory_order_seq_cst);
    if (ready(v)) {
      waiters.fetch_sub(1, std::memory_order_relaxed);
      return Status::Ok();
    }
    futex_wait(&word, v, timeout_us);
    waiters.fetch_sub(1, std::memory_order_relaxed);
    if (ready(word.load(std::memory_order_acquire))) return Status::Ok();
  }
}

void advance(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters) {
  word.fetch_add(1, std::memory_order_seq_cst);
  // seq_cst pairs with the waiter's increment-then-load: either it sees the new value or we
  // see it waiting.
  if (waiters.load(std::memory_order_seq_cst) != 0) futex_wake(&word);
}

}  // namespace

const char kPeerLeftMessage[] = "the rank at the other end of the channel left the job";
const char kSiblingFailedMessage[] = "another ring failed";

bool wait_stopped(const WaitContext& ctx) {
  return (ctx.control && ctx.control->aborted.load(std::memory_order_acquire)) ||
         (ctx.local_abort && ctx.local_abort->load(std::memory_order_acquire)) ||
         (ctx.call_stop && ctx.call_stop->load(std::memory_order_acquire));
}

std::chrono::microseconds spin_for(int local_ranks) {
  // A futex sleep and wake-up pair costs 6 to 50 us one way on the 2-core VM (gradsync-limits;
  // more when the host is busy). Where a rank has a core to itself and one is left over,
  // spinning 30 us catches a peer that answers within a few hand-offs. Where the ranks fill
  // the cores, a spinning rank steals the time slice of the peer it waits for, so it spins
  // only briefly and then polls with sched_yield (WaitContext::yield_spin) instead.
  unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return unsigned(local_ranks) < cores ? std::chrono::microseconds(30) : std::chrono::microseconds(2);
}

void init_job_control(void* base, const ShmLayout& layout) {
  auto* control = new (base) JobControl{};
  control->num_channels = layout.num_channels;
  control->slots = layout.slots;
  control->slot_bytes = layout.slot_bytes;
  control->failed_rank.store(-1);
  for (uint32_t ch = 0; ch < layout.num_channels; ++ch) {
    new (static_cast<char*>(base) + layout.counters_offset(ch)) ChannelCounters{};
  }
  std::atomic_thread_fence(std::memory_order_release);
  control->magic = kShmMagic;
}

Status check_job_control(const void* base, const ShmLayout& layout) {
  auto* control = static_cast<const JobControl*>(base);
  if (control->magic != kShmMagic || control->num_channels != layout.num_channels ||
      control->slots != layout.slots || control->slot_bytes != layout.slot_bytes) {
    return {Code::kInternal, "shared memory from gradsyncd does not match its announced layout "
                             "(daemon and library of different versions?)"};
  }
  return Status::Ok();
}

bool abort_job(void* base, const ShmLayout& layout, int failed_rank, const std::string& reason) {
  auto* control = static_cast<JobControl*>(base);
  // One writer of the reason: the daemon and the job's trainers may race here.
  const bool won = control->claimed.exchange(1, std::memory_order_acq_rel) == 0;
  if (won) {
    size_t n = std::min(reason.size(), kAbortReasonBytes - 1);
    std::memcpy(control->reason, reason.data(), n);
    control->reason[n] = '\0';
    control->failed_rank.store(failed_rank, std::memory_order_relaxed);
    control->aborted.store(1, std::memory_order_release);
  }
  for (uint32_t ch = 0; ch < layout.num_channels; ++ch) Channel(base, layout, ch).wake_all();
  return won;
}

Status aborted_status(const WaitContext& ctx) {
  if (ctx.control && ctx.control->aborted.load(std::memory_order_acquire)) {
    // The reason lives in memory every rank can write: never read past its array.
    return {Code::kAborted, std::string(ctx.control->reason, ::strnlen(ctx.control->reason, kAbortReasonBytes))};
  }
  // The reason is written before the flag is raised, and only read after it was seen.
  const bool local = ctx.local_abort && ctx.local_abort->load(std::memory_order_acquire);
  if (!local && ctx.call_stop && ctx.call_stop->load(std::memory_order_acquire)) {
    return {Code::kAborted, kSiblingFailedMessage};
  }
  return {Code::kAborted, local && ctx.local_abort_reason ? *ctx.local_abort_reason : "aborted"};
}

Channel::Channel(void* base, const ShmLayout& layout, uint32_t index)
    : c_(reinterpret_cast<ChannelCounters*>(static_cast<char*>(base) + layout.counters_offset(index))),
      data_(static_cast<uint8_t*>(base) + layout.data_offset(index)),
      index_(index),
      slots_(layout.slots),
      slot_bytes_(layout.slot_bytes) {}

Status Channel::wait_head(uint32_t tail, const WaitContext& ctx) {
  if (ctx.waiting_for) ctx.waiting_for->store(peer_, std::memory_order_relaxed);
  auto credit = [&](uint32_t head) { return tail - head < slots_; };
  if (driven_) {
    return driver_->progress_until([&] { return credit(c_->head.load(std::memory_order_acquire)); }, ctx,
                                   int(index_));
  }
  return wait_for(c_->head, c_->head_waiters, ctx, driver_, credit, ctx.peers_leave ? &c_->consumer_left : nullptr);
}

Status Channel::wait_tail(uint32_t head, const WaitContext& ctx) {
  if (ctx.waiting_for) ctx.waiting_for->store(peer_, std::memory_order_relaxed);
  auto landed = [&](uint32_t tail) { return tail != head; };
  if (driven_) {
    return driver_->progress_until([&] { return landed(c_->tail.load(std::memory_order_acquire)); }, ctx,
                                   int(index_));
  }
  return wait_for(c_->tail, c_->tail_waiters, ctx, driver_, landed, ctx.peers_leave ? &c_->producer_left : nullptr);
}

Result<uint8_t*> Channel::acquire_send(const WaitContext& ctx) {
  uint32_t tail = c_->tail.load(std::memory_order_relaxed);  // only this producer writes it
  GS_RETURN_IF_ERROR(wait_head(tail, ctx));
  return data_ + size_t{tail % slots_} * slot_bytes_;
}

void Channel::publish(const SlotMeta& meta) {
  uint32_t tail = c_->tail.load(std::memory_order_relaxed);
  c_->meta[tail % slots_] = meta;
  advance(c_->tail, c_->tail_waiters);
  // Start the slot on its way now; a failure shows at the rank's next wait or flush.
  if (driven_) driver_->published(index_);
}

void Channel::publish_external(const SlotMeta& meta, const void* data) {
  driver_->send_from(index_, c_->tail.load(std::memory_order_relaxed), data);
  publish(meta);
}

Result<const uint8_t*> Channel::acquire_recv(const WaitContext& ctx, SlotMeta* meta) {
  uint32_t head = c_->head.load(std::memory_order_relaxed);  // only this consumer writes it
  GS_RETURN_IF_ERROR(wait_tail(head, ctx));
  if (meta) *meta = c_->meta[head % slots_];
  return static_cast<const uint8_t*>(data_ + size_t{head % slots_} * slot_bytes_);
}

Result<const uint8_t*> Channel::acquire_recv_into(const WaitContext& ctx, SlotMeta* meta, const SlotMeta& expect,
                                                  uint8_t* dst) {
  if (!driven_) return acquire_recv(ctx, meta);
  uint32_t head = c_->head.load(std::memory_order_relaxed);
  driver_->recv_into(index_, head, expect, dst);
  GS_RETURN_IF_ERROR(wait_tail(head, ctx));
  if (meta) *meta = c_->meta[head % slots_];
  if (const uint8_t* at = driver_->landed_at(index_, head)) return at;
  return static_cast<const uint8_t*>(data_ + size_t{head % slots_} * slot_bytes_);
}

void Channel::release() { advance(c_->head, c_->head_waiters); }

void Channel::publish_landed() {
  // The payload and meta were written by the NIC before the completion that led here; the
  // release in advance() orders them before the consumer's acquire of `tail`.
  std::atomic_thread_fence(std::memory_order_acquire);
  advance(c_->tail, c_->tail_waiters);
}

Status Channel::wait_published(uint32_t seen, const WaitContext& ctx) {
  return wait_for(c_->tail, c_->tail_waiters, ctx, nullptr, [&](uint32_t tail) { return tail != seen; });
}

uint32_t Channel::in_flight() const {
  return c_->tail.load(std::memory_order_acquire) - c_->head.load(std::memory_order_acquire);
}

void Channel::wake_all() {
  futex_wake(&c_->tail);
  futex_wake(&c_->head);
}

void Channel::mark_left(bool producer) {
  (producer ? c_->producer_left : c_->consumer_left).store(1, std::memory_order_release);
  wake_all();
}

}  // namespace gradsync
