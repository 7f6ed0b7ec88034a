// The low-latency protocol on queue-pair peers (gpu/gdr_link.h), on the CPU over the emulated
// fabric: a message that fits travels from the sender's low-latency send slot into the
// receiver's low-latency receive slot as lines (one RDMA write with immediate, under the same
// credits as bulk), and the receiver reads the lines by their flags instead of waiting for
// `arrived`. Shapes of nodes of one and two ranks through the NIC (2x1, 3x1, and 2x2 with the
// hops inside a node direct or through the NIC too): every collective exact on the ring and
// the trees (hierarchical where it is planned), in place too, with bulk calls between
// low-latency ones on the same slots; the bytes sent are the bulk protocol's payload bytes;
// the layout of the slots. TCP peers stay bulk.
#include "gdr_link_ll_watch.h"
#include "gdr_link_world.h"
#include "gpu/plan/schedule.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using namespace gdr_link_world;
using namespace gdr_link_ll_watch;
using plan::Algo;

constexpr uint32_t kSlots = 2;
constexpr size_t kSlotBytes = 256;

struct Shape {
  int nodes, per;
  bool direct;  // the hops inside a node by mapped memory; else through the NIC too
};
std::string name(const Shape& s) {
  return std::to_string(s.nodes) + "x" + std::to_string(s.per) + (s.direct ? "_direct" : "_nic");
}

// The shape's ranks through the emulated NIC, low-latency slots on every link, the pairs (for
// hierarchical across nodes of two).
Ring nic_ring(const Shape& s) {
  return Ring(s.nodes * s.per, kSlots, kSlotBytes, s.per, 10s, 1, s.direct, /*nic=*/true, /*tcp=*/false,
              with_ll(kLlBytes), /*pairs=*/true);
}

// The algorithms of an allreduce on these channels: the ring, the trees, and hierarchical
// where the channels have it (nodes of two).
std::vector<Algo> algos(Ring& ring) {
  std::vector<Algo> a = {Algo::kRing, Algo::kTree};
  if (ring.channels(0).hier.size() > 0) a.push_back(Algo::kHierarchical);
  return a;
}

class LowLatencyNic : public ::testing::TestWithParam<Shape> {};

// Every queue-pair peer has low-latency slots in each direction it is used, beside its send
// block and its receive block in the registered region, `slots` of ll_bytes each after the
// block's slots; the region is exactly those blocks.
TEST_P(LowLatencyNic, SlotsBesideEveryQueuePairPeersBlocks) {
  const Shape shape = GetParam();
  Ring ring = nic_ring(shape);
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < shape.nodes * shape.per; ++r) {
    const GdrLink& link = ring.link(r);
    size_t blocks = 0;
    for (int p = 0; p < link.peer_count(); ++p) {
      const GdrPeer& peer = link.peer(p);
      const std::string who = "rank " + std::to_string(r) + " peer " + std::to_string(peer.rank);
      if (peer.direct) continue;
      blocks += size_t(peer.send) + size_t(peer.recv);
      for (bool recv : {false, true}) {
        if (!(recv ? peer.recv : peer.send)) continue;
        for (uint64_t m = 0; m < 2 * kSlots; ++m) {
          uint8_t* ll = link.ll_slot(p, recv, m);
          ASSERT_NE(ll, nullptr) << who;
          // After the block's slots, slot m % slots of its low-latency slots.
          EXPECT_EQ(ll, link.slot(p, recv, 0) + kSlots * kSlotBytes + (m % kSlots) * kLlBytes) << who << " m " << m;
        }
      }
    }
    EXPECT_EQ(link.region_bytes(), blocks * kSlots * (kSlotBytes + kLlBytes)) << "rank " << r;
  }
}

// Allreduce at counts 1, 7, 2053, low-latency, then bulk on the same slots, then low-latency
// again: exact every time. Low-latency calls read every payload from low-latency slots and
// never wait for `arrived` (the worker still publishes it); bulk calls always do.
TEST_P(LowLatencyNic, AllreduceExactBetweenBulkCallsWithoutWaitingForArrivals) {
  const Shape shape = GetParam();
  const int n = shape.nodes * shape.per;
  Ring ring = nic_ring(shape);
  ASSERT_EQ(ring.error(), "");
  Seen seen;
  watch(ring, &seen);
  for (bool ll : {true, false, true}) {
    ring.low_latency = ll;
    for (Algo algo : algos(ring)) {
      for (size_t count : {size_t(1), size_t(7), size_t(2053)}) {
        const std::string what = std::string(ll ? "ll " : "bulk ") + plan::to_string(algo) + " count " +
                                 std::to_string(count);
        seen.clear();
        expect_allreduce(ring, n, count, algo);
        if (ll) {
          EXPECT_EQ(seen.arrival_waits.load(), 0) << what;
          EXPECT_GT(seen.ll_operands.load(), 0) << what;
        } else {
          EXPECT_GT(seen.arrival_waits.load(), 0) << what;
          EXPECT_EQ(seen.ll_operands.load(), 0) << what;
        }
      }
    }
  }
}

// In place, and the other collectives, low-latency through the NIC.
TEST_P(LowLatencyNic, InPlaceAndEveryCollectiveExact) {
  const Shape shape = GetParam();
  const int n = shape.nodes * shape.per;
  Ring ring = nic_ring(shape);
  ASSERT_EQ(ring.error(), "");
  Seen seen;
  watch(ring, &seen);
  ring.low_latency = true;
  for (Algo algo : algos(ring)) {
    for (size_t count : {size_t(7), size_t(515)}) expect_allreduce_in_place(ring, n, count, algo);
  }
  expect_reduce_scatter(ring, n, 33, Algo::kRing);
  expect_all_gather_and_broadcast(ring, n, Algo::kRing);
  EXPECT_EQ(seen.arrival_waits.load(), 0);
}

// The same payload bytes, per rank, as the bulk protocol with messages of the same size
// (slots of a low-latency slot's payload: the trees split a call by its messages, so bulk with
// larger messages moves the same total but shares it otherwise between the ranks):
// GdrLink::bytes_sent counts a low-latency message's payload, not its lines' flags.
TEST_P(LowLatencyNic, BytesAreTheBulkProtocols) {
  const Shape shape = GetParam();
  const int n = shape.nodes * shape.per;
  Ring ring = nic_ring(shape);
  Ring bulk(n, kSlots, kLlBytes / 2, shape.per, 10s, 1, shape.direct, /*nic=*/true, /*tcp=*/false, {},
            /*pairs=*/true);
  ASSERT_EQ(ring.error(), "");
  ASSERT_EQ(bulk.error(), "");
  ring.low_latency = true;
  for (Algo algo : algos(ring)) {
    std::vector<uint64_t> sent[2];
    for (Ring* x : {&bulk, &ring}) {
      std::vector<uint64_t> before(static_cast<size_t>(n), 0);
      for (int r = 0; r < n; ++r) before[size_t(r)] = x->bytes_sent(r);
      expect_allreduce(*x, n, 2053, algo);
      for (int r = 0; r < n; ++r) sent[x == &ring].push_back(x->bytes_sent(r) - before[size_t(r)]);
    }
    EXPECT_EQ(sent[0], sent[1]) << plan::to_string(algo);
    if (algo == Algo::kRing && !shape.direct) {
      // 2 (n-1)/n S per rank, S = 2053 x 8 bytes (the ring's segments split at element bounds).
      const double want = 2.0 * (n - 1) / n * 2053 * 8;
      for (int r = 0; r < n; ++r) EXPECT_NEAR(double(sent[1][size_t(r)]), want, 2.0 * 8 * n) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LowLatencyNic,
                         ::testing::Values(Shape{2, 1, false}, Shape{3, 1, false}, Shape{2, 2, true},
                                           Shape{2, 2, false}),
                         [](const auto& info) { return name(info.param); });

// A step that writes low-latency lines for a queue-pair peer orders its `ready` after them
// (the NIC reads our send slot once the worker sees it): with every hop through the NIC, no
// step that sends leaves its signals unordered (a direct peer's lines need no order, so the
// shapes with direct hops are left out).
TEST(LowLatencyNicOrder, SignalsOrderedAfterLinesTheNicReads) {
  for (const Shape& shape : {Shape{2, 1, false}, Shape{3, 1, false}, Shape{2, 2, false}}) {
    Ring ring = nic_ring(shape);
    ASSERT_EQ(ring.error(), "") << name(shape);
    Seen seen;
    watch(ring, &seen);
    ring.low_latency = true;
    for (Algo algo : algos(ring)) {
      const std::string what = name(shape) + " " + plan::to_string(algo);
      seen.clear();
      expect_allreduce(ring, shape.nodes * shape.per, 2053, algo);
      EXPECT_GT(seen.sending_steps.load(), 0) << what;
      EXPECT_GT(seen.ll_operands.load(), 0) << what;
      EXPECT_EQ(seen.unordered_sends.load(), 0) << what << ": lines signalled before their stores";
    }
  }
}

// The receiving worker checks a low-latency message's length as its lines' (16 bytes for
// each 8 of payload) against its plan: planned low-latency, it lands and is published
// (`arrived`); planned bulk at the receiver, it fails the link naming the sender.
TEST(LowLatencyNicCheck, ReceiverChecksTheLinesLength) {
  for (bool agree : {true, false}) {
    Ring ring(2, kSlots, kSlotBytes, /*per_node=*/1, 2s, 1, /*direct=*/false, /*nic=*/true, /*tcp=*/false,
              with_ll(kLlBytes));
    ASSERT_EQ(ring.error(), "");
    GdrLink& a = ring.link(0);
    GdrLink& b = ring.link(1);
    const int to_b = a.peer_index(1), from_a = b.peer_index(0);
    b.plan({{from_a, false, 8, agree}});
    a.plan({{to_b, true, 8, true}});
    std::memset(a.ll_slot(to_b, false, 0), 0, 16);
    store(a.stream_words(to_b).ready, 1);
    const auto deadline = Clock::now() + 5s;
    while (Clock::now() < deadline && load(b.stream_words(from_a).arrived) == 0 && b.error().ok()) {
      std::this_thread::sleep_for(1ms);
    }
    if (agree) {
      EXPECT_EQ(load(b.stream_words(from_a).arrived), 1u);
      EXPECT_TRUE(b.error().ok()) << b.error().to_string();
      EXPECT_EQ(a.bytes_sent(to_b), 8u) << "payload bytes, not the line's";
      store(b.stream_words(from_a).consumed, 1);
    } else {
      EXPECT_EQ(load(b.stream_words(from_a).arrived), 0u);
      EXPECT_NE(b.error().message().find("message 0 from rank 0 (host n0) has 16 bytes; this rank expected 8"),
                std::string::npos)
          << b.error().to_string();
    }
  }
}

// Without ll_queue_pairs (the GPU communicator's links unless GRADSYNC_PROTO=ll forces the
// protocol) queue-pair peers get no low-latency slots: the region holds the bulk blocks alone,
// and a low-latency call's hops through the NIC run bulk (the receiver waits for `arrived`),
// exact, while the direct hops inside a node still take their low-latency slots.
TEST(LowLatencyNicOff, QueuePairPeersHaveNoSlotsUnlessAsked) {
  Ring ring(4, kSlots, kSlotBytes, /*per_node=*/2, 10s, 1, /*direct=*/true, /*nic=*/true, /*tcp=*/false,
            [](int, GdrLinkConfig& c, GdrLinkOps&) { c.ll_bytes = kLlBytes; });
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < 4; ++r) {
    const GdrLink& link = ring.link(r);
    size_t blocks = 0;
    for (int p = 0; p < link.peer_count(); ++p) {
      const GdrPeer& peer = link.peer(p);
      if (peer.direct) {
        if (peer.recv) EXPECT_NE(link.ll_slot(p, true, 0), nullptr) << "rank " << r;
        continue;
      }
      blocks += size_t(peer.send) + size_t(peer.recv);
      EXPECT_EQ(link.ll_slot(p, false, 0), nullptr) << "rank " << r;
      EXPECT_EQ(link.ll_slot(p, true, 0), nullptr) << "rank " << r;
    }
    EXPECT_EQ(link.region_bytes(), blocks * kSlots * kSlotBytes) << "rank " << r;
  }
  Seen seen;
  watch(ring, &seen);
  ring.low_latency = true;
  for (Algo algo : {Algo::kRing, Algo::kTree}) {
    for (size_t count : {size_t(1), size_t(2053)}) expect_allreduce(ring, 4, count, algo);
  }
  EXPECT_GT(seen.arrival_waits.load(), 0) << "the NIC hops wait for arrivals";
  EXPECT_GT(seen.ll_operands.load(), 0) << "the direct hops still go low-latency";
}

// TCP peers have no low-latency slots: their messages stay bulk (the receiver waits for
// `arrived`) in a low-latency call, exact; nodes of one rank take no low-latency slot at all.
TEST(LowLatencyTcp, TcpPeersStayBulk) {
  Ring ring(3, kSlots, kSlotBytes, /*per_node=*/1, 10s, 1, /*direct=*/false, /*nic=*/false, /*tcp=*/true,
            with_ll(kLlBytes));
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < 3; ++r) {
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      EXPECT_TRUE(ring.link(r).peer(p).tcp);
      EXPECT_EQ(ring.link(r).ll_slot(p, false, 0), nullptr) << "rank " << r;
      EXPECT_EQ(ring.link(r).ll_slot(p, true, 0), nullptr) << "rank " << r;
    }
  }
  Seen seen;
  watch(ring, &seen);
  ring.low_latency = true;
  for (Algo algo : {Algo::kRing, Algo::kTree}) {
    for (size_t count : {size_t(1), size_t(2053)}) expect_allreduce(ring, 3, count, algo);
  }
  expect_all_gather_and_broadcast(ring, 3, Algo::kRing);
  EXPECT_EQ(seen.ll_operands.load(), 0);
  EXPECT_GT(seen.arrival_waits.load(), 0);
}

}  // namespace
}  // namespace gradsync
