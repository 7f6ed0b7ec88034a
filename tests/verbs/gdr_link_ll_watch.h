// What the low-latency tests (gdr_link_ll_test.cc: direct peers; gdr_link_ll_nic_test.cc:
// queue-pair and TCP peers) watch of the step runner: a stream that counts the waits for
// `arrived`, the operands in low-latency slots and the steps whose signals it orders after
// their stores, and passes every call on to the host stream (gdr_link_world.h).
#pragma once

#include <atomic>
#include <initializer_list>
#include <memory>

#include "gdr_link_world.h"

namespace gradsync::gdr_link_ll_watch {

// The tests' low-latency slots: 64 bytes of payload, so a call of 2053 int64 is 257 messages a hop.
constexpr size_t kLlBytes = 128;

// A Ring tweak (gdr_link_world.h): every rank's links get low-latency slots of `bytes`, beside
// its RDMA peers' slots too (ll_queue_pairs).
inline auto with_ll(size_t bytes) {
  return [bytes](int, GdrLinkConfig& c, GdrLinkOps&) {
    c.ll_bytes = bytes;
    c.ll_queue_pairs = true;
  };
}

// Counts what the runner asks of the stream: waits for `arrived`, operands in low-latency
// slots, and steps whose signals it orders after their stores (StepStream::order_signals):
// those that send, and those that send with their signals unordered.
struct Seen {
  std::atomic<int> arrival_waits{0}, ll_operands{0};
  std::atomic<int> ordered_steps{0}, sending_steps{0}, unordered_sends{0};
  void clear() {
    for (auto* c : {&arrival_waits, &ll_operands, &ordered_steps, &sending_steps, &unordered_sends}) *c = 0;
  }
};
class WatchingStream final : public StepStream {
 public:
  WatchingStream(StepStream& inner, Seen* seen) : in_(inner), seen_(*seen) {}
  Status begin_step() override {
    ordered_ = false;
    readies_ = 0;
    return in_.begin_step();
  }
  void order_signals() override {
    ordered_ = true;
    in_.order_signals();
  }
  Status end_step() override {
    seen_.ordered_steps += ordered_ ? 1 : 0;
    seen_.sending_steps += readies_ > 0 ? 1 : 0;
    seen_.unordered_sends += readies_ > 0 && !ordered_ ? 1 : 0;
    return in_.end_step();
  }
  Status begin_call(bool relative) override { return in_.begin_call(relative); }
  Status end_call() override { return in_.end_call(); }
  Status wait_arrived(int p, int64_t v) override { return ++seen_.arrival_waits, in_.wait_arrived(p, v); }
  Status wait_send_free(int p, int64_t v) override { return in_.wait_send_free(p, v); }
  Status signal_ready(int p, uint64_t v) override { return ++readies_, in_.signal_ready(p, v); }
  Status signal_consumed(int p, uint64_t v) override { return in_.signal_consumed(p, v); }
  Status copy(StepBuf d, StepBuf s, size_t b) override { return count({d, s}), in_.copy(d, s, b); }
  Status fold(StepBuf d, StepBuf d2, const StepBuf* x, int k, size_t n, bool final) override {
    count({d, d2});
    for (int j = 0; j < k; ++j) count({x[j]});
    return in_.fold(d, d2, x, k, n, final);
  }

 private:
  void count(std::initializer_list<StepBuf> bufs) {
    for (const StepBuf& x : bufs) seen_.ll_operands += x.flag != 0 ? 1 : 0;
  }
  StepStream& in_;
  Seen& seen_;
  bool ordered_ = false;
  int readies_ = 0;
};

inline void watch(gdr_link_world::Ring& ring, Seen* seen) {
  ring.wrap_stream = [seen](int, StepStream& hs) { return std::make_unique<WatchingStream>(hs, seen); };
}

}  // namespace gradsync::gdr_link_ll_watch
