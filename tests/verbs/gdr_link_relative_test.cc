// Relative message counts (gpu/step_runner.h) on the CPU: on one node of direct peers every
// call numbers its messages from 0 on top of the stream's bases, and names its slots from the
// base (StepBuf::slot), which the stream moves on. So the same call asks its stream for the
// same waits, signals, slots and flags whichever calls ran before it (what lets a step call
// captured in a CUDA graph replay), while the words it leaves behind count its messages
// exactly (no call ends on a multiple of the slots) and every result is exact, which it is
// only where both ends of a hop move their slots on alike.
// Across nodes the counts stay absolute, and the same call's requests differ.
#include <algorithm>
#include <mutex>
#include <sstream>

#include "gdr_link_world.h"
#include "gpu/plan/schedule.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using namespace gdr_link_world;
using plan::Algo;

// What the runner asks of a stream, as text, one rank's call after another's.
class RecordingStream final : public StepStream {
 public:
  RecordingStream(StepStream& inner, std::string* out) : in_(inner), out_(*out) {}
  Status begin_call(bool relative) override { return put("call ", relative), in_.begin_call(relative); }
  Status begin_step() override { return put("step"), in_.begin_step(); }
  void order_signals() override { in_.order_signals(); }
  Status end_step() override { return in_.end_step(); }
  Status end_call() override { return in_.end_call(); }
  Status wait_arrived(int p, int64_t v) override { return put(" wa ", p, ":", v), in_.wait_arrived(p, v); }
  Status wait_send_free(int p, int64_t v) override { return put(" wf ", p, ":", v), in_.wait_send_free(p, v); }
  Status signal_ready(int p, uint64_t v) override { return put(" sr ", p, ":", v), in_.signal_ready(p, v); }
  Status signal_consumed(int p, uint64_t v) override { return put(" sc ", p, ":", v), in_.signal_consumed(p, v); }
  Status copy(StepBuf d, StepBuf s, size_t b) override { return put(" copy", buf(d), buf(s), b), in_.copy(d, s, b); }
  Status fold(StepBuf d, StepBuf d2, const StepBuf* x, int k, size_t n, bool final) override {
    put(final ? " final" : " fold", buf(d), buf(d2));
    for (int j = 0; j < k; ++j) put(buf(x[j]));
    return put(" ", n), in_.fold(d, d2, x, k, n, final);
  }

 private:
  static std::string buf(const StepBuf& b) {
    std::ostringstream o;
    o << " " << b.p << "/" << b.flag << "/" << b.base << "/" << b.slot;
    return o.str();
  }
  template <class... T>
  void put(const T&... x) {
    std::ostringstream o;
    (o << ... << x);
    out_ += o.str();
  }
  StepStream& in_;
  std::string& out_;
};

// Every rank's requests during one allreduce of `count` on fixed buffers, checked exact.
std::vector<std::string> recorded_allreduce(Ring& ring, int n, size_t count, Algo algo,
                                            std::vector<std::vector<int64_t>>& send,
                                            std::vector<std::vector<int64_t>>& recv) {
  std::vector<std::string> rec(static_cast<size_t>(n));
  ring.wrap_stream = [&rec](int r, StepStream& hs) { return std::make_unique<RecordingStream>(hs, &rec[size_t(r)]); };
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo);
  ring.wrap_stream = nullptr;
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(st[r].ok()) << plan::to_string(algo) << " rank " << r << ": " << st[r].to_string();
    for (size_t i = 0; i < count; ++i) {
      if (recv[r][i] != sum_at(send, i)) {
        ADD_FAILURE() << plan::to_string(algo) << " count " << count << " rank " << r << " element " << i;
        break;
      }
    }
  }
  return rec;
}

// Messages per peer and direction so far: each recorded call's last relative signal ("sr p:v",
// "sc p:v") added to `sent` and `read` (per rank and peer index).
void count_messages(const std::vector<std::string>& rec, std::vector<std::vector<uint64_t>>& sent,
                    std::vector<std::vector<uint64_t>>& read) {
  for (size_t r = 0; r < rec.size(); ++r) {
    std::vector<uint64_t> s(sent[r].size(), 0), c(read[r].size(), 0);
    std::istringstream in(rec[r]);
    std::string tok;
    while (in >> tok) {
      if (tok != "sr" && tok != "sc") continue;
      std::string pv;
      in >> pv;
      const size_t p = std::stoul(pv.substr(0, pv.find(':')));
      const uint64_t v = std::stoull(pv.substr(pv.find(':') + 1));
      auto& x = tok == "sr" ? s : c;
      x[p] = std::max(x[p], v);
    }
    for (size_t p = 0; p < s.size(); ++p) {
      sent[r][p] += s[p];
      read[r][p] += c[p];
    }
  }
}

// Every rank's signal words: the messages it sent to and read from each peer, exactly.
void expect_words_count_the_messages(Ring& ring, int n, const std::vector<std::vector<uint64_t>>& sent,
                                     const std::vector<std::vector<uint64_t>>& read, const std::string& after) {
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      const GdrLink::StreamWords w = ring.link(r).stream_words(p);
      EXPECT_EQ(load(w.ready), sent[size_t(r)][size_t(p)]) << after << ": rank " << r << " peer " << p;
      EXPECT_EQ(load(w.consumed), read[size_t(r)][size_t(p)]) << after << ": rank " << r << " peer " << p;
    }
  }
}

// One node of n direct ranks with `slots` slots of 256 bytes, low-latency slots of 64 bytes of
// payload, the pairs too: every algorithm, both protocols. The tests' shape: 4 ranks, 3 slots.
constexpr int kRanks = 4;
constexpr uint32_t kSlots = 3;
std::unique_ptr<Ring> one_node(int n = kRanks, uint32_t slots = kSlots) {
  return std::make_unique<Ring>(n, slots, 256, /*per_node=*/n, 10s, 1, /*direct=*/true, /*nic=*/false,
                                /*tcp=*/false, [](int, GdrLinkConfig& c, GdrLinkOps&) { c.ll_bytes = 128; },
                                /*pairs=*/true);
}

TEST(RelativeCounts, OneNodeCallAsksTheSameWhateverRanBefore) {
  const int n = kRanks;
  const uint32_t slots = kSlots;
  auto node = one_node();
  Ring& ring = *node;
  ASSERT_EQ(ring.error(), "");
  const size_t count = 301;  // messages per hop that are no multiple of the slots
  auto send = inputs(n, count), between = inputs(n, 2053);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count)), recv2(n, std::vector<int64_t>(2053));
  std::vector<std::vector<uint64_t>> sent(n), read(n);
  for (int r = 0; r < n; ++r) {
    sent[size_t(r)] = read[size_t(r)] = std::vector<uint64_t>(size_t(ring.link(r).peer_count()), 0);
  }
  uint64_t off_boundary = 0;  // words left on no multiple of the slots
  for (bool ll : {false, true}) {
    ring.low_latency = ll;
    for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kOneShot, Algo::kTwoShot}) {
      const std::string what = std::string(plan::to_string(algo)) + (ll ? " low-latency" : " bulk");
      auto first = recorded_allreduce(ring, n, count, algo, send, recv);
      count_messages(first, sent, read);
      expect_words_count_the_messages(ring, n, sent, read, what);
      // Calls of other lengths on other algorithms in between move the bases on.
      for (Algo other : {Algo::kTree, Algo::kRing, Algo::kTwoShot}) {
        count_messages(recorded_allreduce(ring, n, 2053, other, between, recv2), sent, read);
        expect_words_count_the_messages(ring, n, sent, read, what + " then " + plan::to_string(other));
        for (int r = 0; r < n; ++r)
          for (uint64_t x : sent[size_t(r)]) off_boundary += x % slots != 0 ? 1 : 0;
      }
      auto again = recorded_allreduce(ring, n, count, algo, send, recv);
      count_messages(again, sent, read);
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(first[size_t(r)].rfind("call 1", 0), 0u) << what << " rank " << r;
        EXPECT_EQ(first[size_t(r)], again[size_t(r)]) << what << ": rank " << r << " asked otherwise the second time";
      }
    }
  }
  // The calls started in the middle of the slots (else the test would not show that both ends
  // move them on alike).
  EXPECT_GT(off_boundary, 0u);
}

// A stream that checks where each message goes: every message sent to a peer (its
// signal_ready) was written, in its step, into the slot of its absolute number (GdrLink::slot
// or ll_slot of the base plus its relative count), once moved on as the kernel moves it.
class SlotCheckingStream final : public StepStream {
 public:
  SlotCheckingStream(StepStream& inner, const GdrLink& link, std::string* err) : in_(inner), link_(link), err_(*err) {}
  Status begin_call(bool relative) override {
    base_.assign(2 * size_t(link_.peer_count()), 0);
    for (int p = 0; relative && p < link_.peer_count(); ++p) {
      base_[size_t(step_base(p, false))] = load(link_.stream_words(p).ready);
      base_[size_t(step_base(p, true))] = load(link_.stream_words(p).consumed);
    }
    return in_.begin_call(relative);
  }
  Status begin_step() override {
    written_.clear();
    return in_.begin_step();
  }
  void order_signals() override { in_.order_signals(); }
  Status end_step() override { return in_.end_step(); }
  Status end_call() override { return in_.end_call(); }
  Status wait_arrived(int p, int64_t v) override { return in_.wait_arrived(p, v); }
  Status wait_send_free(int p, int64_t v) override { return in_.wait_send_free(p, v); }
  Status signal_ready(int p, uint64_t v) override {
    const uint64_t msg = base_[size_t(step_base(p, false))] + v - 1;
    const void* bulk = link_.slot(p, false, msg);
    const void* ll = link_.ll_slot(p, false, msg);
    if (std::find(written_.begin(), written_.end(), bulk) == written_.end() &&
        (ll == nullptr || std::find(written_.begin(), written_.end(), ll) == written_.end())) {
      err_ += " message " + std::to_string(msg) + " to peer " + std::to_string(p) + " not in its slot;";
    }
    return in_.signal_ready(p, v);
  }
  Status signal_consumed(int p, uint64_t v) override { return in_.signal_consumed(p, v); }
  Status copy(StepBuf d, StepBuf s, size_t b) override {
    wrote(d);
    return in_.copy(d, s, b);
  }
  Status fold(StepBuf d, StepBuf d2, const StepBuf* x, int k, size_t n, bool final) override {
    wrote(d);
    wrote(d2);
    return in_.fold(d, d2, x, k, n, final);
  }

 private:
  void wrote(const StepBuf& b) {
    if (b.p == nullptr) return;
    if (b.slot < 0 || b.base < 0) {
      written_.push_back(b.p);
      return;
    }
    written_.push_back(moved_on(link_, b, base_[size_t(b.base)]));
  }
  StepStream& in_;
  const GdrLink& link_;
  std::string& err_;
  std::vector<uint64_t> base_;
  std::vector<const void*> written_;
};

// Calls of every algorithm and both protocols, one after another: every message takes the
// slot of its absolute number, though the calls start in the middle of the slots.
TEST(RelativeCounts, EachMessageTakesTheSlotOfItsNumber) {
  const int n = kRanks;
  const uint32_t slots = kSlots;
  auto node = one_node();
  Ring& ring = *node;
  ASSERT_EQ(ring.error(), "");
  std::vector<std::string> err(n);
  ring.wrap_stream = [&](int r, StepStream& hs) {
    return std::make_unique<SlotCheckingStream>(hs, ring.link(r), &err[size_t(r)]);
  };
  for (size_t count : {size_t(301), size_t(2053), size_t(37)}) {
    auto send = inputs(n, count);
    std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count));
    for (bool ll : {false, true}) {
      ring.low_latency = ll;
      for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kOneShot, Algo::kTwoShot}) {
        auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo);
        for (int r = 0; r < n; ++r) {
          ASSERT_TRUE(st[r].ok()) << plan::to_string(algo) << " rank " << r << ": " << st[r].to_string();
          EXPECT_EQ(recv[r][count - 1], sum_at(send, count - 1)) << plan::to_string(algo) << " rank " << r;
        }
      }
    }
  }
  ring.wrap_stream = nullptr;
  for (int r = 0; r < n; ++r) EXPECT_EQ(err[size_t(r)], "") << "rank " << r;
  // The calls left the words on no multiple of the slots somewhere (else this shows nothing).
  bool off = false;
  for (int r = 0; r < n; ++r)
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      off = off || load(ring.link(r).stream_words(p).ready) % slots != 0;
    }
  EXPECT_TRUE(off);
}

// Two nodes of two: the hops between nodes are queue pairs, whose worker numbers messages since
// set-up, so the counts are absolute and a second identical call asks for other counts.
TEST(RelativeCounts, AcrossNodesTheCountsStayAbsolute) {
  const int n = 4;
  Ring ring(n, 2, 256, /*per_node=*/2, 10s, 1, /*direct=*/true);
  ASSERT_EQ(ring.error(), "");
  auto send = inputs(n, 101);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(101));
  auto first = recorded_allreduce(ring, n, 101, Algo::kRing, send, recv);
  auto again = recorded_allreduce(ring, n, 101, Algo::kRing, send, recv);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(first[size_t(r)].rfind("call 0", 0), 0u) << "rank " << r;
    EXPECT_NE(first[size_t(r)], again[size_t(r)]) << "rank " << r;
  }
}

}  // namespace
}  // namespace gradsync
