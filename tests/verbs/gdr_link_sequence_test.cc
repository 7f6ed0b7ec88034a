// The sequence of one-node calls on one buffer that tests/verbs/node_gpu_test.cc's
// OneNodeStepReplay runs on the GPU (where it hung once on the trees, 2026-12-07;
// step_replay_calls.h): in-place int32 allreduces of 1001 (sum), 37 (max) and 300001 (max)
// elements, each feeding the next, at 4 ranks of one node with every peer direct, so with
// relative counts (gpu/step_runner.h). Each call takes the protocol the GPU's cost model picks
// for it (rdma_auto_low_latency: the small ones low-latency, 300001 bulk), or every call
// low-latency, and the buffer of every rank is checked exact against the host's sequence
// after every call, round after round, with a random jitter in each rank's waits and signals.
//
// Two ways of running a call's steps: the host stream (gdr_link_world.h), and the GPU's own
// translation, KernelStream's step tables (gpu/kernel_stream.h), run on the host as the step
// kernel runs them with one block (kernels/cuda_step.cu: bases read at the start, relative
// waits, signals and low-latency flags made absolute with them, `advance` added at the end),
// a repeated call relaunching its tables from a StepTableCache as GdrChannels::enqueue does.
// The latter also checks that the bases the tables move on are the words the peers see.
#include <random>

#include "gdr_link_world.h"
#include "gpu/plan/schedule.h"
#include "step_replay_calls.h"
#if GRADSYNC_HAVE_CUDA
#include "gpu/kernel_stream.h"
#include "gpu/step_table_cache.h"
#endif

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using namespace gdr_link_world;
using plan::Algo;

using step_replay::Call;
using step_replay::kCalls;
using step_replay::kCap;
constexpr int kRanks = 4;

// The GPU communicator's slots on one node (device_comm_gdr.cc): 4 of 1 MiB per peer and
// direction, low-latency slots of 128 KiB (64 KiB of payload). `small`: 4 of 4 KiB with 2 KiB
// low-latency slots, so that a call has many messages per peer, mostly no multiple of the slots.
Ring one_node(bool small) {
  const size_t ll_bytes = small ? 2048 : size_t(128) << 10;
  return Ring(kRanks, 4, small ? 4096 : size_t(1) << 20, /*per_node=*/kRanks, 10s, 1, /*direct=*/true,
              /*nic=*/false, /*tcp=*/false, [ll_bytes](int, GdrLinkConfig& c, GdrLinkOps&) { c.ll_bytes = ll_bytes; },
              /*pairs=*/true);
}

// How each call's protocol is chosen: as the GPU's cost model picks it, or low-latency always
// (GRADSYNC_PROTO=ll).
enum class Proto { kAuto, kLowLatency };

// A few microseconds' pause, now and then, so that the ranks' threads interleave otherwise
// from run to run.
class Jitter {
 public:
  explicit Jitter(unsigned seed) : rng_(seed) {}
  void operator()() {
    const unsigned x = rng_() % 64;
    if (x < 4) std::this_thread::sleep_for(std::chrono::microseconds(x * 20 + 5));
    else if (x < 16) std::this_thread::yield();
  }

 private:
  std::minstd_rand rng_;
};

// The host stream with a jitter before each wait and signal.
class JitterStream final : public StepStream {
 public:
  JitterStream(StepStream& inner, unsigned seed) : in_(inner), jitter_(seed) {}
  Status begin_call(bool relative) override { return in_.begin_call(relative); }
  Status begin_step() override { return in_.begin_step(); }
  void order_signals() override { in_.order_signals(); }
  Status end_step() override { return in_.end_step(); }
  Status end_call() override { return in_.end_call(); }
  Status wait_arrived(int p, int64_t v) override { return jitter_(), in_.wait_arrived(p, v); }
  Status wait_send_free(int p, int64_t v) override { return jitter_(), in_.wait_send_free(p, v); }
  Status signal_ready(int p, uint64_t v) override { return jitter_(), in_.signal_ready(p, v); }
  Status signal_consumed(int p, uint64_t v) override { return jitter_(), in_.signal_consumed(p, v); }
  Status copy(StepBuf d, StepBuf s, size_t b) override { return in_.copy(d, s, b); }
  Status fold(StepBuf d, StepBuf d2, const StepBuf* x, int k, size_t n, bool final) override {
    return in_.fold(d, d2, x, k, n, final);
  }

 private:
  StepStream& in_;
  Jitter jitter_;
};

// One call on every rank: (call, low-latency, every rank's buffer) -> every rank's status.
using RunCall = std::function<std::vector<Status>(const Call&, bool, const std::vector<void*>&)>;

// `rounds` times the sequence on `algo`, every rank's buffer checked after every call.
void run_sequence(Ring& ring, Algo algo, Proto proto, int rounds, const RunCall& run) {
  RdmaChannels ch = ring.channels(0);
  rdma_choose_algos(ch);
  const size_t ranks = kRanks;
  std::vector<std::vector<int32_t>> buf(ranks, std::vector<int32_t>(kCap));
  for (size_t r = 0; r < ranks; ++r)
    for (size_t i = 0; i < kCap; ++i) buf[r][i] = step_replay::initial(int(r), i);
  auto want = buf;  // the host's sequence
  std::vector<void*> at(ranks);
  for (size_t r = 0; r < ranks; ++r) at[r] = buf[r].data();
  int small = 0, large = 0;
  for (int round = 0; round < rounds; ++round) {
    for (size_t k = 0; k < sizeof(kCalls) / sizeof(kCalls[0]); ++k) {
      const Call& c = kCalls[k];
      const bool ll = proto == Proto::kLowLatency || rdma_auto_low_latency(ch, algo, c.count * 4);
      (ll ? small : large) += 1;
      const std::string what = std::string(plan::to_string(algo)) + " round " + std::to_string(round) + " call " +
                               std::to_string(k) + " (" + std::to_string(c.count) + (ll ? ", low-latency)" : ", bulk)");
      step_replay::reduce_on_host(c, want);
      auto st = run(c, ll, at);
      for (size_t r = 0; r < ranks; ++r) ASSERT_TRUE(st[r].ok()) << what << " rank " << r << ": " << st[r].to_string();
      for (size_t r = 0; r < ranks; ++r) {
        for (size_t i = 0; i < kCap; ++i) ASSERT_EQ(buf[r][i], want[r][i]) << what << " rank " << r << " element " << i;
      }
    }
  }
  // The GPU's mix: low-latency calls and bulk ones on the same slots.
  if (proto == Proto::kAuto) {
    EXPECT_GT(small, 0) << plan::to_string(algo);
    EXPECT_GT(large, 0) << plan::to_string(algo);
  }
}

// The calls on the host stream, with jitter.
RunCall on_host_stream(Ring& ring, Algo algo, unsigned seed) {
  ring.wrap_stream = [seed](int r, StepStream& hs) { return std::make_unique<JitterStream>(hs, seed * 7919u + unsigned(r)); };
  return [&ring, algo](const Call& c, bool ll, const std::vector<void*>& at) {
    ring.low_latency = ll;
    const std::vector<const void*> in(at.begin(), at.end());
    return ring.call(CollectiveKind::kAllreduce, {c.count}, 0, in, at, algo, c.op, DataType::kInt32);
  };
}

std::string algo_name(const ::testing::TestParamInfo<Algo>& info) {
  std::string name = plan::to_string(info.param);
  name.erase(std::remove(name.begin(), name.end(), '-'), name.end());
  return name;
}
const auto kAlgos = ::testing::Values(Algo::kTree, Algo::kRing, Algo::kOneShot, Algo::kTwoShot);

class StepSequence : public ::testing::TestWithParam<Algo> {};

// The GPU's slots, the protocol per call as the GPU's cost model picks it.
TEST_P(StepSequence, MixedProtocolsOnOneBufferExactOnTheHostStream) {
  Ring ring = one_node(false);
  ASSERT_EQ(ring.error(), "");
  run_sequence(ring, GetParam(), Proto::kAuto, 3, on_host_stream(ring, GetParam(), 1));
}

// Small slots: many messages per peer and call, the last one's signal rounded up to the slots
// at both ends, then every call low-latency (the 300001 elements too, in 1 KiB messages).
TEST_P(StepSequence, ManyMessagesPerCallExactOnTheHostStream) {
  Ring ring = one_node(true);
  ASSERT_EQ(ring.error(), "");
  run_sequence(ring, GetParam(), Proto::kAuto, 2, on_host_stream(ring, GetParam(), 2));
  run_sequence(ring, GetParam(), Proto::kLowLatency, 1, on_host_stream(ring, GetParam(), 3));
}

INSTANTIATE_TEST_SUITE_P(Algos, StepSequence, kAlgos, algo_name);

#if GRADSYNC_HAVE_CUDA

// One rank's step tables run on the host as the step kernel runs them with one block: the
// bases read when the table starts, then step by step its waits (relative ones made absolute
// with the bases), its runs of operations (HostOps, each low-latency flag made absolute as
// flag_of does, each slot moved on by its base as step_slot does) and its signals, then
// `advance` added to the bases.
class HostTables {
 public:
  HostTables(std::function<Status()> stop, uint64_t* bases, DataType type, ReduceOp op, int world, unsigned seed)
      : ops_(std::move(stop), type, op, world), es_(element_size(type)), bases_(bases), jitter_(seed) {}
  const Status& status() const { return status_; }
  cudaError_t run(const kernels::StepTable& t) {
    uint64_t base[kernels::kStepMaxBases];
    for (int b = 0; b < kernels::kStepMaxBases; ++b) base[b] = t.bases != nullptr ? load(&bases_[b]) : 0;
    auto operand = [&](const void* p, uint32_t f, int b, uint16_t slot) {
      StepBuf x(p);
      if (slot != kernels::kNoSlot) {
        x.p = kernels::step_slot(x.p, slot, base[b], t.slots, f != 0 ? t.ll_stride : t.slot_stride);
      }
      if (f != 0) {
        const uint32_t v = b >= 0 ? uint32_t(base[b] + f) : f;
        x.flag = v == 0 ? 1u : v;
      }
      return x;
    };
    for (int k = 0; k < t.nsteps && status_.ok(); ++k) {
      const kernels::TableStep& st = t.steps[k];
      for (int i = st.wait; i < st.wait + st.nwaits && status_.ok(); ++i) {
        const kernels::StepWait& w = t.waits[i];
        jitter_();
        status_ = ops_.wait(w.word, w.base >= 0 ? int64_t(base[w.base]) + w.value : w.value,
                            std::string(w.what == 3 ? "a message from rank " : "a free send slot at rank ") +
                                std::to_string(w.peer));
      }
      const size_t bytes = st.count * es_;
      for (int i = st.op, e; i < st.op + st.nops && status_.ok(); i = e) {
        e = i + t.ops[i].run;
        const kernels::StepOp& o = t.ops[i];
        const kernels::StepOp& last = t.ops[e - 1];
        if (o.kind == kernels::StepOpKind::kCopy) {
          // A run of copies of one source (or a lone copy).
          for (int j = i; j < e && status_.ok(); ++j) {
            const kernels::StepOp& q = t.ops[j];
            status_ = ops_.copy(operand(q.dst, q.dst_flag, q.dst_base, q.dst_slot),
                                operand(q.a, q.a_flag, q.a_base, q.a_slot), bytes);
          }
          continue;
        }
        StepBuf x[kernels::kStepMaxFold];
        x[0] = operand(o.a, o.a_flag, o.a_base, o.a_slot);
        for (int j = i; j < e; ++j) {
          x[j - i + 1] = operand(t.ops[j].b, t.ops[j].b_flag, t.ops[j].b_base, t.ops[j].b_slot);
        }
        status_ = ops_.fold(operand(last.dst, last.dst_flag, last.dst_base, last.dst_slot),
                            operand(last.dst2, last.dst2_flag, last.dst2_base, last.dst2_slot), x, e - i + 1, st.count,
                            last.kind == kernels::StepOpKind::kReduceFinal);
      }
      if (!status_.ok()) break;
      for (int i = st.signal; i < st.signal + st.nsignals; ++i) {
        const kernels::StepSignal& g = t.signals[i];
        jitter_();
        store(g.word, g.base >= 0 ? base[g.base] + g.value : g.value);
      }
    }
    if (!status_.ok()) return cudaErrorLaunchTimeout;
    if (t.bases != nullptr) {
      for (int b = 0; b < kernels::kStepMaxBases; ++b)
        if (t.advance[b] != 0) store(&bases_[b], base[b] + t.advance[b]);
    }
    return cudaSuccess;
  }

 private:
  HostOps ops_;
  size_t es_;
  uint64_t* bases_;
  Jitter jitter_;
  Status status_ = Status::Ok();
};

// What GdrChannels::enqueue keeps per rank: the stream's words, the bases in "device memory",
// the cache of recent calls' tables.
struct TableRank {
  uint64_t bases[kernels::kStepMaxBases] = {};
  uint32_t counters[kernels::kStepCounterWords] = {};
  uint32_t abort = 0;
  kernels::NodeError error{};
  KernelStreamWords words;
  StepTableCache cache;
};

// The calls as GdrChannels::enqueue queues them on one node: a call whose key was seen
// relaunches its tables, any other runs the step runner into a KernelStream whose tables run
// on the host (and are kept). After each call every rank's bases are the words its signals
// left (the ready and consumed words of every peer).
RunCall on_tables(Ring& ring, std::vector<TableRank>& ranks, Algo algo, unsigned seed) {
  for (int r = 0; r < kRanks; ++r) {
    TableRank& t = ranks[size_t(r)];
    t.words.link = &ring.link(r);
    t.words.abort = &t.abort;
    t.words.error = &t.error;
    t.words.counters = t.counters;
    t.words.bases = t.bases;
    t.words.who = "rank " + std::to_string(r);
  }
  return [&ring, &ranks, algo, seed](const Call& c, bool ll, const std::vector<void*>& at) {
    std::vector<Status> st(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        TableRank& t = ranks[size_t(r)];
        GdrLink& link = ring.link(r);
        const RdmaChannels& ch = ring.channels(r);
        const int divisor = int(ch.members.size());
        const size_t payload = link.ll_payload_bytes();
        const bool low_latency = payload >= 4 && ll;
        const size_t chunk = low_latency ? std::min(ring.slot_bytes(), payload) : ring.slot_bytes();
        HostTables tables(
            [&ring, r]() -> Status {
              if (std::string a = ring.abort_reason(); !a.empty()) return {Code::kAborted, "rank " + std::to_string(r) + ": " + a};
              return Status::Ok();
            },
            t.bases, DataType::kInt32, c.op, divisor, seed * 7919u + unsigned(r));
        const StepCallKey key{CollectiveKind::kAllreduce, algo, low_latency, c.count, DataType::kInt32, c.op, 0,
                              divisor, at[size_t(r)], at[size_t(r)]};
        if (const StepTableCache::Entry* e = t.cache.find(key)) {
          for (const auto& table : e->tables) {
            if (tables.run(*table) != cudaSuccess) break;
          }
          st[size_t(r)] = tables.status();
        } else {
          auto steps = rdma_steps(ch, CollectiveKind::kAllreduce, algo, c.count, 4, 0, chunk, link.slots());
          if (!steps.ok()) {
            st[size_t(r)] = steps.status();
            return;
          }
          std::vector<std::unique_ptr<kernels::StepTable>> kept;
          KernelStream ks(t.words, nullptr, DataType::kInt32, c.op, divisor, [&](const kernels::StepTable& table) {
            kept.push_back(std::make_unique<kernels::StepTable>(table));
            return tables.run(table);
          });
          Status s = ring.runner(r).run(*steps, ch.members, at[size_t(r)], at[size_t(r)], 4, ks, low_latency);
          st[size_t(r)] = tables.status().ok() ? s : tables.status();
          if (s.ok()) t.cache.put(key, std::move(kept), std::vector<uint64_t>(size_t(link.peer_count())));
        }
        for (int p = 0; p < link.peer_count() && st[size_t(r)].ok(); ++p) {
          const GdrLink::StreamWords w = link.stream_words(p);
          const uint64_t sent = load(&t.bases[step_base(p, false)]), read = load(&t.bases[step_base(p, true)]);
          if (sent != load(w.ready) || read != load(w.consumed)) {
            st[size_t(r)] = {Code::kInternal, "peer " + std::to_string(p) + ": bases " + std::to_string(sent) + "/" +
                                                  std::to_string(read) + ", words ready " + std::to_string(load(w.ready)) +
                                                  " consumed " + std::to_string(load(w.consumed))};
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    return st;
  };
}

// The GPU's slots and protocols, the calls as the GPU queues them (tables, relaunched when a
// call repeats): exact, and every call but the first of each (count, op) was a replay.
TEST_P(StepSequence, MixedProtocolsOnOneBufferExactAsStepTables) {
  Ring ring = one_node(false);
  ASSERT_EQ(ring.error(), "");
  std::vector<TableRank> ranks(kRanks);
  run_sequence(ring, GetParam(), Proto::kAuto, 3, on_tables(ring, ranks, GetParam(), 4));
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(ranks[size_t(r)].cache.hits(), uint64_t(3 * 9 - 3)) << "rank " << r;
}

TEST_P(StepSequence, ManyMessagesPerCallExactAsStepTables) {
  Ring ring = one_node(true);
  ASSERT_EQ(ring.error(), "");
  std::vector<TableRank> ranks(kRanks);
  run_sequence(ring, GetParam(), Proto::kAuto, 2, on_tables(ring, ranks, GetParam(), 5));
  run_sequence(ring, GetParam(), Proto::kLowLatency, 1, on_tables(ring, ranks, GetParam(), 6));
}

#endif  // GRADSYNC_HAVE_CUDA

}  // namespace
}  // namespace gradsync
