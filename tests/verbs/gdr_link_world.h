// Ranks as threads over the RDMA link (gpu/gdr_link.h) and the step runner (gpu/step_runner.h)
// on the CPU, for the gdr_link tests (gdr_link_test.cc, gdr_link_nodes_test.cc): a host
// allreduce among threads for the set-up, slots in host memory registered with the emulated
// fabric, direct regions in plain memory, and a host "stream" that does what the GPU stream
// does in the GPU communicator (gpu/gdr_channels.cc), with the host reduction loops in place of
// the kernels.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gdr_link.h"
#include "gpu/step_runner.h"
#include "kernels/host_reduce.h"
#include "kernels/step_slot.h"
#include "transport/verbs/emulated_fabric.h"

namespace gradsync::gdr_link_world {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

inline std::atomic<int> g_job{0};

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
inline Result<GdrRegion> host_region(const verbs::ProtectionDomain& pd, size_t bytes) {
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
inline Result<GdrDirectRegion> thread_direct_region(size_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, bytes) != 0) return Status(Code::kInternal, "posix_memalign");
  std::memset(p, 0, bytes);
  GdrDirectRegion d;
  d.base = static_cast<uint8_t*>(p);
  std::memcpy(d.handle, &p, sizeof(p));
  d.owner = std::shared_ptr<void>(p, std::free);
  return d;
}
inline Result<GdrDirectRegion> open_thread_region(const uint8_t* handle, int) {
  GdrDirectRegion d;
  std::memcpy(&d.base, handle, sizeof(d.base));
  return d;
}

// Slots of TCP peers: plain host memory (the GPU communicator's are pinned and mapped).
inline Result<GdrRegion> tcp_host_region(size_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, bytes) != 0) return Status(Code::kInternal, "posix_memalign");
  std::memset(p, 0, bytes);
  GdrRegion region;
  region.base = static_cast<uint8_t*>(p);
  region.method = "host memory";
  region.owner = std::shared_ptr<void>(p, std::free);
  return region;
}

inline uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The host halves of a step's requests on operands whose flags are absolute (StepBuf::base
// -1): waits spin on a word (bounded, abortable by `stop`), copies and reductions run at once
// with the host loops (int64 or any type the call names). HostStream's, and the step tables'
// run on the host (gdr_link_sequence_test.cc).
class HostOps {
 public:
  HostOps(std::function<Status()> stop, DataType type, ReduceOp op, int world)
      : stop_(std::move(stop)), type_(type), op_(op), world_(world) {}
  Status copy(StepBuf dst, StepBuf src, size_t bytes) {
    if (dst.flag == 0 && src.flag == 0) {
      if (dst.p != src.p) std::memcpy(dst.p, src.p, bytes);
      return Status::Ok();
    }
    std::vector<uint8_t> x;
    GS_RETURN_IF_ERROR(unpack(src, bytes, &x));
    pack(dst, x, bytes);
    return Status::Ok();
  }
  // Every source read (its lines as they land) before dst is written, so dst may be one of
  // them; folded left pairwise with the host loops, the last step final.
  Status fold(StepBuf dst, StepBuf dst2, const StepBuf* srcs, int k, size_t count, bool final) {
    if (k < 2) return {Code::kInternal, "host stream: a fold of " + std::to_string(k) + " operands"};
    const size_t bytes = count * element_size(type_);
    std::vector<uint8_t> acc, y;
    GS_RETURN_IF_ERROR(unpack(srcs[0], bytes, &acc));
    std::vector<uint8_t> r(acc.size(), 0);
    for (int j = 1; j < k; ++j) {
      GS_RETURN_IF_ERROR(unpack(srcs[j], bytes, &y));
      if (final && j == k - 1) {
        kernels::reduce_final(type_, op_, r.data(), nullptr, acc.data(), y.data(), count, world_);
      } else {
        kernels::reduce(type_, op_, r.data(), acc.data(), y.data(), count);
      }
      acc.swap(r);
    }
    pack(dst, acc, bytes);
    pack(dst2, acc, bytes);
    return Status::Ok();
  }
  // Until *word >= value (none when value <= 0).
  Status wait(const uint64_t* word, int64_t value, const std::string& what) {
    if (value <= 0) return Status::Ok();
    const auto deadline = Clock::now() + 10s;
    while (int64_t(load(word)) < value) {
      if (Status s = stop_(); !s.ok()) return s;
      if (Clock::now() > deadline) return {Code::kDeadlineExceeded, "stream waited for " + what};
      std::this_thread::yield();
    }
    return Status::Ok();
  }

 private:
  // The low-latency slots' lines as the kernels write them (kernels/cuda_node_ll.cuh): each
  // 8 bytes of a 16-byte line are 4 payload bytes, then the flag; a reader waits for both flags.
  Status unpack(StepBuf src, size_t bytes, std::vector<uint8_t>* out) {
    const size_t units = (bytes + 7) / 8;
    out->assign(units * 8, 0);
    if (src.flag == 0) {
      std::memcpy(out->data(), src.p, bytes);
      return Status::Ok();
    }
    auto* line = static_cast<const uint64_t*>(src.p);
    for (size_t u = 0; u < units; ++u) {
      const auto deadline = Clock::now() + 10s;
      uint64_t w0, w1;
      while (((w0 = load(&line[2 * u])) >> 32) != src.flag || ((w1 = load(&line[2 * u + 1])) >> 32) != src.flag) {
        if (Status s = stop_(); !s.ok()) return s;
        if (Clock::now() > deadline) return {Code::kDeadlineExceeded, "stream waited for a low-latency line"};
        std::this_thread::yield();
      }
      const uint32_t d[2] = {uint32_t(w0), uint32_t(w1)};
      std::memcpy(out->data() + u * 8, d, 8);
    }
    return Status::Ok();
  }
  static void pack(StepBuf dst, const std::vector<uint8_t>& x, size_t bytes) {
    if (dst.p == nullptr) return;
    if (dst.flag == 0) {
      std::memcpy(dst.p, x.data(), bytes);
      return;
    }
    auto* line = static_cast<uint64_t*>(dst.p);
    for (size_t u = 0; u * 8 < x.size(); ++u) {
      uint32_t d[2];
      std::memcpy(d, x.data() + u * 8, 8);
      store(&line[2 * u], uint64_t(dst.flag) << 32 | d[0]);
      store(&line[2 * u + 1], uint64_t(dst.flag) << 32 | d[1]);
    }
  }
  std::function<Status()> stop_;
  DataType type_;
  ReduceOp op_;
  int world_;
};

// A relative slot operand (StepBuf::slot, its base's word `base`) where the step kernel moves it.
inline void* moved_on(const GdrLink& link, const StepBuf& b, uint64_t base) {
  const size_t stride = b.flag != 0 ? link.ll_slot_bytes() : link.slot_bytes();
  return kernels::step_slot(b.p, uint16_t(b.slot), base, link.slots(), uint32_t(stride));
}

// The host stream of one rank: HostOps at once, each relative count and flag made absolute
// with the bases the call began with.
class HostStream final : public StepStream {
 public:
  HostStream(const GdrLink& link, std::function<Status()> stop, DataType type, ReduceOp op, int world)
      : link_(link), ops_(std::move(stop), type, op, world) {}
  // A relative call's bases are the words this stream signals, as the last call left them
  // (it ran to its end before this one starts).
  Status begin_call(bool relative) override {
    base_.assign(2 * size_t(link_.peer_count()), 0);
    if (relative) {
      for (int p = 0; p < link_.peer_count(); ++p) {
        base_[size_t(step_base(p, false))] = load(link_.stream_words(p).ready);
        base_[size_t(step_base(p, true))] = load(link_.stream_words(p).consumed);
      }
    }
    return Status::Ok();
  }
  Status wait_arrived(int p, int64_t v) override {
    return ops_.wait(link_.stream_words(p).arrived, at(step_base(p, true), v), "an arrival");
  }
  Status wait_send_free(int p, int64_t v) override {
    return ops_.wait(link_.stream_words(p).send_free, at(step_base(p, false), v), "a send slot");
  }
  Status signal_ready(int p, uint64_t v) override {
    store(link_.stream_words(p).ready, uint64_t(at(step_base(p, false), int64_t(v))));
    return Status::Ok();
  }
  Status signal_consumed(int p, uint64_t v) override {
    store(link_.stream_words(p).consumed, uint64_t(at(step_base(p, true), int64_t(v))));
    return Status::Ok();
  }
  Status copy(StepBuf dst, StepBuf src, size_t bytes) override { return ops_.copy(flagged(dst), flagged(src), bytes); }
  Status fold(StepBuf dst, StepBuf dst2, const StepBuf* srcs, int k, size_t count, bool final) override {
    StepBuf x[plan::kMaxPeers + 1];
    for (int j = 0; j < k && j <= plan::kMaxPeers; ++j) x[j] = flagged(srcs[j]);
    return ops_.fold(flagged(dst), flagged(dst2), x, k, count, final);
  }

 private:
  // A count made absolute (the base is 0 in a call that is not relative).
  int64_t at(int base, int64_t v) const { return int64_t(base_[size_t(base)]) + v; }
  // A relative flag made absolute and a relative slot moved on, as the step kernel does.
  StepBuf flagged(StepBuf b) const {
    if (b.base < 0) return b;
    const uint64_t base = base_[size_t(b.base)];
    if (b.slot >= 0) b.p = moved_on(link_, b, base);
    if (b.flag != 0) {
      const uint32_t f = uint32_t(base + b.flag);
      b.flag = f == 0 ? 1u : f;
    }
    b.base = -1;
    b.slot = -1;
    return b;
  }
  const GdrLink& link_;
  HostOps ops_;
  std::vector<uint64_t> base_;  // per step_base
};

// n ranks, each with its link and its channels; the job's abort is one shared flag.
class Ring {
 public:
  // `per_node` ranks share each node and its emulated device (a node's ranks use its one NIC;
  // hosts "n0", "n1", ... node-major). `rails` > 1: rank r's members are the ranks q with
  // q % rails == r % rails (the hierarchical path's rails: one ring per local index).
  // `direct`: a node's ranks reach each other through mapped memory (GdrPeer::direct).
  // `nic` false: no rank is given an RDMA device (a gradsyncd that runs no verbs).
  // `tcp`: the peers that are not direct are TCP peers on 127.0.0.1 (no RDMA device);
  // `tweak` (optional) changes a rank's config and ops before its set-up.
  // `pairs`: the channels have the direct pairs of one node too (one-shot and two-shot).
  Ring(int n, uint32_t slots, size_t slot_bytes, int per_node = 1, std::chrono::milliseconds timeout = 10s,
       int rails = 1, bool direct = false, bool nic = true, bool tcp = false,
       std::function<void(int, GdrLinkConfig&, GdrLinkOps&)> tweak = {}, bool pairs = false)
      : n_(n), slot_bytes_(slot_bytes), ar_(n), words_(n), links_(n), runners_(n), channels_(n) {
    sit_out.assign(size_t(n), false);
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
        auto ch = rdma_channels(members, hosts, r, direct, pairs);
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
        if (tcp) {
          c.verbs_device.clear();
          c.tcp = true;
          c.tcp_address = "127.0.0.1";
          ops.tcp_region = tcp_host_region;
        }
        if (tweak) tweak(r, c, ops);
        words_[r].resize(std::max<size_t>(1, c.peers.size()));
        auto link = GdrLink::create(c, ops, host_region, words_[r].data(), nullptr, &why[r]);
        if (!link.ok()) st[r] = link.status();
        else if (!*link) st[r] = Status(Code::kUnavailable, why[r]);
        else links_[r] = std::move(link).value();
        // Relative counts where the GPU communicator has them: one node, every hop direct.
        const bool relative = direct && channels_[r].shape.node_count() == 1;
        if (links_[r]) runners_[r] = std::make_unique<StepRunner>(links_[r].get(), relative);
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
  std::vector<bool> sit_out;  // ranks collective() leaves out (all false at first)
  // When set, collective() runs rank r's steps on wrap_stream(r, its host stream) (a stream
  // that watches the runner's calls and passes them on).
  std::function<std::unique_ptr<StepStream>(int, StepStream&)> wrap_stream;
  // When set, collective() asks for the low-latency protocol (StepRunner::run), with messages
  // of at most a low-latency slot's payload, as GdrChannels::enqueue does.
  bool low_latency = false;
  // Rank r's process "dies": its link closes its connections (its runner first).
  void kill(int r) {
    runners_[r].reset();
    links_[r].reset();
  }
  GdrLink& link(int r) { return *links_[r]; }
  StepRunner& runner(int r) { return *runners_[r]; }
  size_t slot_bytes() const { return slot_bytes_; }
  const RdmaChannels& channels(int r) const { return channels_[r]; }
  // The payload bytes rank r's link sent so far, to all its peers (GdrLink::bytes_sent).
  uint64_t bytes_sent(int r) const {
    uint64_t sum = 0;
    for (int p = 0; p < links_[r]->peer_count(); ++p) sum += links_[r]->bytes_sent(p);
    return sum;
  }
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
    std::vector<const void*> in(static_cast<size_t>(n_));
    std::vector<void*> out(static_cast<size_t>(n_));
    for (int r = 0; r < n_; ++r) {
      counts[size_t(r)] *= 8 / element_size(type);
      in[size_t(r)] = kind == CollectiveKind::kBroadcast ? recv[r].data() : send[r].data();
      out[size_t(r)] = recv[r].data();
    }
    return call(kind, counts, root, in, out, algo, op, type);
  }
  // The same on any buffers: `counts` in elements of `type` (one per rank, or one for all),
  // `in` and `out` one per rank (a broadcast reads `in` on the root).
  std::vector<Status> call(CollectiveKind kind, std::vector<size_t> counts, int root, const std::vector<const void*>& in,
                           const std::vector<void*>& out, plan::Algo algo, ReduceOp op, DataType type) {
    counts.resize(size_t(n_), counts.front());
    std::vector<Status> st(n_);
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) {
      threads.emplace_back([&, r] {
        if (sit_out[size_t(r)]) return;  // that rank takes no part (it is killed meanwhile)
        const size_t ll = links_[r]->ll_payload_bytes();
        const size_t chunk = low_latency && ll > 0 ? std::min(slot_bytes_, ll) : slot_bytes_;
        auto steps = rdma_steps(channels_[r], kind, algo, counts[r], element_size(type), root, chunk,
                                links_[r]->slots());
        if (!steps.ok()) {
          st[r] = steps.status();
          return;
        }
        HostStream hs(*links_[r], [this, r]() -> Status {
          if (std::string a = abort_reason(); !a.empty()) return {Code::kAborted, "rank " + std::to_string(r) + " stopped: " + a};
          return links_[r]->error();
        }, type, op, int(channels_[r].members.size()));
        std::unique_ptr<StepStream> wrapped = wrap_stream ? wrap_stream(r, hs) : nullptr;
        st[r] = runners_[r]->run(*steps, channels_[r].members, in[size_t(r)], out[size_t(r)], element_size(type),
                                 wrapped ? *wrapped : static_cast<StepStream&>(hs), low_latency);
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

inline std::vector<std::vector<int64_t>> inputs(int n, size_t len) {
  std::vector<std::vector<int64_t>> v(n, std::vector<int64_t>(len));
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < len; ++i) v[r][i] = int64_t(r + 1) * 100003 + int64_t(i);
  return v;
}

// Element i's sum over every rank's buffer.
inline int64_t sum_at(const std::vector<std::vector<int64_t>>& send, size_t i) {
  int64_t want = 0;
  for (const auto& v : send) want += v[i];
  return want;
}

// allreduce (sum) of `count` int64 on `algo`: every rank gets every element's sum.
inline void expect_allreduce(Ring& ring, int n, size_t count, plan::Algo algo) {
  auto send = inputs(n, count);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << plan::to_string(algo) << " count " << count << " rank " << r << ": " << st[r].to_string();
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(recv[r][i], sum_at(send, i)) << plan::to_string(algo) << " count " << count << " rank " << r << " i " << i;
    }
  }
}

// The same in place (one buffer, input and output).
inline void expect_allreduce_in_place(Ring& ring, int n, size_t count, plan::Algo algo) {
  auto buf = inputs(n, count);
  const auto want = buf;
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, buf, buf, algo);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << plan::to_string(algo) << " in place rank " << r << ": " << st[r].to_string();
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(buf[r][i], sum_at(want, i)) << plan::to_string(algo) << " rank " << r;
  }
}

// reduce_scatter of `count` int64 per rank: rank r gets the sum of every rank's block r.
inline void expect_reduce_scatter(Ring& ring, int n, size_t count, plan::Algo algo) {
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

// all_gather of 77 int64 per rank (on `gather`), then a broadcast of 1001 from the last rank
// (on `bcast`): every rank gets every block, and the root's data.
inline void expect_all_gather_and_broadcast(Ring& ring, int n, plan::Algo bcast, plan::Algo gather = plan::Algo::kRing) {
  auto send = inputs(n, 77);
  std::vector<std::vector<int64_t>> gathered(n, std::vector<int64_t>(77 * size_t(n), -1));
  auto st = ring.collective(CollectiveKind::kAllGather, {77}, 0, send, gathered, gather);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < 77; ++i) ASSERT_EQ(gathered[r][size_t(q) * 77 + i], send[q][i]) << "all_gather rank " << r;
  }
  auto recv = inputs(n, 1001);
  const auto root_data = recv[size_t(n - 1)];
  st = ring.collective(CollectiveKind::kBroadcast, {1001}, n - 1, send, recv, bcast);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    ASSERT_EQ(recv[r], root_data) << "broadcast rank " << r;
  }
}

}  // namespace gradsync::gdr_link_world
