// Every collective x type x op x algorithm on ranks-as-threads, world sizes 1..8, against an
// independent float64/int64 reference, with bitwise identity across ranks.
//
// Inputs are chosen so that the exact result is representable: floating types get small
// integers (sums, products, min/max exact in float16 and bfloat16 too), so every result
// must equal the reference exactly; integer types get full-range values to exercise wrap.
// avg of floating types is checked against float32(sum)/world rounded to the type (float64
// for float64), as documented; avg of integers against the wrapped sum / world toward zero.
#include <gtest/gtest.h>

#include <cstring>
#include <tuple>

#include "kernels/half.h"
#include "thread_world.h"

namespace gradsync {
namespace {

using testing::ThreadWorld;

bool is_float(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16;
}

// The value of element i of rank r's input, as a double (floats) or int64 (integers).
double float_input(int r, size_t i, ReduceOp op) {
  uint32_t h = uint32_t(r) * 2654435761u ^ uint32_t(i) * 40503u;
  if (op == ReduceOp::kProd) return (h % 3 == 0) ? 2.0 : (h % 3 == 1 ? 1.0 : -1.0);
  return double(int(h % 7) - 3);
}
int64_t int_input(int r, size_t i) {
  uint64_t x = (uint64_t(r) + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t(i) + 7) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return int64_t(x);
}

// Stores a value into a buffer of type t (integers truncate to the type's width: wrap).
void store(DataType t, void* buf, size_t i, double f, int64_t v) {
  switch (t) {
    case DataType::kFloat32: static_cast<float*>(buf)[i] = float(f); break;
    case DataType::kFloat64: static_cast<double*>(buf)[i] = f; break;
    case DataType::kFloat16: static_cast<uint16_t*>(buf)[i] = kernels::float_to_half_rne(float(f)); break;
    case DataType::kBFloat16: static_cast<uint16_t*>(buf)[i] = kernels::float_to_bf16_rne(float(f)); break;
    case DataType::kInt8: static_cast<int8_t*>(buf)[i] = int8_t(uint8_t(v)); break;
    case DataType::kUInt8: static_cast<uint8_t*>(buf)[i] = uint8_t(v); break;
    case DataType::kInt32: static_cast<int32_t*>(buf)[i] = int32_t(uint32_t(v)); break;
    case DataType::kInt64: static_cast<int64_t*>(buf)[i] = v; break;
  }
}

// Reads an integer of type t back as int64 (sign- or zero-extended).
int64_t load_int(DataType t, int64_t v) {
  switch (t) {
    case DataType::kInt8: return int8_t(uint8_t(v));
    case DataType::kUInt8: return uint8_t(v);
    case DataType::kInt32: return int32_t(uint32_t(v));
    default: return v;
  }
}

// Fills buf (count elements) with rank r's input; element offset `first` into the pattern.
void fill(DataType t, ReduceOp op, void* buf, int r, size_t count, size_t first = 0) {
  for (size_t i = 0; i < count; ++i) store(t, buf, i, float_input(r, first + i, op), int_input(r, first + i));
}

// The reduction of element i over n ranks, stored into buf as type t.
void expect_into(DataType t, ReduceOp op, int n, void* buf, size_t slot, size_t i) {
  if (is_float(t)) {
    double acc = float_input(0, i, op);
    for (int r = 1; r < n; ++r) {
      double x = float_input(r, i, op);
      acc = op == ReduceOp::kProd ? acc * x : op == ReduceOp::kMin ? std::min(acc, x)
            : op == ReduceOp::kMax ? std::max(acc, x) : acc + x;
    }
    if (op == ReduceOp::kAvg) acc = t == DataType::kFloat64 ? acc / n : double(float(acc) / float(n));
    store(t, buf, slot, acc, 0);
    return;
  }
  int64_t acc = load_int(t, int_input(0, i));
  for (int r = 1; r < n; ++r) {
    int64_t x = load_int(t, int_input(r, i));
    if (op == ReduceOp::kProd) acc = load_int(t, int64_t(uint64_t(acc) * uint64_t(x)));
    else if (op == ReduceOp::kMin) acc = std::min(acc, x);
    else if (op == ReduceOp::kMax) acc = std::max(acc, x);
    else acc = load_int(t, int64_t(uint64_t(acc) + uint64_t(x)));
  }
  if (op == ReduceOp::kAvg) acc = acc / n;  // C++ division truncates toward zero
  store(t, buf, slot, 0, acc);
}

const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                           DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};
// 0, 1, primes, and sizes that are not multiples of the 4 KiB test slot in any type.
const size_t kCounts[] = {0, 1, 13, 1031, 5003};

class CollectivesTest : public ::testing::TestWithParam<std::tuple<int, Algorithm, uint32_t>> {
 protected:
  void SetUp() override {
    auto [n, algo, rings] = GetParam();
    world_ = std::make_unique<ThreadWorld>(n, rings);
    algo_ = algo;
  }
  int n() const { return world_->size(); }

  void check_all(const std::vector<std::vector<uint8_t>>& out, const std::vector<uint8_t>& want,
                 const std::string& what) {
    for (int r = 0; r < n(); ++r) {
      ASSERT_EQ(out[r].size(), want.size());
      if (std::memcmp(out[r].data(), want.data(), want.size()) != 0) {
        size_t b = 0;
        while (out[r][b] == want[b]) ++b;
        FAIL() << what << ": rank " << r << " differs from the reference at byte " << b;
      }
    }
  }

  std::unique_ptr<ThreadWorld> world_;
  Algorithm algo_;
};

TEST_P(CollectivesTest, Allreduce) {
  for (DataType t : kTypes) {
    for (ReduceOp op : kOps) {
      for (size_t count : kCounts) {
        size_t es = element_size(t);
        for (bool inplace : {false, true}) {
          std::vector<std::vector<uint8_t>> in(n(), std::vector<uint8_t>(count * es)),
              out(n(), std::vector<uint8_t>(count * es, 0xEE));
          std::vector<CollectiveCall> calls(n());
          for (int r = 0; r < n(); ++r) {
            fill(t, op, in[r].data(), r, count);
            if (inplace) out[r] = in[r];
            calls[r] = {CollectiveKind::kAllreduce, inplace ? out[r].data() : in[r].data(), out[r].data(),
                        count, t, op, 0, algo_, 0};
          }
          std::vector<uint8_t> want(count * es);
          for (size_t i = 0; i < count; ++i) expect_into(t, op, n(), want.data(), i, i);
          auto st = world_->collective(calls);
          std::string what = std::string("allreduce ") + to_string(t) + " " + to_string(op) + " count " +
                             std::to_string(count) + (inplace ? " in-place" : "");
          for (int r = 0; r < n(); ++r) ASSERT_TRUE(st[r].ok()) << what << " rank " << r << ": " << st[r].to_string();
          check_all(out, want, what);
        }
      }
    }
  }
}

TEST_P(CollectivesTest, ReduceScatterAllGatherBroadcastBarrier) {
  if (algo_ == Algorithm::kTree) {
    // Tree is defined for allreduce and barrier; the others refuse it before sending.
    CollectiveCall c{CollectiveKind::kAllGather, nullptr, nullptr, 0, DataType::kFloat32, ReduceOp::kSum, 0,
                     Algorithm::kTree, 0};
    EXPECT_EQ(validate(c, n(), 0).code(), Code::kInvalidArgument);
    std::vector<CollectiveCall> barrier(n(), CollectiveCall{CollectiveKind::kBarrier, nullptr, nullptr, 1,
                                                            DataType::kUInt8, ReduceOp::kSum, 0, Algorithm::kTree, 0});
    std::vector<uint8_t> tokens(n());
    for (int r = 0; r < n(); ++r) barrier[r].send = barrier[r].recv = &tokens[r];
    auto st = world_->collective(barrier);
    for (int r = 0; r < n(); ++r) ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    return;
  }
  for (DataType t : kTypes) {
    size_t es = element_size(t);
    for (size_t count : kCounts) {
      // Reduce-scatter, each op, out-of-place and in place (recv = send + rank * count).
      for (ReduceOp op : kOps) {
        for (bool inplace : {false, true}) {
          std::vector<std::vector<uint8_t>> in(n(), std::vector<uint8_t>(n() * count * es)), out(n());
          std::vector<CollectiveCall> calls(n());
          for (int r = 0; r < n(); ++r) {
            fill(t, op, in[r].data(), r, n() * count);
            out[r].assign(count * es, 0xEE);
            void* recv = inplace ? in[r].data() + size_t(r) * count * es : out[r].data();
            calls[r] = {CollectiveKind::kReduceScatter, in[r].data(), recv, count, t, op, 0, algo_, 0};
          }
          auto st = world_->collective(calls);
          std::string what = std::string("reduce_scatter ") + to_string(t) + " " + to_string(op) +
                             " count " + std::to_string(count) + (inplace ? " in-place" : "");
          for (int r = 0; r < n(); ++r) {
            ASSERT_TRUE(st[r].ok()) << what << ": " << st[r].to_string();
            if (inplace) std::memcpy(out[r].data(), in[r].data() + size_t(r) * count * es, count * es);
            std::vector<uint8_t> want(count * es);
            for (size_t i = 0; i < count; ++i) expect_into(t, op, n(), want.data(), i, size_t(r) * count + i);
            ASSERT_EQ(0, std::memcmp(out[r].data(), want.data(), want.size())) << what << " rank " << r;
          }
        }
      }
      // All-gather, out-of-place and in place (send = recv + rank * count).
      for (bool inplace : {false, true}) {
        std::vector<std::vector<uint8_t>> in(n(), std::vector<uint8_t>(count * es)),
            out(n(), std::vector<uint8_t>(n() * count * es, 0xEE));
        std::vector<CollectiveCall> calls(n());
        std::vector<uint8_t> want(n() * count * es);
        for (int r = 0; r < n(); ++r) {
          fill(t, ReduceOp::kSum, in[r].data(), r, count);
          std::memcpy(want.data() + size_t(r) * count * es, in[r].data(), count * es);
          const void* send = in[r].data();
          if (inplace) {
            std::memcpy(out[r].data() + size_t(r) * count * es, in[r].data(), count * es);
            send = out[r].data() + size_t(r) * count * es;
          }
          calls[r] = {CollectiveKind::kAllGather, send, out[r].data(), count, t, ReduceOp::kSum, 0, algo_, 0};
        }
        auto st = world_->collective(calls);
        for (int r = 0; r < n(); ++r) ASSERT_TRUE(st[r].ok()) << st[r].to_string();
        check_all(out, want, std::string("all_gather ") + to_string(t) + " count " + std::to_string(count));
      }
      // Broadcast from every root.
      for (int root = 0; root < n(); ++root) {
        std::vector<std::vector<uint8_t>> buf(n(), std::vector<uint8_t>(count * es, 0xEE));
        fill(t, ReduceOp::kSum, buf[root].data(), root, count);
        std::vector<uint8_t> want = buf[root];
        std::vector<CollectiveCall> calls(n());
        for (int r = 0; r < n(); ++r) {
          calls[r] = {CollectiveKind::kBroadcast, buf[r].data(), buf[r].data(), count, t, ReduceOp::kSum, root, algo_, 0};
        }
        auto st = world_->collective(calls);
        for (int r = 0; r < n(); ++r) ASSERT_TRUE(st[r].ok()) << st[r].to_string();
        check_all(buf, want, std::string("broadcast ") + to_string(t) + " root " + std::to_string(root));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                                            ::testing::Values(Algorithm::kRing, Algorithm::kTree),
                                            ::testing::Values(1u, 2u)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param)) + "_rings" +
                                  std::to_string(std::get<2>(info.param));
                         });

TEST(Collectives, MismatchedCountsAreReportedNotReduced) {
  ThreadWorld w(2, 1);
  std::vector<float> a(100, 1), b(200, 1);
  std::vector<CollectiveCall> calls = {
      {CollectiveKind::kAllreduce, a.data(), a.data(), a.size(), DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kRing, 0},
      {CollectiveKind::kAllreduce, b.data(), b.data(), b.size(), DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kRing, 0}};
  auto st = w.collective(calls, std::chrono::seconds(2));
  EXPECT_TRUE(st[0].code() == Code::kMismatch || st[1].code() == Code::kMismatch)
      << st[0].to_string() << " | " << st[1].to_string();
}

TEST(Collectives, MismatchedKindsAreReported) {
  ThreadWorld w(2, 1);
  std::vector<float> a(8, 1), b(16, 1);
  std::vector<CollectiveCall> calls = {
      {CollectiveKind::kAllreduce, a.data(), a.data(), 8, DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kRing, 0},
      {CollectiveKind::kBroadcast, b.data(), b.data(), 8, DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kRing, 0}};
  auto st = w.collective(calls, std::chrono::seconds(2));
  EXPECT_FALSE(st[0].ok());
  EXPECT_FALSE(st[1].ok());
}

TEST(Collectives, MissingPeerTimesOutNamingIt) {
  ThreadWorld w(2, 1);
  std::vector<float> a(10, 1);
  WaitContext wait;
  wait.control = static_cast<const JobControl*>(w.base());
  wait.deadline = deadline_after(std::chrono::milliseconds(300));
  CollectiveCall c{CollectiveKind::kAllreduce, a.data(), a.data(), a.size(), DataType::kFloat32,
                   ReduceOp::kSum, 0, Algorithm::kRing, 0};
  Status s = run_collective(w.links(0), wait, c);
  EXPECT_EQ(s.code(), Code::kDeadlineExceeded);
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.message();
}

TEST(Collectives, AbortWakesWaitersWithTheReason) {
  ThreadWorld w(3, 1);
  std::vector<float> a(10, 1);
  auto t0 = Clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    abort_job(w.base(), w.layout(), 2, "rank 2 (host h) died");
  });
  WaitContext wait;
  wait.control = static_cast<const JobControl*>(w.base());
  wait.deadline = deadline_after(std::chrono::seconds(30));
  CollectiveCall c{CollectiveKind::kAllreduce, a.data(), a.data(), a.size(), DataType::kFloat32,
                   ReduceOp::kSum, 0, Algorithm::kTree, 0};
  Status s = run_collective(w.links(0), wait, c);
  aborter.join();
  EXPECT_EQ(s.code(), Code::kAborted);
  EXPECT_NE(s.message().find("rank 2 (host h) died"), std::string::npos) << s.message();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
}

TEST(Validate, RefusesBadInput) {
  float x[8];
  CollectiveCall ok{CollectiveKind::kAllreduce, x, x, 4, DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kAuto, 0};
  EXPECT_TRUE(validate(ok, 2, 0).ok());
  auto with = [&](auto mutate) { CollectiveCall c = ok; mutate(c); return validate(c, 2, 0).code(); };
  EXPECT_EQ(with([](auto& c) { c.send = nullptr; }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.send = nullptr; c.count = 0; }), Code::kOk);
  EXPECT_EQ(with([](auto& c) { c.count = SIZE_MAX / 2; }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.type = static_cast<DataType>(77); }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.op = static_cast<ReduceOp>(77); }), Code::kInvalidArgument);
  EXPECT_EQ(with([&](auto& c) { c.recv = reinterpret_cast<char*>(x) + 1; }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.kind = CollectiveKind::kBroadcast; c.root = 2; }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.kind = CollectiveKind::kAllGather; c.algorithm = Algorithm::kTree; }),
            Code::kInvalidArgument);
  // reduce_scatter with recv == send on rank 1 would overwrite input still to be sent.
  EXPECT_EQ(validate({CollectiveKind::kReduceScatter, x, x, 4, DataType::kFloat32, ReduceOp::kSum, 0,
                      Algorithm::kRing, 0}, 2, 1).code(), Code::kInvalidArgument);
  EXPECT_TRUE(validate({CollectiveKind::kReduceScatter, x, x + 4, 4, DataType::kFloat32, ReduceOp::kSum, 0,
                        Algorithm::kRing, 0}, 2, 1).ok());
}

TEST(Topology, TreesCoverEveryRankAndAreComplementary) {
  for (int n = 2; n <= 16; ++n) {
    std::vector<uint32_t> ring;
    for (int r = 0; r < n; ++r) ring.push_back(uint32_t((r + 1) % n));
    int interior_in_both = 0;
    for (int r = 0; r < n; ++r) {
      int interior = 0;
      for (uint32_t t = 0; t < kNumTrees; ++t) {
        TreeLinks l = tree_links(ring, uint32_t(r), t);
        if (l.children[0] >= 0) ++interior;
        if (l.parent >= 0) {
          TreeLinks p = tree_links(ring, uint32_t(l.parent), t);
          EXPECT_TRUE(p.children[0] == r || p.children[1] == r) << "n=" << n << " t=" << t << " r=" << r;
        }
      }
      if (interior == 2) ++interior_in_both;
    }
    // At most the middle rank of an odd-sized ring is interior in both trees.
    EXPECT_LE(interior_in_both, 1) << "n=" << n;
  }
}

}  // namespace
}  // namespace gradsync
