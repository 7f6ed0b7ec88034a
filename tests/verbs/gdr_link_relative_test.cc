// Relative message counts (gpu/step_runner.h) on the CPU: on one node of direct peers every
// call numbers its messages from 0 on top of the stream's bases, and rounds its last signal to
// or from each peer up to a multiple of the slots. So the same call asks its stream for the
// same waits, signals, slots and flags whichever calls ran before it (what lets a step call
// captured in a CUDA graph replay), and the words it leaves behind are multiples of the slots.
// Across nodes the counts stay absolute, and the same call's requests differ.
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
    o << " " << b.p << "/" << b.flag << "/" << b.base;
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

// Every signal word of every rank's link, a multiple of the slots.
void expect_words_on_slot_boundaries(Ring& ring, int n, uint32_t slots, const std::string& after) {
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      const GdrLink::StreamWords w = ring.link(r).stream_words(p);
      for (const uint64_t* x : {w.ready, w.consumed, w.arrived, w.send_free}) {
        EXPECT_EQ(load(x) % slots, 0u) << after << ": rank " << r << " peer " << p << " word at " << load(x);
      }
    }
  }
}

TEST(RelativeCounts, OneNodeCallAsksTheSameWhateverRanBefore) {
  const int n = 4;
  const uint32_t slots = 3;
  // Low-latency slots of 64 bytes of payload, the pairs too: every algorithm, both protocols.
  Ring ring(n, slots, 256, /*per_node=*/n, 10s, 1, /*direct=*/true, /*nic=*/false, /*tcp=*/false,
            [](int, GdrLinkConfig& c, GdrLinkOps&) { c.ll_bytes = 128; }, /*pairs=*/true);
  ASSERT_EQ(ring.error(), "");
  const size_t count = 301;  // messages per hop that are no multiple of the slots
  auto send = inputs(n, count), between = inputs(n, 2053);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count)), recv2(n, std::vector<int64_t>(2053));
  for (bool ll : {false, true}) {
    ring.low_latency = ll;
    for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kOneShot, Algo::kTwoShot}) {
      const std::string what = std::string(plan::to_string(algo)) + (ll ? " low-latency" : " bulk");
      auto first = recorded_allreduce(ring, n, count, algo, send, recv);
      expect_words_on_slot_boundaries(ring, n, slots, what);
      // Calls of other lengths on other algorithms in between move the bases on.
      for (Algo other : {Algo::kTree, Algo::kRing, Algo::kTwoShot}) {
        recorded_allreduce(ring, n, 2053, other, between, recv2);
        expect_words_on_slot_boundaries(ring, n, slots, what + " then " + plan::to_string(other));
      }
      auto again = recorded_allreduce(ring, n, count, algo, send, recv);
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(first[size_t(r)].rfind("call 1", 0), 0u) << what << " rank " << r;
        EXPECT_EQ(first[size_t(r)], again[size_t(r)]) << what << ": rank " << r << " asked otherwise the second time";
      }
    }
  }
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
