// The GPU step stream's tables (gpu/kernel_stream.h) without a GPU: which steps get a barrier,
// and how a call of many steps is split into launches. The launcher records the tables.
#include "gpu/kernel_stream.h"

#include <gtest/gtest.h>

#include <memory>

#include "gpu/step_table_cache.h"

#include <vector>

namespace gradsync {
namespace {

struct Recorder {
  std::vector<kernels::StepTable> tables;
  KernelStream::Launch launch() {
    return [this](const kernels::StepTable& t) {
      tables.push_back(t);
      return cudaSuccess;
    };
  }
  // Every step's barrier flag, table after table.
  std::vector<int> barriers() const {
    std::vector<int> b;
    for (const auto& t : tables)
      for (int k = 0; k < t.nsteps; ++k) b.push_back(int(t.steps[k].barrier));
    return b;
  }
};

// Buffers that are never dereferenced (the launcher only records).
alignas(16) float in[4096], out[4096], slot_a[1024], slot_b[1024];

// One step of one copy of `count` floats.
void copy_step(KernelStream& ks, void* dst, const void* src, size_t count) {
  ASSERT_TRUE(ks.begin_step().ok());
  ASSERT_TRUE(ks.copy(dst, src, count * 4).ok());
  ASSERT_TRUE(ks.end_step().ok());
}

TEST(KernelStream, DisjointChunksOfAnOutOfPlaceRingNeedNoBarrier) {
  KernelStreamWords w;
  Recorder rec;
  KernelStream ks(w, nullptr, DataType::kFloat32, ReduceOp::kSum, 1, rec.launch());
  // A reduce-scatter then all-gather over 4 chunks of 256: each step reads its own input chunk
  // and a slot, writes a slot or an output chunk; the slots are the same range every time.
  for (int c = 0; c < 4; ++c) {
    ASSERT_TRUE(ks.begin_step().ok());
    const StepBuf x[] = {slot_a, in + 256 * c};
    ASSERT_TRUE(ks.fold(slot_b, {}, x, 2, 256, false).ok());
    ASSERT_TRUE(ks.end_step().ok());
  }
  for (int c = 0; c < 4; ++c) {
    ASSERT_TRUE(ks.begin_step().ok());
    ASSERT_TRUE(ks.copy(out + 256 * c, slot_a, 256 * 4).ok());
    ASSERT_TRUE(ks.copy(slot_b, slot_a, 256 * 4).ok());
    ASSERT_TRUE(ks.end_step().ok());
  }
  ASSERT_TRUE(ks.end_call().ok());
  ASSERT_EQ(rec.tables.size(), 1u);
  EXPECT_EQ(rec.tables[0].nsteps, 8);
  EXPECT_EQ(rec.barriers(), std::vector<int>(8, 0));
  EXPECT_EQ(ks.launches(), 1);
}

// A step whose signals the runner orders after its stores is marked `release` in the table
// (the kernel fences before its signals); only that step, and the mark does not leak into the next.
TEST(KernelStream, OrderedSignalsMarkTheirStepOnly) {
  KernelStreamWords w;
  Recorder rec;
  KernelStream ks(w, nullptr, DataType::kFloat32, ReduceOp::kSum, 1, rec.launch());
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(ks.begin_step().ok());
    ASSERT_TRUE(ks.copy(slot_b, in + 256 * k, 256 * 4).ok());
    if (k == 1) ks.order_signals();
    ASSERT_TRUE(ks.end_step().ok());
  }
  ASSERT_TRUE(ks.end_call().ok());
  ASSERT_EQ(rec.tables.size(), 1u);
  ASSERT_EQ(rec.tables[0].nsteps, 3);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(rec.tables[0].steps[k].release, k == 1 ? 1 : 0) << "step " << k;
}

TEST(KernelStream, ARangeTouchedThroughAnotherPartitionGetsABarrier) {
  KernelStreamWords w;
  Recorder rec;
  KernelStream ks(w, nullptr, DataType::kFloat32, ReduceOp::kSum, 1, rec.launch());
  auto one = [&](void* dst, const void* src, size_t count) { copy_step(ks, dst, src, count); };
  one(out, slot_a, 512);        // 0: writes out[0, 512)
  one(slot_b, out, 512);        // 1: reads the same range at the same length: the same blocks
  one(slot_b, out + 256, 256);  // 2: reads half of it through another split: a barrier
  one(out + 1024, slot_a, 256); // 3: untouched memory
  one(in, slot_a, 100);         // 4: writes in[0, 100)
  one(slot_b, in + 50, 100);    // 5: reads in[50, 150): overlaps step 4's write, a barrier
  one(slot_b, in + 50, 100);    // 6: reads what 5 read (reads never conflict)
  ASSERT_TRUE(ks.end_call().ok());
  EXPECT_EQ(rec.barriers(), (std::vector<int>{0, 0, 1, 0, 0, 1, 0}));
}

TEST(KernelStream, AWriteOverWhatAnEarlierStepReadGetsABarrier) {
  KernelStreamWords w;
  Recorder rec;
  KernelStream ks(w, nullptr, DataType::kFloat32, ReduceOp::kSum, 1, rec.launch());
  // In place: step 0 folds in[0, 512) into a slot; step 1 overwrites in[256, 512) (another
  // split) while a slower block of step 0 may still read it.
  ASSERT_TRUE(ks.begin_step().ok());
  const StepBuf x[] = {slot_a, in};
  ASSERT_TRUE(ks.fold(slot_b, {}, x, 2, 512, false).ok());
  ASSERT_TRUE(ks.end_step().ok());
  ASSERT_TRUE(ks.begin_step().ok());
  ASSERT_TRUE(ks.copy(in + 256, slot_a, 256 * 4).ok());
  ASSERT_TRUE(ks.end_step().ok());
  ASSERT_TRUE(ks.end_call().ok());
  EXPECT_EQ(rec.barriers(), (std::vector<int>{0, 1}));
}

// A fold of k operands is one run of k - 1 operations: the first reduces x0 and x1, each
// following one is chained with the next operand in b, and only the last stores (dst, dst2,
// kReduceFinal when final). In place (dst = x2) too, with each operand's flag and base.
TEST(KernelStream, AFoldIsOneRunOfChainedOperations) {
  KernelStreamWords w;
  uint64_t bases[kernels::kStepMaxBases] = {};
  w.bases = bases;
  Recorder rec;
  KernelStream ks(w, nullptr, DataType::kFloat32, ReduceOp::kAvg, 4, rec.launch());
  ASSERT_TRUE(ks.begin_call(true).ok());
  alignas(16) static float slots[4][256];
  StepBuf x[5] = {StepBuf(slots[0], 7, 3), StepBuf(slots[1]), in, StepBuf(slots[2], 9, 5), StepBuf(slots[3])};
  x[0].base = step_base(1, true);
  x[3].base = step_base(2, true);
  ASSERT_TRUE(ks.begin_step().ok());
  ASSERT_TRUE(ks.fold(in, out, x, 5, 100, true).ok());  // in place: dst is x[2]
  ASSERT_TRUE(ks.end_step().ok());
  ASSERT_TRUE(ks.begin_step().ok());
  ASSERT_TRUE(ks.fold(out + 512, out + 1024, x + 1, 3, 100, false).ok());
  ASSERT_TRUE(ks.end_step().ok());
  ASSERT_TRUE(ks.end_call().ok());
  ASSERT_EQ(rec.tables.size(), 1u);
  const kernels::StepTable& t = rec.tables[0];
  ASSERT_EQ(t.nsteps, 2);
  ASSERT_EQ(t.steps[0].nops, 4);
  ASSERT_EQ(t.steps[1].nops, 2);
  EXPECT_EQ(t.steps[0].count, 100u);
  const kernels::StepOp* o = &t.ops[t.steps[0].op];
  // The first: (x0, x1), stores nothing.
  EXPECT_EQ(o[0].chain, 0);
  EXPECT_EQ(o[0].kind, kernels::StepOpKind::kReduce);
  EXPECT_EQ(o[0].a, slots[0]);
  EXPECT_EQ(o[0].a_flag, 7u);
  EXPECT_EQ(o[0].a_base, step_base(1, true));
  EXPECT_EQ(o[0].a_peer, 3);
  EXPECT_EQ(o[0].b, slots[1]);
  EXPECT_EQ(o[0].b_flag, 0u);
  // Then x2, x3, x4 chained in b; only the last stores, final.
  const void* chained[] = {in, slots[2], slots[3]};
  for (int j = 1; j < 4; ++j) {
    EXPECT_EQ(o[j].chain, 1) << j;
    EXPECT_EQ(o[j].a, nullptr) << j;
    EXPECT_EQ(o[j].b, chained[j - 1]) << j;
    EXPECT_EQ(o[j].kind, j == 3 ? kernels::StepOpKind::kReduceFinal : kernels::StepOpKind::kReduce) << j;
    EXPECT_EQ(o[j].dst, j == 3 ? static_cast<void*>(in) : nullptr) << j;
    EXPECT_EQ(o[j].dst2, j == 3 ? static_cast<void*>(out) : nullptr) << j;
  }
  for (int j = 0; j < 3; ++j) EXPECT_EQ(o[j].dst, nullptr) << j;
  EXPECT_EQ(o[2].b_flag, 9u);
  EXPECT_EQ(o[2].b_base, step_base(2, true));
  EXPECT_EQ(o[2].b_peer, 5);
  // Not final: every operation kReduce, the last stores dst and dst2.
  const kernels::StepOp* p = &t.ops[t.steps[1].op];
  EXPECT_EQ(p[0].chain, 0);
  EXPECT_EQ(p[0].a, slots[1]);
  EXPECT_EQ(p[0].b, in);
  EXPECT_EQ(p[0].dst, nullptr);
  EXPECT_EQ(p[1].chain, 1);
  EXPECT_EQ(p[1].b, slots[2]);
  EXPECT_EQ(p[1].kind, kernels::StepOpKind::kReduce);
  EXPECT_EQ(p[1].dst, static_cast<void*>(out + 512));
  EXPECT_EQ(p[1].dst2, static_cast<void*>(out + 1024));
  EXPECT_EQ(p[0].dst2, nullptr);
  // A fold of one operand, or of more than a run takes, is refused.
  ASSERT_TRUE(ks.begin_step().ok());
  EXPECT_FALSE(ks.fold(out, {}, x, 1, 100, false).ok());
  StepBuf nine[9] = {in, in, in, in, in, in, in, in, in};
  EXPECT_FALSE(ks.fold(out, {}, nine, 9, 100, false).ok());
}

// launch_steps refuses (before any CUDA call: no GPU needed) a chained operation that
// continues no reduction of its step, a run of more than 8 operands, and a run whose
// operations before its last store or whose last does not.
TEST(KernelStream, LaunchStepsRefusesBrokenRuns) {
  uint32_t counters[kernels::kStepCounterWords] = {}, abort_word = 0;
  kernels::NodeError err{};
  auto table = [&](int nops) {
    auto t = std::make_unique<kernels::StepTable>();
    t->counters = counters;
    t->error = &err;
    t->abort = &abort_word;
    t->nsteps = 1;
    t->nops = nops;
    t->steps[0].count = 16;
    t->steps[0].nops = uint16_t(nops);
    for (int i = 0; i < nops; ++i) {
      kernels::StepOp& o = t->ops[i];
      o.kind = kernels::StepOpKind::kReduce;
      o.chain = i > 0 ? 1 : 0;
      o.a = i == 0 ? slot_a : nullptr;
      o.b = in + 16 * i;
      o.dst = i + 1 == nops ? out : nullptr;
    }
    t->ops[0].run = uint8_t(nops);  // one run (plain memory: lines stays 0)
    return t;
  };
  auto launch = [](const kernels::StepTable& t) { return kernels::launch_steps(t, DataType::kFloat32, ReduceOp::kSum, nullptr); };
  // Without a device, a valid run of 8 operands passes the checks and fails at the launch
  // (with one it would run on these host buffers: not tried).
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    auto eight = table(7);
    const cudaError_t e = launch(*eight);
    EXPECT_NE(e, cudaErrorInvalidValue);
    EXPECT_NE(e, cudaSuccess);
    (void)cudaGetLastError();
  }
  auto nine = table(8);  // 9 operands
  EXPECT_EQ(launch(*nine), cudaErrorInvalidValue);
  auto first_chained = table(2);
  first_chained->ops[0].chain = 1;  // continues nothing: the step's first operation
  EXPECT_EQ(launch(*first_chained), cudaErrorInvalidValue);
  auto after_copy = table(3);
  after_copy->ops[0].kind = kernels::StepOpKind::kCopy;  // a copy is no reduction to continue
  after_copy->ops[0].dst = out + 512;
  EXPECT_EQ(launch(*after_copy), cudaErrorInvalidValue);
  auto across = table(3);  // the chained operation is the next step's first
  across->nsteps = 2;
  across->steps[0].nops = 2;
  across->ops[1].dst = out;
  across->steps[1] = across->steps[0];
  across->steps[1].op = 2;
  across->steps[1].nops = 1;
  EXPECT_EQ(launch(*across), cudaErrorInvalidValue);
  auto stores_early = table(3);
  stores_early->ops[1].dst = out + 1024;  // a partial fold stored
  EXPECT_EQ(launch(*stores_early), cudaErrorInvalidValue);
  auto final_early = table(3);
  final_early->ops[0].kind = kernels::StepOpKind::kReduceFinal;
  EXPECT_EQ(launch(*final_early), cudaErrorInvalidValue);
  auto no_dst = table(3);
  no_dst->ops[2].dst = nullptr;
  EXPECT_EQ(launch(*no_dst), cudaErrorInvalidValue);
  auto no_source = table(3);
  no_source->ops[1].b = nullptr;
  EXPECT_EQ(launch(*no_source), cudaErrorInvalidValue);
}

// The stream finds each step's runs once (StepOp::run, TableStep::lines): low-latency copies
// of one source are one run, a fold is one, a plain copy is one of its own; the launch refuses
// a table whose runs are not the ones step_run_end finds.
TEST(KernelStream, TheStreamFindsTheRunsAndTheLaunchChecksThem) {
  alignas(16) static uint8_t peer_slot[3][4096], my_slot[4096];
  KernelStreamWords w;
  Recorder rec;
  KernelStream ks(w, nullptr, DataType::kFloat32, ReduceOp::kSum, 1, rec.launch());
  ASSERT_TRUE(ks.begin_step().ok());  // one-shot's sends: one run of 3
  for (int p = 0; p < 3; ++p) ASSERT_TRUE(ks.copy(StepBuf(peer_slot[p], 1, p), StepBuf(in), 64 * 4).ok());
  ASSERT_TRUE(ks.end_step().ok());
  ASSERT_TRUE(ks.begin_step().ok());  // a fold of 3 (a run of 2), then a plain copy
  const StepBuf x[] = {StepBuf(in), StepBuf(my_slot, 1, 0), StepBuf(in + 64)};
  ASSERT_TRUE(ks.fold(StepBuf(out), {}, x, 3, 64, true).ok());
  ASSERT_TRUE(ks.copy(StepBuf(out + 1024), StepBuf(in + 2048), 64 * 4).ok());
  ASSERT_TRUE(ks.end_step().ok());
  ASSERT_TRUE(ks.end_call().ok());
  ASSERT_EQ(rec.tables.size(), 1u);
  kernels::StepTable& t = rec.tables[0];
  ASSERT_EQ(t.nops, 6);
  EXPECT_EQ(t.ops[0].run, 3);
  EXPECT_EQ(t.steps[0].lines, 1);
  EXPECT_EQ(t.ops[3].run, 2);
  EXPECT_EQ(t.ops[5].run, 1);
  EXPECT_EQ(t.steps[1].lines, 0) << "the plain copy is a run without a low-latency operand";

  uint32_t counters[kernels::kStepCounterWords] = {}, abort_word = 0;
  kernels::NodeError err{};
  t.counters = counters;
  t.error = &err;
  t.abort = &abort_word;
  auto refused = [&](auto&& edit) {
    auto u = std::make_unique<kernels::StepTable>(t);
    edit(*u);
    return kernels::launch_steps(*u, DataType::kFloat32, ReduceOp::kSum, nullptr) == cudaErrorInvalidValue;
  };
  EXPECT_TRUE(refused([](kernels::StepTable& u) { u.ops[0].run = 2; })) << "a run cut short";
  EXPECT_TRUE(refused([](kernels::StepTable& u) { u.ops[0].run = 0; })) << "no run";
  EXPECT_TRUE(refused([](kernels::StepTable& u) { u.steps[1].lines = 1; })) << "lines claimed";
  EXPECT_TRUE(refused([](kernels::StepTable& u) { u.steps[0].lines = 0; })) << "lines not claimed";
}

// Every operand of a fold's run counts for the barrier: a chained operand (the third) that an
// earlier step wrote through another partition gives the step a barrier, as does a run whose
// destination (in its last operation) overwrites what an earlier step read through another.
TEST(KernelStream, EveryOperandOfAFoldCountsForTheBarrier) {
  KernelStreamWords w;
  Recorder rec;
  KernelStream ks(w, nullptr, DataType::kFloat32, ReduceOp::kSum, 1, rec.launch());
  auto copy = [&](void* dst, const void* src, size_t count) { copy_step(ks, dst, src, count); };
  auto fold = [&](void* dst, std::vector<StepBuf> x, size_t count) {
    ASSERT_TRUE(ks.begin_step().ok());
    ASSERT_TRUE(ks.fold(dst, {}, x.data(), int(x.size()), count, false).ok());
    ASSERT_TRUE(ks.end_step().ok());
  };
  copy(out, slot_a, 512);                             // 0: writes out[0, 512)
  fold(slot_b, {slot_a, in, out + 256}, 256);         // 1: reads out[256, 512), the third operand: a barrier
  fold(in + 1024, {slot_a, in + 512, in + 768}, 256); // 2: untouched memory
  copy(out + 2048, in + 2048, 512);                   // 3: reads in[2048, 2560)
  fold(in + 2304, {slot_a, out + 1024, slot_b}, 256); // 4: overwrites in[2304, 2560), the run's dst: a barrier
  ASSERT_TRUE(ks.end_call().ok());
  EXPECT_EQ(rec.barriers(), (std::vector<int>{0, 1, 0, 0, 1}));
}

TEST(KernelStream, ACallOfManyStepsTakesSeveralTablesInOrder) {
  KernelStreamWords w;
  Recorder rec;
  KernelStream ks(w, nullptr, DataType::kFloat32, ReduceOp::kSum, 1, rec.launch());
  const int steps = kernels::kTableMaxSteps * 2 + 5;
  for (int k = 0; k < steps; ++k) {
    ASSERT_TRUE(ks.begin_step().ok());
    ASSERT_TRUE(ks.copy(out + k, slot_a, 4).ok());  // one element each, every one a new range
    ASSERT_TRUE(ks.end_step().ok());
  }
  EXPECT_EQ(rec.tables.size(), 2u);  // two full tables so far; the rest waits for end_call
  ASSERT_TRUE(ks.end_call().ok());
  ASSERT_EQ(rec.tables.size(), 3u);
  EXPECT_EQ(ks.launches(), 3);
  int k = 0;
  for (const auto& t : rec.tables) {
    EXPECT_EQ(t.divisor, 1);
    for (int i = 0; i < t.nsteps; ++i, ++k) {
      const kernels::TableStep& st = t.steps[i];
      ASSERT_EQ(st.nops, 1);
      EXPECT_EQ(t.ops[st.op].dst, out + k) << "step " << k;
      EXPECT_EQ(st.barrier, 0u);
    }
  }
  EXPECT_EQ(k, steps);
  ASSERT_TRUE(ks.end_call().ok());  // nothing left: no empty launch
  EXPECT_EQ(ks.launches(), 3);
}

TEST(KernelStream, OperationsOfDifferentLengthsInOneStepAreRefused) {
  KernelStreamWords w;
  w.who = "rank 2 (host a)";
  Recorder rec;
  KernelStream ks(w, nullptr, DataType::kFloat32, ReduceOp::kSum, 1, rec.launch());
  ASSERT_TRUE(ks.begin_step().ok());
  ASSERT_TRUE(ks.copy(out, slot_a, 64).ok());
  const StepBuf x[] = {slot_a, in};
  Status s = ks.fold(slot_b, {}, x, 2, 32, false);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("rank 2 (host a)"), std::string::npos) << s.message();
  EXPECT_FALSE(ks.copy(out, slot_a, 6).ok());  // not whole elements
}

// The tables of repeated one-node calls (gpu/step_table_cache.h): found by every field of the
// call, the least recently used dropped when full, calls of too many tables never kept.
std::vector<std::unique_ptr<kernels::StepTable>> tables_of(int n, int nsteps) {
  std::vector<std::unique_ptr<kernels::StepTable>> t;
  for (int i = 0; i < n; ++i) {
    t.push_back(std::make_unique<kernels::StepTable>());
    t.back()->nsteps = nsteps + i;
  }
  return t;
}

TEST(StepTableCache, FindsACallByEveryFieldOfItsKey) {
  StepTableCache cache;
  StepCallKey k{CollectiveKind::kAllreduce, plan::Algo::kRing, true, 1001, DataType::kFloat32, ReduceOp::kSum,
                0, 4, in, out};
  EXPECT_EQ(cache.find(k), nullptr);
  cache.put(k, tables_of(2, 7), {10, 20, 30});
  const StepTableCache::Entry* e = cache.find(k);
  ASSERT_NE(e, nullptr);
  ASSERT_EQ(e->tables.size(), 2u);
  EXPECT_EQ(e->tables[0]->nsteps, 7);
  EXPECT_EQ(e->tables[1]->nsteps, 8);
  EXPECT_EQ(e->bytes_sent, (std::vector<uint64_t>{10, 20, 30}));
  // A call that differs in any one field is another call.
  std::vector<StepCallKey> others(10, k);
  others[0].kind = CollectiveKind::kBroadcast;
  others[1].algo = plan::Algo::kTree;
  others[2].low_latency = false;
  others[3].count = 1002;
  others[4].type = DataType::kInt32;
  others[5].op = ReduceOp::kMax;
  others[6].root = 1;
  others[7].divisor = 8;
  others[8].input = out;
  others[9].output = in;
  for (size_t i = 0; i < others.size(); ++i) EXPECT_EQ(cache.find(others[i]), nullptr) << "field " << i;
  EXPECT_EQ(cache.hits(), 1u);
  // The same key again replaces the entry.
  cache.put(k, tables_of(1, 3), {1});
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.find(k)->tables.size(), 1u);
}

TEST(StepTableCache, DropsTheLeastRecentlyUsedAndNeverKeepsLargeCalls) {
  StepTableCache cache;
  StepCallKey k{};
  auto key = [&](size_t count) {
    StepCallKey c = k;
    c.count = count;
    return c;
  };
  for (size_t i = 1; i <= StepTableCache::kEntries; ++i) cache.put(key(i), tables_of(1, 1), {});
  EXPECT_EQ(cache.size(), StepTableCache::kEntries);
  ASSERT_NE(cache.find(key(1)), nullptr);  // 1 is now the most recently used, 2 the least
  cache.put(key(1000), tables_of(1, 1), {});
  EXPECT_EQ(cache.size(), StepTableCache::kEntries);
  EXPECT_EQ(cache.find(key(2)), nullptr);
  EXPECT_NE(cache.find(key(1)), nullptr);
  EXPECT_NE(cache.find(key(1000)), nullptr);
  // Too many tables, or none: not kept.
  cache.put(key(5000), tables_of(int(StepTableCache::kMaxTables) + 1, 1), {});
  EXPECT_EQ(cache.find(key(5000)), nullptr);
  cache.put(key(5001), tables_of(0, 1), {});
  EXPECT_EQ(cache.find(key(5001)), nullptr);
}

}  // namespace
}  // namespace gradsync
