// The GPU timeline's analysis (runtime/gpu/timeline.h) on hand-made stamps: the unions and
// the hidden fraction, the well-formedness check, the clock-offset bounds between two ranks,
// the packing for the exchange. No GPU: the recording itself is tested by
// tests/gpu/gpu_collectives_test.cc (GpuAllreduce.TimelineOfA64MiBAllreduceIsWellFormed).
#include <gtest/gtest.h>

#include "gpu/timeline.h"

namespace gradsync::gpu {
namespace {

ChunkSteps chunk(uint64_t push0, uint64_t push1, uint64_t ready, uint64_t fold0, uint64_t fold1) {
  return {push0, push0, push1, ready, fold0, fold1};
}

// Two blocks of two chunks each (4 chunks of 1 KiB, 2 slots), `shift` added to every stamp:
//   block 0: push 1000-1100, 1100-1200; fold 1210-1300, 1300-1400
//   block 1: push 1150-1250, 1250-1350; fold 1360-1450, 1450-1550
// U_P = [1000, 1350] (350 ns), U_F = [1210, 1550] (340 ns), both = [1210, 1350] (140 ns).
Timeline sample(int64_t shift = 0, int rank = 0) {
  Timeline t;
  t.rank = rank;
  t.world = 2;
  t.collective = "allreduce";
  t.bytes = 4096;
  t.chunk_bytes = 1024;
  t.slots = 2;
  t.nchunks = 4;
  t.blocks = 2;
  t.blocks_used = 2;
  // Real stamps are ns since the epoch: keep that magnitude (a double holds it to 256 ns).
  constexpr uint64_t kEpoch = 1'700'000'000'000'000'000ull;
  auto s = [&](uint64_t x) { return kEpoch + uint64_t(int64_t(x) + shift); };
  BlockTimeline b0{0, s(1000), s(1400), 10, 2, {}};
  b0.steps = {chunk(s(1000), s(1100), s(1200), s(1210), s(1300)),
              chunk(s(1100), s(1200), s(1300), s(1300), s(1400))};
  BlockTimeline b1{1, s(1000), s(1550), 10, 2, {}};
  b1.steps = {chunk(s(1150), s(1250), s(1350), s(1360), s(1450)),
              chunk(s(1250), s(1350), s(1450), s(1450), s(1550))};
  b1.steps[0].credit_wait = s(1000);  // waited 150 ns for the first credit
  t.block = {b0, b1};
  t.summary = summarize(t);
  return t;
}

TEST(GpuTimeline, UnionsAndHiddenFraction) {
  const TimelineSummary m = sample().summary;
  EXPECT_DOUBLE_EQ(m.push_us, 0.350);
  EXPECT_DOUBLE_EQ(m.fold_us, 0.340);
  EXPECT_DOUBLE_EQ(m.overlap_us, 0.140);
  EXPECT_DOUBLE_EQ(m.hidden, 0.4);
  EXPECT_DOUBLE_EQ(m.exposed_push_us, 0.210);
  EXPECT_DOUBLE_EQ(m.fold_hidden, 140.0 / 340);
  EXPECT_DOUBLE_EQ(m.same_block_overlap_us, 0);
  EXPECT_DOUBLE_EQ(m.wall_us, 0.550);
  EXPECT_DOUBLE_EQ(m.block_push_us, 0.200);       // 400 ns of pushes over 2 blocks
  EXPECT_DOUBLE_EQ(m.block_credit_wait_us, 0.075);  // 150 ns over 2 blocks
  EXPECT_DOUBLE_EQ(m.block_ready_wait_us, 0.010);   // 10 + 10 ns over 2 blocks
  EXPECT_EQ(m.max_chunks_per_block, 2u);
  EXPECT_EQ(m.recorded_chunks, 4u);
  EXPECT_EQ(m.dropped_chunks, 0u);
  EXPECT_EQ(m.granularity_ns, 10u);
}

TEST(GpuTimeline, SameBlockOverlapIsMeasuredNotAssumed) {
  Timeline t = sample();
  t.block[0].steps[0].fold_start -= 60;  // 1150: a fold inside the block's own push of chunk 1
  EXPECT_DOUBLE_EQ(summarize(t).same_block_overlap_us, 0.050);
}

TEST(GpuTimeline, WellFormed) {
  EXPECT_EQ(check_well_formed(sample()), "");
  Timeline t = sample();
  t.block[0].steps[1].push_start = t.block[0].steps[0].push_start + 50;  // before push(0) ended
  EXPECT_NE(check_well_formed(t).find("before"), std::string::npos) << check_well_formed(t);
  t = sample();
  t.block[1].chunks = 3;
  EXPECT_NE(check_well_formed(t).find("expected 2"), std::string::npos) << check_well_formed(t);
  t = sample();
  t.block[1].steps[1].fold_end = 0;
  EXPECT_NE(check_well_formed(t).find("missing"), std::string::npos) << check_well_formed(t);
  t = sample();
  t.nchunks = 5;
  EXPECT_NE(check_well_formed(t), "");
}

TEST(GpuTimeline, ProgramOrder) {
  const std::vector<Step> o = program_order(sample().block[0]);
  ASSERT_EQ(o.size(), 14u);  // start, 2 pushes x 3, 2 consumes x 3, end
  EXPECT_EQ(o[1].kind, Step::kCreditWait);
  EXPECT_EQ(o[4].kind, Step::kCreditWait);
  EXPECT_EQ(o[4].chunk, 1u);  // push(1) comes before consume(0)
  EXPECT_EQ(o[7].kind, Step::kReadyWait);
  EXPECT_EQ(o[7].chunk, 0u);
}

TEST(GpuTimeline, PeerOffsetBoundedByTheHandOffs) {
  // The peer ran the same schedule; its clock reads 5000 ns less than this rank's.
  const Timeline mine = sample(), peer = sample(-5000, 1);
  const PeerOverlap o = overlap_with_peer(mine, peer);
  ASSERT_TRUE(o.ok) << o.why;
  // ready hand-offs: fold_start - push_end is 100 or 110 ns on both sides.
  EXPECT_DOUBLE_EQ(o.offset_lo_ns, 4900);
  EXPECT_DOUBLE_EQ(o.offset_hi_ns, 5100);
  EXPECT_GT(o.constraints, 0);
  EXPECT_DOUBLE_EQ(o.peer_push_us, 0.350);
  // At the true offset the peer's pushes cover rank 0's folds as its own do (0.4); the
  // figure is the range over the offsets allowed: [1210, 1250] / 350 .. [1210, 1450] / 350.
  EXPECT_NEAR(o.hidden_lo, 40.0 / 350, 1e-9);
  EXPECT_NEAR(o.hidden_hi, 240.0 / 350, 1e-9);
  EXPECT_LE(o.hidden_lo, 0.4);
  EXPECT_GE(o.hidden_hi, 0.4);
}

TEST(GpuTimeline, ContradictoryClocksAreRefused) {
  Timeline peer = sample(0, 1);
  // The peer's fold of chunk 0 of block 0 "starts" long before this rank's push ended.
  peer.block[0].steps[0].fold_start -= 710;  // 500
  peer.block[0].steps[0].ready_wait -= 700;
  const PeerOverlap o = overlap_with_peer(sample(), peer);
  EXPECT_FALSE(o.ok);
  EXPECT_NE(o.why.find("contradict"), std::string::npos) << o.why;
}

TEST(GpuTimeline, PackRoundTrip) {
  const Timeline t = sample(123, 1);
  const std::vector<int64_t> w = pack(t);
  auto back = unpack(w.data(), w.size());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(pack(*back), w);
  EXPECT_EQ(back->collective, "allreduce");
  EXPECT_DOUBLE_EQ(back->summary.hidden, 0.4);
  EXPECT_FALSE(unpack(w.data(), 5).ok());
}

TEST(GpuTimeline, Activity) {
  const Activity a = activity(sample(), 11);  // 50 ns bins over [1000, 1550]
  ASSERT_EQ(a.pushing.size(), 11u);
  EXPECT_DOUBLE_EQ(a.pushing[0], 1.0);   // [1000, 1050]: block 0 pushes
  EXPECT_DOUBLE_EQ(a.pushing[3], 2.0);   // [1150, 1200]: both blocks push
  EXPECT_DOUBLE_EQ(a.folding[10], 1.0);  // [1500, 1550]: block 1 folds
  EXPECT_DOUBLE_EQ(a.folding[0], 0.0);
}

}  // namespace
}  // namespace gradsync::gpu
