// The transport half of the GPU communicator's RDMA path (gpu/gdr_link.h) and the step
// runner (gpu/step_runner.h) on the CPU: ranks as threads, each with its own emulated RDMA
// device (or one per "node"), a slot region in host memory registered with ibv_reg_mr, and a
// "stream" that does what the GPU stream does in the GPU communicator (gpu/gdr_channels.cc):
// the plan's steps (gpu/plan/schedule.h) for the ring and the double binary tree, through the
// same StepRunner, with the host reduction loops in place of the kernels. Everything else is
// the production engine: set-up through a host allreduce, an RC QP per peer INIT -> RTR -> RTS,
// WRITE_WITH_IMM slot to slot, credits by RDMA write, arrival checks, error completions, stall
// detection.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <climits>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <algorithm>
#include <vector>

#include "gpu/gdr_link.h"
#include "gpu/step_runner.h"
#include "kernels/host_reduce.h"
#include "transport/verbs/emulated_fabric.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::atomic<int> g_job{0};

// A host allreduce among n threads (the set-up exchange needs int32 sum and uint8 sum).
class ThreadAllreduce {
 public:
  explicit ThreadAllreduce(int n) : n_(n) {}
  Status run(const void* send, void* recv, size_t count, DataType type, ReduceOp op) {
    const size_t es = element_size(type);
    if (op != ReduceOp::kSum || (type != DataType::kInt32 && type != DataType::kUInt8)) {
      return {Code::kInvalidArgument, "ThreadAllreduce: int32 or uint8 sum only"};
    }
    std::unique_lock lock(mu_);
    const uint64_t gen = gen_;
    if (arrived_ == 0) acc_.assign(count * es, 0);
    for (size_t i = 0; i < count; ++i) {
      if (type == DataType::kInt32) {
        int32_t a, b;
        std::memcpy(&a, acc_.data() + i * 4, 4);
        std::memcpy(&b, static_cast<const uint8_t*>(send) + i * 4, 4);
        a += b;
        std::memcpy(acc_.data() + i * 4, &a, 4);
      } else {
        acc_[i] = uint8_t(acc_[i] + static_cast<const uint8_t*>(send)[i]);
      }
    }
    if (++arrived_ == n_) {
      result_ = acc_;
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, 20s, [&] { return gen_ != gen; })) {
      return {Code::kDeadlineExceeded, "ThreadAllreduce: a rank did not come"};
    }
    std::memcpy(recv, result_.data(), count * es);
    return Status::Ok();
  }

 private:
  int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t gen_ = 0;
  std::vector<uint8_t> acc_, result_;
};

// Host slots registered with ibv_reg_mr.
struct HostSlots {
  void* ptr = nullptr;
  verbs::MemoryRegion mr;
  ~HostSlots() {
    mr = {};
    std::free(ptr);
  }
};
Result<GdrRegion> host_region(const verbs::ProtectionDomain& pd, size_t bytes) {
  auto slots = std::make_shared<HostSlots>();
  if (::posix_memalign(&slots->ptr, 4096, bytes) != 0) return Status(Code::kInternal, "posix_memalign");
  std::memset(slots->ptr, 0, bytes);
  auto mr = verbs::MemoryRegion::create(pd, slots->ptr, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!mr.ok()) return mr.status();
  slots->mr = std::move(mr).value();
  GdrRegion region;
  region.base = static_cast<uint8_t*>(slots->ptr);
  region.mr = &slots->mr;
  region.method = "host memory";
  region.owner = slots;
  return region;
}

// A direct region for ranks as threads: plain memory, its address as the handle.
Result<GdrDirectRegion> thread_direct_region(size_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, bytes) != 0) return Status(Code::kInternal, "posix_memalign");
  std::memset(p, 0, bytes);
  GdrDirectRegion d;
  d.base = static_cast<uint8_t*>(p);
  std::memcpy(d.handle, &p, sizeof(p));
  d.owner = std::shared_ptr<void>(p, std::free);
  return d;
}
Result<GdrDirectRegion> open_thread_region(const uint8_t* handle, int) {
  GdrDirectRegion d;
  std::memcpy(&d.base, handle, sizeof(d.base));
  return d;
}

uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The host stream of one rank: waits spin on the words (bounded, abortable), copies and
// reductions run at once with the host loops (int64 or any type the call names).
class HostStream final : public StepStream {
 public:
  HostStream(const GdrLink& link, std::function<Status()> stop, DataType type, ReduceOp op, int world)
      : link_(link), stop_(std::move(stop)), type_(type), op_(op), world_(world) {}
  Status wait_arrived(int p, uint64_t v) override { return wait(link_.stream_words(p).arrived, v, "an arrival"); }
  Status wait_send_free(int p, uint64_t v) override {
    return wait(link_.stream_words(p).send_free, v, "a send slot");
  }
  Status signal_ready(int p, uint64_t v) override {
    store(link_.stream_words(p).ready, v);
    return Status::Ok();
  }
  Status signal_consumed(int p, uint64_t v) override {
    store(link_.stream_words(p).consumed, v);
    return Status::Ok();
  }
  Status copy(void* dst, const void* src, size_t bytes) override {
    if (dst != src) std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Status reduce(void* dst, const void* a, const void* b, size_t count) override {
    kernels::reduce(type_, op_, dst, a, b, count);
    return Status::Ok();
  }
  Status reduce_final(void* dst, void* dst2, const void* a, const void* b, size_t count) override {
    kernels::reduce_final(type_, op_, dst, dst2, a, b, count, world_);
    return Status::Ok();
  }

 private:
  Status wait(const uint64_t* word, uint64_t value, const char* what) {
    const auto deadline = Clock::now() + 10s;
    while (load(word) < value) {
      if (Status s = stop_(); !s.ok()) return s;
      if (Clock::now() > deadline) return {Code::kDeadlineExceeded, std::string("stream waited for ") + what};
      std::this_thread::yield();
    }
    return Status::Ok();
  }
  const GdrLink& link_;
  std::function<Status()> stop_;
  DataType type_;
  ReduceOp op_;
  int world_;
};

// n ranks, each with its link and its channels; the job's abort is one shared flag.
class Ring {
 public:
  // `per_node` ranks share each node and its emulated device (a node's ranks use its one NIC;
  // hosts "n0", "n1", ... node-major). `rails` > 1: rank r's members are the ranks q with
  // q % rails == r % rails (the hierarchical path's rails: one ring per local index).
  // `direct`: a node's ranks reach each other through mapped memory (GdrPeer::direct).
  // `nic` false: no rank is given an RDMA device (a gradsyncd that runs no verbs).
  Ring(int n, uint32_t slots, size_t slot_bytes, int per_node = 1, std::chrono::milliseconds timeout = 10s,
       int rails = 1, bool direct = false, bool nic = true)
      : n_(n), slot_bytes_(slot_bytes), ar_(n), words_(n), links_(n), runners_(n), channels_(n) {
    const int job = ++g_job;
    std::vector<std::string> hosts;
    for (int r = 0; r < n; ++r) {
      if (r % per_node == 0) {
        const std::string dev = "gdrlink" + std::to_string(job) + "d" + std::to_string(r / per_node);
        verbs::EmulatedFabric::instance().add_device(dev, 1, verbs::LinkLayer::kEthernet);
      }
      devices_.push_back("gdrlink" + std::to_string(job) + "d" + std::to_string(r / per_node));
      hosts.push_back("n" + std::to_string(r / per_node));
    }
    std::vector<std::thread> threads;
    std::vector<Status> st(n);
    std::vector<std::string> why(n);
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        std::vector<int> members;
        for (int q = r % rails; q < n; q += rails) members.push_back(q);
        auto ch = rdma_channels(members, hosts, r, direct);
        if (!ch.ok()) {
          st[r] = ch.status();
          return;
        }
        channels_[r] = std::move(ch).value();
        GdrLinkConfig c;
        c.who = "rank " + std::to_string(r);
        c.rank = r;
        c.world_size = n;
        c.peers = channels_[r].peers;
        c.hosts = hosts;
        if (nic) c.verbs_device = devices_[r];
        c.verbs_api = verbs::emulated_ibv()->name;
        c.slot_bytes = slot_bytes;
        c.slots = slots;
        c.op_timeout = timeout;
        c.log_name = "test";
        GdrLinkOps ops;
        ops.allreduce_now = [this](const void* s, void* d, size_t k, DataType t, ReduceOp o) { return ar_.run(s, d, k, t, o); };
        ops.abort_reason = [this] { return abort_reason(); };
        ops.abort_job = [this](const std::string& why) {
          std::lock_guard lock(mu_);
          if (abort_.empty()) abort_ = why;
        };
        ops.direct_make = thread_direct_region;
        ops.direct_open = open_thread_region;
        words_[r].resize(std::max<size_t>(1, c.peers.size()));
        auto link = GdrLink::create(c, ops, host_region, words_[r].data(), nullptr, &why[r]);
        if (!link.ok()) st[r] = link.status();
        else if (!*link) st[r] = Status(Code::kUnavailable, why[r]);
        else links_[r] = std::move(link).value();
        if (links_[r]) runners_[r] = std::make_unique<StepRunner>(links_[r].get());
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) {
      if (!st[r].ok()) error_ += "rank " + std::to_string(r) + ": " + st[r].to_string() + "\n";
    }
  }
  ~Ring() {
    runners_.clear();
    links_.clear();
    // The devices stay in the fabric (other tests' names never collide).
  }

  const std::string& error() const { return error_; }
  GdrLink& link(int r) { return *links_[r]; }
  const RdmaChannels& channels(int r) const { return channels_[r]; }
  // Messages rank r's stream read, from all its peers.
  uint64_t consumed(int r) const {
    uint64_t sum = 0;
    for (const GdrWords& w : words_[r]) sum += load(&w.consumed);
    return sum;
  }
  const std::string& device(int r) const { return devices_[r]; }
  std::string abort_reason() {
    std::lock_guard lock(mu_);
    return abort_;
  }

  // One collective: every rank's stream runs its steps for `algo` (kTree: allreduce on the
  // trees). `counts`: one per rank, or one for all. int64 buffers; `type` reinterprets them
  // (its elements must fill the same bytes).
  std::vector<Status> collective(CollectiveKind kind, std::vector<size_t> counts, int root,
                                 std::vector<std::vector<int64_t>>& send, std::vector<std::vector<int64_t>>& recv,
                                 plan::Algo algo = plan::Algo::kRing, ReduceOp op = ReduceOp::kSum,
                                 DataType type = DataType::kInt64) {
    counts.resize(size_t(n_), counts.front());
    std::vector<Status> st(n_);
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) {
      threads.emplace_back([&, r] {
        const size_t per = 8 / element_size(type);
        auto steps = rdma_steps(channels_[r], kind, algo, counts[r] * per, element_size(type), root, slot_bytes_);
        if (!steps.ok()) {
          st[r] = steps.status();
          return;
        }
        HostStream hs(*links_[r], [this, r]() -> Status {
          if (std::string a = abort_reason(); !a.empty()) return {Code::kAborted, "rank " + std::to_string(r) + " stopped: " + a};
          return links_[r]->error();
        }, type, op, int(channels_[r].members.size()));
        const void* input = kind == CollectiveKind::kBroadcast ? recv[r].data() : send[r].data();
        st[r] = runners_[r]->run(*steps, channels_[r].members, input, recv[r].data(), element_size(type), hs);
      });
    }
    for (auto& t : threads) t.join();
    return st;
  }

 private:
  int n_;
  size_t slot_bytes_;
  ThreadAllreduce ar_;
  std::vector<std::vector<GdrWords>> words_;
  std::vector<std::unique_ptr<GdrLink>> links_;
  std::vector<std::unique_ptr<StepRunner>> runners_;
  std::vector<RdmaChannels> channels_;
  std::vector<std::string> devices_;
  std::mutex mu_;
  std::string abort_;
  std::string error_;
};

std::vector<std::vector<int64_t>> inputs(int n, size_t len) {
  std::vector<std::vector<int64_t>> v(n, std::vector<int64_t>(len));
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < len; ++i) v[r][i] = int64_t(r + 1) * 100003 + int64_t(i);
  return v;
}

// reduce_scatter of `count` int64 per rank: rank r gets the sum of every rank's block r.
void expect_reduce_scatter(Ring& ring, int n, size_t count, plan::Algo algo) {
  auto send = inputs(n, count * n);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
  auto st = ring.collective(CollectiveKind::kReduceScatter, {count}, 0, send, recv, algo);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (size_t i = 0; i < count; ++i) {
      int64_t want = 0;
      for (int q = 0; q < n; ++q) want += send[q][size_t(r) * count + i];
      ASSERT_EQ(recv[r][i], want) << "reduce_scatter rank " << r;
    }
  }
}

class GdrLinkWorlds : public ::testing::TestWithParam<std::tuple<int, uint32_t>> {};

// Allreduce of many counts on the ring and on the trees, in calls back to back (message
// numbers, slots and credits carry over, and ring and tree calls share peers), then
// reduce_scatter, all_gather and broadcast, with 64-byte slots: many messages. Every rank its
// own node. The host stream signals each message before the runner plans it, so every message
// is ready before the worker knows its length (the late plan a GPU stream may cause).
TEST_P(GdrLinkWorlds, CollectivesOverTheLinks) {
  const auto [n, slots] = GetParam();
  Ring ring(n, slots, 64);
  ASSERT_EQ(ring.error(), "");
  for (size_t count : {size_t(1), size_t(13), size_t(1031), size_t(5003)}) {
    for (plan::Algo algo : {plan::Algo::kRing, plan::Algo::kTree}) {
      if (algo == plan::Algo::kTree && count > 1031) continue;  // CI time: the shapes below cover more
      auto send = inputs(n, count);
      std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
      auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo);
      for (int r = 0; r < n; ++r) {
        ASSERT_TRUE(st[r].ok()) << plan::to_string(algo) << " count " << count << " rank " << r << ": " << st[r].to_string();
      }
      for (size_t i = 0; i < count; ++i) {
        int64_t want = 0;
        for (int q = 0; q < n; ++q) want += send[q][i];
        for (int r = 0; r < n; ++r) {
          ASSERT_EQ(recv[r][i], want) << plan::to_string(algo) << " count " << count << " rank " << r << " i " << i;
        }
      }
    }
  }
  const size_t count = 301;
  expect_reduce_scatter(ring, n, count, plan::Algo::kRing);
  auto send = inputs(n, count);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count * n, -1));
  auto st = ring.collective(CollectiveKind::kAllGather, {count}, 0, send, recv);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(recv[r][size_t(q) * count + i], send[q][i]) << "all_gather";
  }
  recv = inputs(n, count);  // broadcast: recv is the buffer
  const auto root_data = recv[n - 1];
  st = ring.collective(CollectiveKind::kBroadcast, {count}, n - 1, send, recv);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    ASSERT_EQ(recv[r], root_data) << "broadcast rank " << r;
  }
}

// The links' byte counters (GdrLink::bytes_sent, behind Communicator::gpu_bytes_sent_by_link)
// after a ring allreduce of S bytes over 4 single-rank nodes: 2 (n-1)/n S per rank, all of it
// to the next rank on the ring; the trees' calls after it add to the same counters.
TEST(GdrLink, ByteCountersGiveTheRingsTwoNMinusOneOverN) {
  const int n = 4;
  Ring ring(n, 4, 64);
  ASSERT_EQ(ring.error(), "");
  const size_t count = 64;  // int64: S = 512 bytes, 128-byte chunks, two messages each
  auto send = inputs(n, count);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, plan::Algo::kRing);
  std::vector<uint64_t> after_ring(n, 0);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    uint64_t to_next = 0;
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      after_ring[r] += ring.link(r).bytes_sent(p);
      if (ring.link(r).peer(p).rank == (r + 1) % n) to_next = ring.link(r).bytes_sent(p);
    }
    EXPECT_EQ(after_ring[r], 2 * uint64_t(n - 1) * count * 8 / n) << "rank " << r;
    EXPECT_EQ(to_next, after_ring[r]) << "rank " << r;
  }
  st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, plan::Algo::kTree);
  uint64_t tree = 0;
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (int p = 0; p < ring.link(r).peer_count(); ++p) tree += ring.link(r).bytes_sent(p);
    tree -= after_ring[r];
  }
  // The trees move each half of S up and down once: every rank but the roots sends each half
  // up once, and every edge carries it down once: 2 (n-1) halves up and down in all.
  EXPECT_EQ(tree, 2 * uint64_t(n - 1) * count * 8);
}

// The cost model's choice on the RDMA channels (rdma_auto_algo): across 16 single-GPU nodes
// the trees' log2 depth beats the ring's 30 hops for small calls, and the ring's fewer bytes
// per NIC win for large ones; on one node of 4 the chain and the ring are the same hops.
TEST(RdmaChannels, TheCostModelTakesTheTreesForSmallCallsAcrossManyNodes) {
  std::vector<int> members;
  std::vector<std::string> hosts;
  for (int r = 0; r < 16; ++r) {
    members.push_back(r);
    hosts.push_back("n" + std::to_string(r));
  }
  auto ch = rdma_channels(members, hosts, 5);
  ASSERT_TRUE(ch.ok()) << ch.status().to_string();
  rdma_choose_algos(*ch);
  ASSERT_FALSE(ch->tree_faster.empty());
  EXPECT_EQ(rdma_auto_algo(*ch, 8), plan::Algo::kTree);
  EXPECT_EQ(rdma_auto_algo(*ch, 4096), plan::Algo::kTree);
  EXPECT_EQ(rdma_auto_algo(*ch, size_t(1) << 30), plan::Algo::kRing);
  EXPECT_EQ(rdma_auto_summary(*ch).rfind("tree up to ", 0), 0u) << rdma_auto_summary(*ch);
  EXPECT_NE(rdma_auto_summary(*ch).find("ring above"), std::string::npos) << rdma_auto_summary(*ch);
  // A single member has no choice to make.
  auto one = rdma_channels({3}, hosts, 3);
  ASSERT_TRUE(one.ok());
  rdma_choose_algos(*one);
  EXPECT_EQ(rdma_auto_algo(*one, 8), plan::Algo::kRing);
  EXPECT_EQ(rdma_auto_summary(*one), "ring at every size");
}

// With direct peers the hops inside a node are costed at the intra-node link and only the
// bytes between nodes at the NIC: at 2 nodes x 2 the trees' busiest NIC sends S against the
// ring's 1.5 S, in fewer hops, so the trees win at every size; through the NIC (not direct)
// the ring's fewer bytes per rank win for large calls. The tables of a few shapes are printed;
// each is one switch at most (trees below a size, the ring above), since these channels have
// the bulk protocol only.
TEST(RdmaChannels, DirectHopsAreCostedAtTheLinkInsideTheNode) {
  auto shape = [](int nodes, int per, bool direct) {
    std::vector<int> members;
    std::vector<std::string> hosts;
    for (int r = 0; r < nodes * per; ++r) {
      members.push_back(r);
      hosts.push_back("n" + std::to_string(r / per));
    }
    auto ch = rdma_channels(members, hosts, 0, direct);
    EXPECT_TRUE(ch.ok()) << ch.status().to_string();
    rdma_choose_algos(*ch);
    return *ch;
  };
  const RdmaChannels direct = shape(2, 2, true), nic = shape(2, 2, false);
  EXPECT_EQ(rdma_auto_summary(direct), "tree at every size");
  EXPECT_EQ(rdma_auto_algo(nic, size_t(64) << 20), plan::Algo::kRing) << rdma_auto_summary(nic);
  for (const GdrPeer& p : direct.peers) EXPECT_EQ(p.direct, p.rank == 1) << "peer " << p.rank;
  for (const RdmaChannels& ch : {shape(4, 2, true), shape(2, 4, false), shape(4, 8, false)}) {
    size_t switches = 0;
    for (size_t i = 1; i < ch.tree_faster.size(); ++i) switches += ch.tree_faster[i] != ch.tree_faster[i - 1];
    EXPECT_LE(switches, 1u) << rdma_auto_summary(ch);
  }
  for (const GdrPeer& p : nic.peers) EXPECT_FALSE(p.direct) << "peer " << p.rank;
  for (auto [nodes, per] : {std::pair{2, 1}, std::pair{3, 1}, std::pair{4, 1}, std::pair{8, 1}, std::pair{16, 1},
                            std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 4}, std::pair{4, 2}, std::pair{4, 8}}) {
    std::printf("%dx%d: direct: %s; through the NIC: %s\n", nodes, per, rdma_auto_summary(shape(nodes, per, true)).c_str(),
                rdma_auto_summary(shape(nodes, per, false)).c_str());
  }
}

// Rails: 3 nodes x 2 ranks, node-major, each node's two ranks on its one device; rank r is in
// the ring of local index r % 2 ({0, 2, 4} and {1, 3, 5}), both built by one collective set-up.
// Each ring sums its own members only, and names its own neighbours.
TEST(GdrLink, OneRingPerRailSumsItsMembers) {
  const int n = 6, rails = 2;
  Ring ring(n, 2, 64, /*per_node=*/rails, 10s, rails);
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(ring.channels(r).members.size(), size_t(n / rails));
    EXPECT_EQ(ring.channels(r).position, r / rails);
    EXPECT_EQ(ring.channels(r).shape.node_count(), n / rails) << "one member per node";
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      EXPECT_EQ(ring.link(r).peer(p).rank % rails, r % rails) << "rank " << r << " has a peer outside its rail";
    }
  }
  for (size_t count : {size_t(1), size_t(13), size_t(1031)}) {
    auto send = inputs(n, count);
    std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
    auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv);
    for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
    for (size_t i = 0; i < count; ++i) {
      for (int r = 0; r < n; ++r) {
        int64_t want = 0;
        for (int q = r % rails; q < n; q += rails) want += send[q][i];
        ASSERT_EQ(recv[r][i], want) << "count " << count << " rank " << r << " i " << i;
      }
    }
  }
}

// Two ranks on each of two devices: the ring's link inside a node loops through its NIC.
TEST(GdrLink, RanksSharingADevice) {
  Ring ring(4, 2, 64, /*per_node=*/2);
  ASSERT_EQ(ring.error(), "");
  const size_t count = 2000;
  auto send = inputs(4, count);
  std::vector<std::vector<int64_t>> recv(4, std::vector<int64_t>(count, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(recv[r][i], send[0][i] + send[1][i] + send[2][i] + send[3][i]) << "rank " << r << " i " << i;
    }
  }
}

// Nodes of several ranks (each node's ranks share its device): the ring chains each node's
// ranks and crosses between nodes once per node; the trees chain each node and join the nodes'
// heads in a double binary tree. Allreduce on both, int64 sum and int32 max, odd counts, one
// call after another; then the other collectives on the ring. Every result exact.
// With `direct`, the hops inside a node go through the peers' memory, as CUDA IPC does on the
// GPU, and only the hops between nodes are queue pairs.
class GdrLinkShapes : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

TEST_P(GdrLinkShapes, RingAndTreeOverNodes) {
  const auto [nodes, per, direct] = GetParam();
  const int n = nodes * per;
  Ring ring(n, 2, 256, per, 10s, 1, direct);
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      EXPECT_EQ(ring.link(r).peer(p).direct, direct && ring.link(r).peer(p).rank / per == r / per)
          << "rank " << r << " peer " << ring.link(r).peer(p).rank;
    }
  }
  EXPECT_EQ(ring.channels(0).shape.node_count(), nodes);
  EXPECT_EQ(ring.channels(0).tree.size(), 2) << "two trees";
  for (size_t count : {size_t(1), size_t(7), size_t(2053)}) {
    for (plan::Algo algo : {plan::Algo::kRing, plan::Algo::kTree}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        const DataType type = op == ReduceOp::kSum ? DataType::kInt64 : DataType::kInt32;
        auto send = inputs(n, count);
        if (op == ReduceOp::kMax) {
          for (int r = 0; r < n; ++r)
            for (size_t i = 0; i < count; ++i) send[r][i] = int64_t((i * 2654435761u + r * 40503u) % 1000003) << 20 | r;
        }
        std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
        auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo, op, type);
        for (int r = 0; r < n; ++r) {
          ASSERT_TRUE(st[r].ok()) << plan::to_string(algo) << " count " << count << " rank " << r << ": "
                                  << st[r].to_string();
        }
        for (int r = 0; r < n; ++r) {
          for (size_t i = 0; i < count; ++i) {
            if (op == ReduceOp::kSum) {
              int64_t want = 0;
              for (int q = 0; q < n; ++q) want += send[q][i];
              ASSERT_EQ(recv[r][i], want) << plan::to_string(algo) << " sum count " << count << " rank " << r;
            } else {
              int32_t want[2] = {INT32_MIN, INT32_MIN}, got[2];
              for (int q = 0; q < n; ++q) {
                int32_t v[2];
                std::memcpy(v, &send[q][i], 8);
                want[0] = std::max(want[0], v[0]);
                want[1] = std::max(want[1], v[1]);
              }
              std::memcpy(got, &recv[r][i], 8);
              ASSERT_EQ(got[0], want[0]) << plan::to_string(algo) << " max count " << count << " rank " << r;
              ASSERT_EQ(got[1], want[1]) << plan::to_string(algo) << " max count " << count << " rank " << r;
            }
          }
        }
      }
    }
  }
  const size_t count = 77;
  expect_reduce_scatter(ring, n, count, plan::Algo::kTree);  // a tree reduce_scatter takes the ring
  auto send = inputs(n, count * n);
  auto recv = inputs(n, count);
  const auto root_data = recv[1];
  auto st = ring.collective(CollectiveKind::kBroadcast, {count}, 1, send, recv, plan::Algo::kTree);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    ASSERT_EQ(recv[r], root_data) << "broadcast rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GdrLinkShapes,
                         ::testing::Values(std::make_tuple(2, 2, false), std::make_tuple(3, 2, false),
                                           std::make_tuple(2, 4, false), std::make_tuple(2, 2, true),
                                           std::make_tuple(3, 2, true), std::make_tuple(2, 4, true)),
                         [](const auto& info) {
                           return "x" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_direct" : "");
                         });

// Direct peers at 2 nodes x 4: the ring's hops inside a node move 2 (n-1)/n S through mapped
// memory, no queue pair is made for them, and only the node's exit ranks send over the NIC
// (S/n... per hop of the ring between nodes: the same 2 (n-1)/n S at the exit rank). The
// fabric's counters see the NIC bytes only.
TEST(GdrLink, DirectPeersKeepTheHopsInsideANodeOffTheNic) {
  const int nodes = 2, per = 4, n = nodes * per;
  Ring ring(n, 2, 256, per, 10s, 1, /*direct=*/true);
  ASSERT_EQ(ring.error(), "");
  const size_t count = 1024;  // int64: S = 8 KiB
  auto send = inputs(n, count);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, plan::Algo::kRing);
  uint64_t nic_total = 0, direct_total = 0;
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (size_t i = 0; i < count; ++i) {
      int64_t want = 0;
      for (int q = 0; q < n; ++q) want += send[q][i];
      ASSERT_EQ(recv[r][i], want) << "rank " << r << " i " << i;
    }
    uint64_t sent = 0;
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      sent += ring.link(r).bytes_sent(p);
      (ring.link(r).peer(p).direct ? direct_total : nic_total) += ring.link(r).bytes_sent(p);
    }
    EXPECT_EQ(sent, 2 * uint64_t(n - 1) * count * 8 / n) << "rank " << r;
    EXPECT_GT(ring.link(r).direct_region_bytes(), 0u);
  }
  // One ring: each node has one exit rank, which sends its 2 (n-1)/n S over the NIC.
  EXPECT_EQ(nic_total, uint64_t(nodes) * 2 * (n - 1) * count * 8 / n);
  EXPECT_EQ(direct_total, uint64_t(n - nodes) * 2 * (n - 1) * count * 8 / n);
  EXPECT_NE(ring.link(0).describe().find("on this node, by CUDA IPC"), std::string::npos) << ring.link(0).describe();
}

// One node whose ranks are all direct peers needs no RDMA device: the planner's ring and trees
// run over mapped memory alone (the GPU communicator's ring and tree on one node, by CUDA
// IPC). Every collective exact at odd counts; the ring's allreduce sends 2 (n-1)/n S per rank,
// the trees' 2 S at most (a chain: up and down, half the data per tree).
TEST(GdrLink, OneNodeOfDirectPeersNeedsNoNic) {
  for (int n : {2, 3, 8}) {
    Ring ring(n, 2, 256, /*per_node=*/n, 10s, 1, /*direct=*/true, /*nic=*/false);
    ASSERT_EQ(ring.error(), "") << n << " ranks";
    EXPECT_NE(ring.link(0).describe().find("no NIC"), std::string::npos) << ring.link(0).describe();
    EXPECT_EQ(ring.link(0).region_bytes(), 0u);
    for (plan::Algo algo : {plan::Algo::kRing, plan::Algo::kTree}) {
      std::vector<uint64_t> before(size_t(n), 0);
      for (int r = 0; r < n; ++r)
        for (int p = 0; p < ring.link(r).peer_count(); ++p) before[size_t(r)] += ring.link(r).bytes_sent(p);
      const size_t count = 1000 * size_t(n);  // int64: S = 8000 n bytes, a multiple of n
      auto send = inputs(n, count);
      std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
      auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo);
      for (int r = 0; r < n; ++r) {
        ASSERT_TRUE(st[r].ok()) << n << " ranks, " << plan::to_string(algo) << ": " << st[r].to_string();
        for (size_t i = 0; i < count; ++i) {
          int64_t want = 0;
          for (int q = 0; q < n; ++q) want += send[q][i];
          ASSERT_EQ(recv[r][i], want) << n << " ranks, " << plan::to_string(algo) << " rank " << r;
        }
        uint64_t sent = 0;
        for (int p = 0; p < ring.link(r).peer_count(); ++p) sent += ring.link(r).bytes_sent(p);
        sent -= before[size_t(r)];
        if (algo == plan::Algo::kRing) EXPECT_EQ(sent, 2 * uint64_t(n - 1) * count * 8 / n) << "rank " << r;
        else EXPECT_LE(sent, 2 * uint64_t(count) * 8) << "rank " << r;
      }
    }
    expect_reduce_scatter(ring, n, 333, plan::Algo::kRing);
    auto send = inputs(n, 77);
    std::vector<std::vector<int64_t>> gathered(n, std::vector<int64_t>(77 * size_t(n), -1));
    auto st = ring.collective(CollectiveKind::kAllGather, {77}, 0, send, gathered, plan::Algo::kRing);
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(st[r].ok()) << st[r].to_string();
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < 77; ++i) ASSERT_EQ(gathered[r][size_t(q) * 77 + i], send[q][i]) << "all_gather rank " << r;
    }
    auto recv = inputs(n, 1001);
    const auto root_data = recv[size_t(n - 1)];
    st = ring.collective(CollectiveKind::kBroadcast, {1001}, n - 1, send, recv, plan::Algo::kRing);
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(st[r].ok()) << st[r].to_string();
      ASSERT_EQ(recv[r], root_data) << "broadcast rank " << r;
    }
  }
}

// Without an RDMA device, a rank with a peer on another node cannot set up, and every rank
// learns it (those whose peers are all on their node too).
TEST(GdrLink, APeerOnAnotherNodeNeedsTheNic) {
  // 2 x 4: ranks 2 and 3 (6 and 7) have only peers on their node; 0 and 1 (4 and 5) leave it
  // (the ring's exit, and the two trees' heads).
  Ring ring(8, 2, 256, /*per_node=*/4, 10s, 1, /*direct=*/true, /*nic=*/false);
  EXPECT_NE(ring.error().find("rank 0: UNAVAILABLE: GPUDirect RDMA: this node's gradsyncd runs no verbs channels"),
            std::string::npos)
      << ring.error();
  EXPECT_NE(ring.error().find("rank 2: UNAVAILABLE: GPUDirect RDMA is not possible on rank 0 (host n0)"),
            std::string::npos)
      << ring.error();
  for (int r = 0; r < 8; ++r) {
    EXPECT_NE(ring.error().find("rank " + std::to_string(r) + ":"), std::string::npos) << ring.error();
  }
}

INSTANTIATE_TEST_SUITE_P(Rings, GdrLinkWorlds,
                         ::testing::Values(std::make_tuple(2, 2u), std::make_tuple(2, 4u), std::make_tuple(3, 2u),
                                           std::make_tuple(4, 3u), std::make_tuple(5, 2u)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_slots" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The ranks disagree on the call (rank 1 thinks the count is 99): the receiving side's
// length check fails the link as a mismatch, the job is aborted, and both streams stop.
TEST(GdrLink, DifferentCallsAreCaughtNotCombined) {
  Ring ring(2, 2, 64);
  ASSERT_EQ(ring.error(), "");
  auto send = inputs(2, 100);
  std::vector<std::vector<int64_t>> recv(2, std::vector<int64_t>(100, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {100, 99}, 0, send, recv);
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(st[r].ok()) << "rank " << r;
  const std::string why = ring.abort_reason();
  EXPECT_NE(why.find("called different collectives or counts"), std::string::npos) << why;
  EXPECT_NE(why.find("from rank"), std::string::npos) << why;
}

// A link goes down mid-collective: the writes fail with the peer named and the verbs status,
// the job is aborted, and every rank's stream stops within the deadline.
TEST(GdrLink, LinkDownMidCollectiveStopsEveryRank) {
  Ring ring(3, 2, 64);
  ASSERT_EQ(ring.error(), "");
  const size_t count = 300000;
  auto send = inputs(3, count);
  std::vector<std::vector<int64_t>> recv(3, std::vector<int64_t>(count, -1));
  std::thread breaker([&] {  // once messages are flowing: mid-collective
    const auto until = Clock::now() + 5s;
    while (ring.consumed(0) < 100 && Clock::now() < until) std::this_thread::yield();
    verbs::EmulatedFabric::instance().set_link_down(ring.device(1), 1);
  });
  const auto t0 = Clock::now();
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv);
  breaker.join();
  EXPECT_LT(Clock::now() - t0, 10s);
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r << " finished although a link was down";
    EXPECT_NE(st[r].message().find("rank "), std::string::npos) << st[r].to_string();
  }
  const std::string why = ring.abort_reason();
  EXPECT_NE(why.find("failed"), std::string::npos) << why;
  EXPECT_NE(why.find("rank "), std::string::npos) << why;
  std::printf("abort reason: %s\n", why.c_str());
}

// No RDMA device on one rank's node: nobody takes the link, and each rank says who lacks it.
// Rank r of a two-rank world on `hosts`, with 2 slots of 64 bytes on `device` (emulated).
GdrLinkConfig two_rank_config(int r, std::vector<std::string> hosts, const std::string& device) {
  GdrLinkConfig c;
  c.who = "rank " + std::to_string(r);
  c.rank = r;
  c.world_size = 2;
  c.hosts = std::move(hosts);
  c.verbs_device = device;
  c.verbs_api = verbs::emulated_ibv()->name;
  c.slot_bytes = 64;
  c.slots = 2;
  c.log_name = "test";
  return c;
}

TEST(GdrLink, ARankWithoutDeviceLeavesEveryRankWithout) {
  ThreadAllreduce ar(2);
  std::vector<std::string> why(2);
  std::vector<Status> st(2);
  std::vector<GdrWords> words(2);
  const std::string dev = "gdrlink-nodev" + std::to_string(++g_job);
  verbs::EmulatedFabric::instance().add_device(dev, 1, verbs::LinkLayer::kEthernet);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      GdrLinkConfig c = two_rank_config(r, {"a", "b"}, r == 0 ? dev : "");  // rank 1's node runs TCP
      GdrLinkOps ops;
      ops.allreduce_now = [&](const void* s, void* d, size_t k, DataType t, ReduceOp o) { return ar.run(s, d, k, t, o); };
      ops.abort_reason = [] { return std::string(); };
      c.peers = {{1 - r, true, true}};
      auto link = GdrLink::create(c, ops, host_region, &words[r], nullptr, &why[r]);
      st[r] = link.ok() && *link ? Status(Code::kInternal, "a link was made") : link.status();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(st[r].ok()) << st[r].to_string();
  EXPECT_NE(why[0].find("not possible on rank 1 (host b)"), std::string::npos) << why[0];
  EXPECT_NE(why[1].find("runs no verbs channels"), std::string::npos) << why[1];
}

// Two ranks of one node as direct peers; rank 1 cannot map rank 0's region: neither gets a
// link, both learn that direct peers were the cause (the GPU half then sets up again with
// queue pairs), and the same set-up without direct peers works.
TEST(GdrLink, ARankThatCannotMapItsPeerRefusesDirectOnEveryRank) {
  ThreadAllreduce ar(2);
  const std::string dev = "gdrlink-direct" + std::to_string(++g_job);
  verbs::EmulatedFabric::instance().add_device(dev, 1, verbs::LinkLayer::kEthernet);
  for (bool direct : {true, false}) {
    std::vector<std::string> why(2);
    std::vector<bool> refused(2, false);
    std::vector<Result<std::unique_ptr<GdrLink>>> made;
    for (int r = 0; r < 2; ++r) made.emplace_back(Status(Code::kInternal, "not run"));
    std::vector<GdrWords> words(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        GdrLinkConfig c = two_rank_config(r, {"a", "a"}, dev);
        c.peers = {{1 - r, true, true, direct}};
        GdrLinkOps ops;
        ops.allreduce_now = [&](const void* s, void* d, size_t k, DataType t, ReduceOp o) { return ar.run(s, d, k, t, o); };
        ops.abort_reason = [] { return std::string(); };
        ops.direct_make = thread_direct_region;
        ops.direct_open = [r](const uint8_t* h, int rank) -> Result<GdrDirectRegion> {
          if (r == 1) return Status(Code::kUnavailable, "no peer access (test)");
          return open_thread_region(h, rank);
        };
        bool ref = false;
        made[size_t(r)] = GdrLink::create(c, ops, host_region, &words[size_t(r)], nullptr, &why[size_t(r)], &ref);
        refused[size_t(r)] = ref;
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(made[size_t(r)].ok()) << made[size_t(r)].status().to_string();
      EXPECT_EQ(*made[size_t(r)] == nullptr, direct) << "rank " << r << " direct " << direct << ": " << why[size_t(r)];
      EXPECT_EQ(refused[size_t(r)], direct) << "rank " << r;
    }
    if (direct) {
      EXPECT_NE(why[1].find("mapping the memory of rank 0"), std::string::npos) << why[1];
    }
  }
}

}  // namespace
}  // namespace gradsync
