// One channel end as an algorithm sees it: acquire/publish/release with the slot metadata
// checks and error messages that name the peer. Internal to runtime/collectives.
#pragma once

#include "collectives/collective.h"

namespace gradsync {

// State shared by the links of one running collective.
struct RunContext {
  const RankLinks& links;
  const WaitContext& wait;
  const CollectiveCall& call;
  uint32_t signature;
  size_t esize;
  size_t slot_elems;
  // `wait.call_stop`: a thread of this call that failed raises it, and every wait of the
  // call's other threads (ring lanes) stops at once.
  std::atomic<bool>* call_stop = nullptr;
};

class SendLink {
 public:
  SendLink(RunContext& rc, Channel ch, int peer) : rc_(rc), ch_(ch), peer_(peer) {}
  Result<uint8_t*> acquire();
  void publish(size_t elems);
  // Publishes `elems` elements that are at `data` (the caller's buffers, unchanged until the
  // collective ends): a channel on a socket sends them from there, any other copies them into
  // `slot` (what acquire() returned) first.
  void publish_from(uint8_t* slot, const uint8_t* data, size_t elems);
  // Whether publish_from sends without the copy.
  bool zero_copy() const { return ch_.driven(); }

 private:
  RunContext& rc_;
  Channel ch_;
  int peer_;
  uint32_t step_ = 0;
};

class RecvLink {
 public:
  RecvLink(RunContext& rc, Channel ch, int peer) : rc_(rc), ch_(ch), peer_(peer) {}
  // Waits for the next slot and checks it carries `elems` elements of this very call.
  Result<const uint8_t*> acquire(size_t elems);
  // The same, for data whose next stop is `dst` (the caller's buffer): a channel on a socket
  // may read it straight there, and then returns `dst`; callers skip their copy when the
  // result is `dst`.
  Result<const uint8_t*> acquire_into(size_t elems, uint8_t* dst);
  void release() { ch_.release(); }

 private:
  RunContext& rc_;
  Channel ch_;
  int peer_;
  uint32_t step_ = 0;
};

// Turns a failed wait into an error naming the peer and the likely cause.
Status link_error(const RunContext& rc, const Status& s, bool sending, int peer, uint32_t step);

}  // namespace gradsync
