// The GPUDirect RDMA path's ring schedule (gpu/gdr_schedule.h), run on host memory: every
// rank's steps, with messages as byte vectors handed to the next rank in order. Checks that
// each message a rank receives is the one its previous rank sent for that step (same length,
// same piece) and that every collective's output equals the reference, for world sizes 2..6,
// counts with empty segments, primes and many pieces, in and out of place. No GPU needed: the
// GPU code (gpu/gdr_ring.cc) turns the same steps into kernels and RDMA writes.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "gpu/gdr_schedule.h"

namespace gradsync {
namespace {

using gdr::Body;
using gdr::Step;

// int64 sum (exact) or max, and the avg rule (sum, divided once at the end, toward zero).
int64_t combine(ReduceOp op, int64_t a, int64_t b) { return op == ReduceOp::kMax ? std::max(a, b) : a + b; }

struct Rank {
  std::vector<int64_t> send, recv;  // the call's buffers (may be one buffer: in place)
  std::vector<Step> steps;
  size_t next = 0;                                 // next step
  std::deque<std::vector<int64_t>> inbox;          // messages from the previous rank
};

// Runs one call on n ranks; fills out[r] with rank r's recv buffer.
void simulate(CollectiveKind kind, ReduceOp op, size_t count, int n, int root, size_t per, bool inplace,
              std::vector<std::vector<int64_t>>* out, std::vector<std::vector<int64_t>>* inputs) {
  const size_t in_len = kind == CollectiveKind::kReduceScatter ? count * n : count;
  const size_t out_len = kind == CollectiveKind::kAllGather ? count * n : count;
  std::vector<Rank> ranks(n);
  inputs->assign(n, {});
  for (int r = 0; r < n; ++r) {
    Rank& k = ranks[r];
    std::vector<int64_t> in(in_len);
    for (size_t i = 0; i < in_len; ++i) in[i] = int64_t(r + 1) * 1000003 + int64_t(i) * 7 - 50;
    (*inputs)[r] = in;
    k.recv.assign(out_len, INT64_MIN);
    k.send = in;
    k.steps = gdr::plan(kind, count, n, r, root, per);
  }
  // In place: the host API's layouts (reduce_scatter's recv inside send at rank*count,
  // all_gather's send inside recv at rank*count, allreduce and broadcast the same buffer).
  // Simulated by reading input from `send` and, where the layouts share memory, writing the
  // output through to the shared elements of `send` too.
  auto input_at = [&](Rank& k, size_t i) -> int64_t& { return k.send[i]; };
  size_t progress = 1;
  while (progress) {
    progress = 0;
    for (int r = 0; r < n; ++r) {
      Rank& k = ranks[r];
      if (k.next == k.steps.size()) continue;
      const Step& st = k.steps[k.next];
      if (st.recv && k.inbox.empty()) continue;
      std::vector<int64_t> in;
      if (st.recv) {
        in = std::move(k.inbox.front());
        k.inbox.pop_front();
        ASSERT_EQ(in.size(), st.len) << "rank " << r << " step " << k.next << ": message of another length";
      }
      std::vector<int64_t> msg(st.len);
      for (size_t i = 0; i < st.len; ++i) {
        int64_t v = 0;
        switch (st.body) {
          case Body::kCopyIn: v = input_at(k, st.in + i); break;
          case Body::kReduce: v = combine(op, in[i], input_at(k, st.in + i)); break;
          case Body::kReduceFinal:
            v = combine(op, in[i], input_at(k, st.in + i));
            if (op == ReduceOp::kAvg) v /= n;
            k.recv[st.out + i] = v;
            break;
          case Body::kGatherFirst:
            v = input_at(k, st.in + i);
            k.recv[st.out + i] = v;
            break;
          case Body::kCopyOut:
            v = in[i];
            k.recv[st.out + i] = v;
            break;
        }
        msg[i] = v;
        if (inplace && kind != CollectiveKind::kReduceScatter && kind != CollectiveKind::kAllGather) {
          // Same buffer: a written output element is what later steps read as input. The
          // schedule must never read an element after overwriting it with a partial result.
          if (st.body == Body::kReduceFinal || st.body == Body::kCopyOut) k.send[st.out + i] = k.recv[st.out + i];
        }
      }
      if (st.send) ranks[(r + 1) % n].inbox.push_back(std::move(msg));
      ++k.next;
      progress = 1;
    }
  }
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(ranks[r].next, ranks[r].steps.size()) << "rank " << r << " stuck at step " << ranks[r].next;
    ASSERT_TRUE(ranks[r].inbox.empty()) << "rank " << r << " was sent messages it never read";
  }
  out->clear();
  for (auto& k : ranks) out->push_back(k.recv);
}

struct Case {
  int n;
  size_t count;
  size_t per;
};

class GdrSchedule : public ::testing::TestWithParam<Case> {};

TEST_P(GdrSchedule, EveryCollectiveMatchesTheReference) {
  const auto [n, count, per] = GetParam();
  std::vector<std::vector<int64_t>> out, in;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
    for (bool inplace : {false, true}) {
      simulate(CollectiveKind::kAllreduce, op, count, n, 0, per, inplace, &out, &in);
      for (size_t i = 0; i < count; ++i) {
        int64_t want = in[0][i];
        for (int r = 1; r < n; ++r) want = combine(op, want, in[r][i]);
        if (op == ReduceOp::kAvg) want /= n;
        for (int r = 0; r < n; ++r) ASSERT_EQ(out[r][i], want) << "allreduce rank " << r << " element " << i;
      }
    }
    simulate(CollectiveKind::kReduceScatter, op, count, n, 0, per, false, &out, &in);
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < count; ++i) {
        const size_t at = size_t(r) * count + i;
        int64_t want = in[0][at];
        for (int q = 1; q < n; ++q) want = combine(op, want, in[q][at]);
        if (op == ReduceOp::kAvg) want /= n;
        ASSERT_EQ(out[r][i], want) << "reduce_scatter rank " << r << " element " << i;
      }
    }
  }
  simulate(CollectiveKind::kAllGather, ReduceOp::kSum, count, n, 0, per, false, &out, &in);
  for (int r = 0; r < n; ++r) {
    for (int q = 0; q < n; ++q) {
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(out[r][size_t(q) * count + i], in[q][i]) << "all_gather rank " << r << " segment " << q;
      }
    }
  }
  for (int root = 0; root < n; ++root) {
    simulate(CollectiveKind::kBroadcast, ReduceOp::kSum, count, n, root, per, true, &out, &in);
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < count; ++i) {
        const int64_t want = r == root ? INT64_MIN : in[root][i];  // the root's recv is its input
        if (r != root) ASSERT_EQ(out[r][i], want) << "broadcast root " << root << " rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, GdrSchedule,
                         ::testing::Values(Case{2, 1, 4}, Case{2, 13, 4}, Case{3, 1, 4}, Case{3, 2, 1},
                                           Case{3, 1031, 16}, Case{4, 3, 1}, Case{4, 5003, 64},
                                           Case{5, 7, 2}, Case{5, 1000, 1000}, Case{6, 97, 5},
                                           Case{2, 4096, 1024}, Case{8, 64, 3}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.n) + "_count" +
                                  std::to_string(info.param.count) + "_per" + std::to_string(info.param.per);
                         });

TEST(GdrScheduleShape, EmptyAndSingleRankHaveNoSteps) {
  EXPECT_TRUE(gdr::plan(CollectiveKind::kAllreduce, 0, 4, 1, 0, 8).empty());
  EXPECT_TRUE(gdr::plan(CollectiveKind::kAllreduce, 100, 1, 0, 0, 8).empty());
}

// Every rank sends as many messages as the next one receives, piece-major, each at most `per`.
TEST(GdrScheduleShape, SendsMatchTheNextRanksReceives) {
  for (CollectiveKind kind : {CollectiveKind::kAllreduce, CollectiveKind::kReduceScatter,
                              CollectiveKind::kAllGather, CollectiveKind::kBroadcast}) {
    const int n = 5;
    for (int r = 0; r < n; ++r) {
      std::vector<size_t> sent, received;
      for (const Step& s : gdr::plan(kind, 101, n, r, 2, 8)) {
        EXPECT_LE(s.len, 8u);
        EXPECT_GT(s.len, 0u);
        if (s.send) sent.push_back(s.len);
      }
      for (const Step& s : gdr::plan(kind, 101, n, (r + 1) % n, 2, 8)) {
        if (s.recv) received.push_back(s.len);
      }
      EXPECT_EQ(sent, received) << to_string(kind) << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace gradsync
