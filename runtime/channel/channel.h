// Channels (design §2): a one-way FIFO of `slots` slots of `slot_bytes` bytes from one rank
// to one peer, living in shared memory that trainers and the daemon map.
//
// The producer waits for a free slot (tail - head < slots), fills it, then publishes it by
// advancing `tail`; the consumer waits for tail > head, reads the slot, then releases it by
// advancing `head` (the credit back to the producer). Counters are 32-bit and wrap; only
// their difference matters. Waiting spins briefly then sleeps on a futex on the counter, so
// idle ranks cost nothing; a waiter wakes at least every kWaitSliceMs to look at the abort
// flag and its deadline.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "channel/flight_recorder.h"
#include "common/fd.h"

namespace gradsync {

// Changes with every change of the shared region's layout (JobControl, the channel counters,
// the flight recorders): a daemon and a library of different layouts refuse each other
// instead of misreading.
constexpr uint32_t kShmMagic = 0x47534333;  // "GSC3"
constexpr uint32_t kMaxSlots = 64;
constexpr uint32_t kDefaultSlots = 8;
constexpr uint32_t kDefaultSlotBytes = 1u << 20;  // 1 MiB: large enough to amortise a wake-up
constexpr size_t kAbortReasonBytes = 1024;

// Describes one published slot, so that the receiver can check it is what it expects.
struct SlotMeta {
  uint32_t bytes;     // payload bytes in this slot
  uint32_t seq;       // collective sequence number on this communicator
  uint64_t count;     // element count of the collective
  uint32_t signature; // kind/type/op of the collective
  uint32_t step;      // algorithm step that produced it
};

// Shared by every channel of one job on one node.
struct alignas(64) JobControl {
  uint32_t magic;
  uint32_t num_channels;
  uint32_t slots;
  uint32_t slot_bytes;
  alignas(64) std::atomic<uint32_t> aborted;  // 0 or 1; `reason` is valid once it is 1
  std::atomic<int32_t> failed_rank;            // -1 when not about one rank
  // The first aborter claims this (0 -> 1) before it writes `reason`: the daemon and any
  // trainer of the job may abort it at once (a rank whose collective failed writes the abort
  // here itself, so its node's ranks stop even when the daemon is paused or dead).
  std::atomic<uint32_t> claimed;
  char reason[kAbortReasonBytes];
};

struct alignas(64) ChannelCounters {
  alignas(64) std::atomic<uint32_t> tail;          // advanced by the producer
  std::atomic<uint32_t> tail_waiters;              // consumers asleep on `tail`
  alignas(64) std::atomic<uint32_t> head;          // advanced by the consumer
  std::atomic<uint32_t> head_waiters;              // producers asleep on `head`
  // Set (to 1) by a rank that left the job, on the channel ends it owned: a rank still
  // waiting on such a channel made more collective calls than that rank (Channel::mark_left).
  alignas(64) std::atomic<uint32_t> producer_left;
  std::atomic<uint32_t> consumer_left;
  alignas(64) SlotMeta meta[kMaxSlots];
};

// Byte offsets of everything in a job's shared memory.
struct ShmLayout {
  uint32_t num_channels = 0;
  uint32_t slots = kDefaultSlots;
  uint32_t slot_bytes = kDefaultSlotBytes;
  // Flight recorders (channel/flight_recorder.h): one per local rank, after the slot data.
  uint32_t recorders = 0;
  uint32_t recorder_entries = 0;

  static constexpr size_t kPage = 4096;
  size_t control_offset() const { return 0; }
  size_t counters_offset(uint32_t ch) const { return kPage + ch * round_up(sizeof(ChannelCounters)); }
  size_t data_offset(uint32_t ch) const {
    return round_up(counters_offset(num_channels)) + size_t{ch} * slots * slot_bytes;
  }
  size_t recorder_offset(uint32_t i) const {
    return round_up(data_offset(num_channels)) + size_t{i} * round_up(recorder_bytes(recorder_entries));
  }
  size_t total_bytes() const {
    return recorders == 0 ? data_offset(num_channels) : recorder_offset(recorders);
  }
  static size_t round_up(size_t n) { return (n + kPage - 1) / kPage * kPage; }
};

// Writes the control block of a fresh (zeroed) region.
void init_job_control(void* base, const ShmLayout& layout);
// Checks a mapped region against the layout the daemon announced.
Status check_job_control(const void* base, const ShmLayout& layout);

// Marks the job aborted (first reason wins) and wakes every waiter of every channel. Safe to
// call from several processes at once (JobControl::claimed). True when this call's reason won.
bool abort_job(void* base, const ShmLayout& layout, int failed_rank, const std::string& reason);

// Why a wait should stop early, besides its deadline: the job's abort flag in shared memory
// and a process-local flag (e.g. the trainer lost its daemon).
struct WaitContext {
  const JobControl* control = nullptr;
  const std::atomic<bool>* local_abort = nullptr;
  const std::string* local_abort_reason = nullptr;
  // Set by a sibling thread of the same call (a ring lane) that failed: every wait of the call
  // stops at once, not only between its positions.
  const std::atomic<bool>* call_stop = nullptr;
  // A collective's waits (not the daemon's pumps): a channel whose other end's rank left the
  // job (ChannelCounters::producer_left / consumer_left) ends the wait with kMismatch.
  bool peers_leave = false;
  Deadline deadline = Deadline::max();
  // How long to spin before sleeping on the futex: about a sleep/wake pair when every waiter
  // has a core of its own; short when ranks outnumber cores, where spinning only steals the
  // time slice of the peer being waited for.
  std::chrono::microseconds spin{30};
  // Then how long to keep polling with sched_yield between polls before sleeping: a waiter
  // that yields costs a rank with work on its core only a context switch, not a time slice,
  // and it sees the peer's answer without the wake-up of a sleeper (tens of microseconds on a
  // virtual machine whose idle cores halt).
  std::chrono::microseconds yield_spin{0};
  // Where a wait that may block stores the rank it waits for (the flight recorder's entry of
  // the running collective), or null.
  std::atomic<int32_t>* waiting_for = nullptr;
};

// The spin a rank should use when `local_ranks` share this node's cores.
std::chrono::microseconds spin_for(int local_ranks);

// True when the context says to stop waiting (the job or the process aborted).
bool wait_stopped(const WaitContext& ctx);

// Moves the slots of channels whose other end is a stream socket the rank itself owns
// (transport/tcp/socket_driver.h), in the rank's own thread, while that thread waits: there is
// no proxy thread to hand each slot to. A channel with a driver waits through it; every other
// channel of the same rank keeps the driver going between short sleeps, so a slot published on
// a socket always leaves while the rank waits for something else.
class ChannelDriver {
 public:
  virtual ~ChannelDriver() = default;
  // Moves data on every socket until `ready()` holds, the context stops, or its deadline passes.
  // `channel`: the index of the channel waited on (its socket closing is then an error), or -1.
  virtual Status progress_until(const std::function<bool()>& ready, const WaitContext& ctx, int channel) = 0;
  // One pass over the sockets without blocking (a sleep slice ended).
  virtual Status poke(const WaitContext& ctx) = 0;
  // A slot was published on driven channel `channel`: start sending it without blocking.
  virtual void published(uint32_t channel) = 0;
  // The next slot published on driven send channel `channel` carries the bytes at `data`
  // instead of its own (they stay unchanged until flush() returns).
  virtual void send_from(uint32_t channel, uint32_t seq, const void* data) = 0;
  // The frame of slot `seq` of driven receive channel `channel`, when its meta equals
  // `expect`, lands at `dst` instead of in the slot (when its payload has not started yet).
  virtual void recv_into(uint32_t channel, uint32_t seq, const SlotMeta& expect, void* dst) = 0;
  // Where slot `seq` of `channel` landed: `dst` of recv_into, or null for the slot.
  virtual const uint8_t* landed_at(uint32_t channel, uint32_t seq) = 0;
  // After a failed collective: sends nothing more (queued slots may point into buffers
  // that are the caller's again); every later wait reports `why`.
  virtual void abandon(const Status& why) = 0;
  // Waits until every published slot is in the kernel's hands (the end of a collective).
  // Inside lanes (below): only the slots of the calling thread's lane.
  virtual Status flush(const WaitContext& ctx) = 0;
  // The rank whose connection broke first, or -1 (none broke, or not known).
  virtual int failed_peer() const { return -1; }
  // The rank leaves the job healthy, its last slots sent: tells each peer it sends to, so that
  // one still waiting for data fails with kMismatch (kPeerLeftMessage) instead of a lost peer.
  virtual void goodbye(Deadline /*deadline*/) {}
  // The job ended for this rank (after abandon()): tells the rank at the other end of each of
  // its sockets, both ways, why (`reason`, and `culprit`: the rank at fault or -1), so that a
  // peer waiting for it fails at once with that reason instead of finding the socket closed
  // when this process exits. Best effort, bounded by `deadline`.
  virtual void tell_abort(const std::string& /*reason*/, int /*culprit*/, Deadline /*deadline*/) {}
  // An abort a peer told this rank over one of its sockets (tell_abort), once one arrived.
  struct ToldAbort {
    bool told = false;
    std::string reason;  // the peer's reason, as it sent it
    int culprit = -1;    // the rank it named, or -1
    std::string from;    // "rank 2 (host h) at 10.0.0.2:41234"
  };
  virtual ToldAbort told_abort() const { return {}; }
  // Wakes the threads asleep in this driver now (any thread may call it): a process-local
  // abort was raised, which they see when they wake.
  virtual void interrupt() {}

  // Lanes: several threads of one rank drive disjoint sets of channels at once (the ring's
  // threads, ring.cc). After begin_lanes() returns true, assign_lane() gives channels to
  // lanes 0..n-1 and each thread calls enter_lane() with its own; until end_lanes() (called
  // when the threads have joined) a thread moves only the sockets of its lane's channels, and
  // lane 0 also those of no lane. A thread leaving its lane early flushes its lane first.
  // False: this driver moves its sockets from one thread only.
  virtual bool begin_lanes() { return false; }
  virtual void assign_lane(bool /*send*/, uint32_t /*channel*/, int /*lane*/) {}
  virtual void enter_lane(int /*lane*/) {}
  virtual void end_lanes() {}
};

// A view of one channel in a mapped region. Cheap to copy.
class Channel {
 public:
  Channel() = default;
  Channel(void* base, const ShmLayout& layout, uint32_t index);

  uint32_t index() const { return index_; }
  uint32_t slot_bytes() const { return slot_bytes_; }
  uint32_t slots() const { return slots_; }

  // Producer side.
  Result<uint8_t*> acquire_send(const WaitContext& ctx);
  void publish(const SlotMeta& meta);
  // Driven channels only: publishes a slot whose payload is `meta.bytes` at `data`, sent from
  // there (ChannelDriver::send_from) instead of from the slot.
  void publish_external(const SlotMeta& meta, const void* data);
  // Consumer side.
  Result<const uint8_t*> acquire_recv(const WaitContext& ctx, SlotMeta* meta);
  // The same; on a driven channel a frame whose meta is `expect` may land at `dst` directly,
  // and then the result is `dst` (else the slot, as above).
  Result<const uint8_t*> acquire_recv_into(const WaitContext& ctx, SlotMeta* meta, const SlotMeta& expect,
                                           uint8_t* dst);
  void release();

  // Slots published but not yet released.
  uint32_t in_flight() const;

  // For transports that move slots with one-sided writes (the verbs pumps): the counters,
  // the slot and meta of sequence number `seq`, and publishing a slot whose payload and meta
  // a NIC already placed (the producer's credit came from the consumer's `head`).
  uint32_t published() const { return c_->tail.load(std::memory_order_acquire); }
  uint32_t consumed() const { return c_->head.load(std::memory_order_acquire); }
  uint8_t* slot_data(uint32_t seq) const { return data_ + size_t{seq % slots_} * slot_bytes_; }
  SlotMeta* slot_meta(uint32_t seq) const { return &c_->meta[seq % slots_]; }
  void publish_landed();
  // Waits until `published() != seen` (or the context says stop / its deadline passes).
  Status wait_published(uint32_t seen, const WaitContext& ctx);
  // Wakes everybody asleep on this channel (after an abort).
  void wake_all();
  // This rank left the job: marks its end of the channel (`producer`: it sent on it) so that
  // a peer still waiting on it learns it will never get another slot or credit, and wakes it.
  void mark_left(bool producer);

  // The rank's socket driver. `driven`: this channel's other end is one of its sockets, and
  // its waits are the driver's progress; otherwise the channel is in shared memory and its
  // waits sleep in short slices, poking the driver between them.
  void set_driver(ChannelDriver* driver, bool driven) {
    driver_ = driver;
    driven_ = driven;
  }
  bool driven() const { return driven_; }
  // The rank at the other end, for the flight recorder (-1: not told).
  void set_peer(int rank) { peer_ = rank; }
  int peer() const { return peer_; }

 private:
  Status wait_head(uint32_t tail, const WaitContext& ctx);
  Status wait_tail(uint32_t head, const WaitContext& ctx);

  ChannelDriver* driver_ = nullptr;
  bool driven_ = false;
  int peer_ = -1;
  ChannelCounters* c_ = nullptr;
  uint8_t* data_ = nullptr;
  uint32_t index_ = 0;
  uint32_t slots_ = 0;
  uint32_t slot_bytes_ = 0;
};

// Status for a wait that stopped because of an abort (reason from the control block).
Status aborted_status(const WaitContext& ctx);

// The message of the kMismatch a wait returns when the rank at the channel's other end left
// the job (link_error turns it into one that names that rank and the call).
extern const char kPeerLeftMessage[];
// The message of the kAborted a wait returns when a sibling thread of its call failed.
extern const char kSiblingFailedMessage[];

}  // namespace gradsync
