// The low-latency protocol of the step runner (gpu/step_runner.h) on the CPU: messages to and
// from direct peers travel in their low-latency slots (GdrLink::ll_slot) as lines that carry
// the message's flag beside every 4 bytes, and the receiver reads them as they land instead of
// waiting for `arrived`; hops over TCP stay bulk in the same call (the hops through a NIC
// take the protocol too: gdr_link_ll_nic_test.cc). The host stream
// (gdr_link_world.h) writes and reads the lines in the kernels' format. Every collective
// exact on the ring, the trees, one-shot and two-shot at 1x2 .. 1x8, in place too, with bulk
// calls between low-latency ones on the same slots; the bytes are the bulk protocol's; no
// low-latency receive waits for `arrived`.
#include "gdr_link_ll_watch.h"
#include "gdr_link_world.h"
#include "gpu/plan/schedule.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using namespace gdr_link_world;
using namespace gdr_link_ll_watch;
using plan::Algo;


// One node of n direct peers, with the pairs (one-shot, two-shot) and low-latency slots.
Ring ll_node(int n) {
  return Ring(n, 2, 256, /*per_node=*/n, 10s, 1, /*direct=*/true, /*nic=*/false, /*tcp=*/false, with_ll(kLlBytes),
              /*pairs=*/true);
}

class LowLatencySteps : public ::testing::TestWithParam<int> {};

// Allreduce on the ring, the trees, one-shot and two-shot at counts 1, 7, 2053, low-latency,
// then the same bulk on the same slots, then low-latency again: exact every time. Low-latency
// calls read every payload from low-latency slots and never wait for `arrived`.
TEST_P(LowLatencySteps, AllreduceExactOnEveryAlgorithmBetweenBulkCalls) {
  const int n = GetParam();
  Ring ring = ll_node(n);
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < n; ++r) ASSERT_EQ(ring.link(r).ll_payload_bytes(), kLlBytes / 2);
  Seen seen;
  watch(ring, &seen);
  for (bool ll : {true, false, true}) {
    ring.low_latency = ll;
    for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kOneShot, Algo::kTwoShot}) {
      for (size_t count : {size_t(1), size_t(7), size_t(2053)}) {
        seen.clear();
        expect_allreduce(ring, n, count, algo);
        if (ll) {
          EXPECT_EQ(seen.arrival_waits.load(), 0) << plan::to_string(algo) << " count " << count;
          EXPECT_GT(seen.ll_operands.load(), 0) << plan::to_string(algo) << " count " << count;
        } else {
          EXPECT_GT(seen.arrival_waits.load(), 0) << plan::to_string(algo) << " count " << count;
          EXPECT_EQ(seen.ll_operands.load(), 0) << plan::to_string(algo) << " count " << count;
        }
      }
    }
  }
}

// The step kernel fences before a step's signals only where a peer reads what the step stored
// by that signal (StepStream::order_signals): every bulk step that sends (its message is plain
// memory); no step of a low-latency call, out of place or in place (its messages are lines,
// read by their flags, and its reads are done before its signals; a fold in place writes the
// own operand in one pass, never a receive slot, which the peer overwrites after `consumed`).
TEST_P(LowLatencySteps, SignalsOrderedAfterStoresOnlyWhereAPeerReadsThem) {
  const int n = GetParam();
  Ring ring = ll_node(n);
  ASSERT_EQ(ring.error(), "");
  Seen seen;
  watch(ring, &seen);
  for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kOneShot, Algo::kTwoShot}) {
    const std::string what = plan::to_string(algo);
    ring.low_latency = false;
    seen.clear();
    expect_allreduce(ring, n, 2053, algo);
    EXPECT_GT(seen.sending_steps.load(), 0) << what;
    EXPECT_EQ(seen.unordered_sends.load(), 0) << what << ": a bulk message signalled before its stores";
    ring.low_latency = true;
    seen.clear();
    expect_allreduce(ring, n, 2053, algo);
    EXPECT_GT(seen.sending_steps.load(), 0) << what;
    EXPECT_EQ(seen.ordered_steps.load(), 0) << what << ": a low-latency call out of place fenced";
    // In place: the folds of the own operand third or later (one-shot and two-shot above 2
    // ranks) write it in one pass, with no partial fold in a receive slot to fence.
    seen.clear();
    auto buf = inputs(n, 515);
    auto st = ring.collective(CollectiveKind::kAllreduce, {515}, 0, buf, buf, algo);
    for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << what << " rank " << r << ": " << st[r].to_string();
    EXPECT_EQ(seen.ordered_steps.load(), 0) << what << " in place";
  }
}

// In place (one-shot and two-shot fold the own operand third or later, here with low-latency
// payloads, and write it in one pass), and the other collectives, low-latency.
TEST_P(LowLatencySteps, InPlaceAndEveryCollectiveExact) {
  const int n = GetParam();
  Ring ring = ll_node(n);
  ASSERT_EQ(ring.error(), "");
  ring.low_latency = true;
  for (Algo algo : {Algo::kOneShot, Algo::kTwoShot, Algo::kRing, Algo::kTree}) {
    for (size_t count : {size_t(7), size_t(515)}) expect_allreduce_in_place(ring, n, count, algo);
  }
  expect_reduce_scatter(ring, n, 33, Algo::kRing);
  expect_reduce_scatter(ring, n, 33, Algo::kOneShot);
  expect_all_gather_and_broadcast(ring, n, Algo::kRing);
  expect_all_gather_and_broadcast(ring, n, Algo::kTwoShot, Algo::kOneShot);
}

// The same bytes as the bulk protocol: low-latency messages are shorter, not more.
TEST_P(LowLatencySteps, BytesAreTheBulkProtocols) {
  const int n = GetParam();
  Ring ring = ll_node(n);
  ASSERT_EQ(ring.error(), "");
  for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kOneShot}) {
    std::vector<uint64_t> sent[2];
    for (bool ll : {false, true}) {
      ring.low_latency = ll;
      std::vector<uint64_t> before(static_cast<size_t>(n), 0);
      for (int r = 0; r < n; ++r) before[size_t(r)] = ring.bytes_sent(r);
      expect_allreduce(ring, n, 2053, algo);
      for (int r = 0; r < n; ++r) sent[ll].push_back(ring.bytes_sent(r) - before[size_t(r)]);
    }
    EXPECT_EQ(sent[0], sent[1]) << plan::to_string(algo);
    if (algo == Algo::kRing) {
      // 2 (n-1)/n S per rank, S = 2053 x 8 bytes (the ring's segments split at element bounds).
      const double want = 2.0 * (n - 1) / n * 2053 * 8;
      for (int r = 0; r < n; ++r) EXPECT_NEAR(double(sent[1][size_t(r)]), want, 2.0 * 8 * n) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Nodes, LowLatencySteps, ::testing::Values(2, 3, 4, 8),
                         [](const auto& info) { return "x1_" + std::to_string(info.param); });

// Two nodes of two over TCP: the hops inside a node low-latency (direct), the hops between
// nodes bulk (TCP peers have no low-latency slots), in the same calls: exact on the ring and
// the trees. (Through a NIC every hop takes it: gdr_link_ll_nic_test.cc.)
TEST(LowLatencyMixed, DirectHopsLowLatencyTcpHopsBulk) {
  Ring ring(4, 2, 256, /*per_node=*/2, 10s, 1, /*direct=*/true, /*nic=*/false, /*tcp=*/true, with_ll(kLlBytes));
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < 4; ++r) {
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      EXPECT_EQ(ring.link(r).ll_slot(p, true, 0) != nullptr, ring.link(r).peer(p).direct && ring.link(r).peer(p).recv)
          << "rank " << r << " peer " << ring.link(r).peer(p).rank;
    }
  }
  Seen seen;
  watch(ring, &seen);
  ring.low_latency = true;
  for (Algo algo : {Algo::kRing, Algo::kTree}) {
    for (size_t count : {size_t(1), size_t(7), size_t(2053)}) expect_allreduce(ring, 4, count, algo);
  }
  expect_reduce_scatter(ring, 4, 33, Algo::kRing);
  expect_all_gather_and_broadcast(ring, 4, Algo::kRing);
  EXPECT_GT(seen.ll_operands.load(), 0) << "the hops inside a node";
  EXPECT_GT(seen.arrival_waits.load(), 0) << "the hops between nodes";
}

// Without low-latency slots (ll_bytes 0) a low-latency call runs bulk: the runner only takes
// the protocol where both ends have the slots.
TEST(LowLatencyMixed, NoSlotsMeansBulk) {
  Ring ring(3, 2, 256, /*per_node=*/3, 10s, 1, /*direct=*/true, /*nic=*/false);
  ASSERT_EQ(ring.error(), "");
  EXPECT_EQ(ring.link(0).ll_payload_bytes(), 0u);
  EXPECT_EQ(ring.link(0).ll_slot(0, true, 0), nullptr);
  Seen seen;
  watch(ring, &seen);
  ring.low_latency = true;
  expect_allreduce(ring, 3, 2053, Algo::kRing);
  EXPECT_EQ(seen.ll_operands.load(), 0);
}

// Low-latency slots must be whole lines: a link is refused with 100 bytes.
TEST(LowLatencyMixed, SlotsNotWholeLinesAreRefused) {
  Ring ring(2, 2, 256, /*per_node=*/2, 10s, 1, /*direct=*/true, /*nic=*/false, /*tcp=*/false, with_ll(100));
  EXPECT_NE(ring.error().find("not a multiple of 16"), std::string::npos) << ring.error();
}

// The cost model's protocol per size on one node: low-latency for small calls, bulk for large
// ones, on every algorithm; none across nodes unless forced (GRADSYNC_PROTO=ll).
TEST(LowLatencyModel, SmallCallsLowLatencyOnOneNodeOnly) {
  std::vector<std::string> hosts(8, "n0");
  auto one = rdma_channels({0, 1, 2, 3, 4, 5, 6, 7}, hosts, 0, /*direct=*/true, /*pairs=*/true);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  rdma_choose_algos(*one);
  for (Algo a : {Algo::kRing, Algo::kTree, Algo::kOneShot, Algo::kTwoShot}) {
    EXPECT_TRUE(rdma_auto_low_latency(*one, a, 8)) << plan::to_string(a) << ": " << rdma_protocol_summary(*one);
    EXPECT_FALSE(rdma_auto_low_latency(*one, a, size_t(64) << 20)) << plan::to_string(a);
  }
  EXPECT_EQ(rdma_protocol_summary(*one).rfind("low-latency: ring up to ", 0), 0u) << rdma_protocol_summary(*one);
  // At most the sizes measured on the H200 (step_runner.cc): 256 KiB on the ring, 1 MiB on
  // the trees, 64 KiB one-shot and two-shot.
  EXPECT_LE(one->ll_max_bytes[int(Algo::kRing)], size_t(256) << 10);
  EXPECT_LE(one->ll_max_bytes[int(Algo::kTree)], size_t(1) << 20);
  EXPECT_LE(one->ll_max_bytes[int(Algo::kOneShot)], size_t(64) << 10);
  EXPECT_LE(one->ll_max_bytes[int(Algo::kTwoShot)], size_t(64) << 10);
  // Two nodes of four: no rank chooses it, not even ranks 1 and 2, whose own peers (the middle
  // of their node's chain) are all direct: ranks that chose alone would disagree on a call's
  // protocol (on the H200 they hung).
  hosts = {"n0", "n0", "n0", "n0", "n1", "n1", "n1", "n1"};
  for (int r = 0; r < 8; ++r) {
    auto two = rdma_channels({0, 1, 2, 3, 4, 5, 6, 7}, hosts, r, /*direct=*/true);
    ASSERT_TRUE(two.ok());
    rdma_choose_algos(*two);
    EXPECT_FALSE(rdma_auto_low_latency(*two, Algo::kRing, 8)) << "rank " << r;
    EXPECT_FALSE(rdma_auto_low_latency(*two, Algo::kTree, 8)) << "rank " << r;
    EXPECT_EQ(rdma_protocol_summary(*two), "bulk at every size") << "rank " << r;
  }
}

}  // namespace
}  // namespace gradsync
