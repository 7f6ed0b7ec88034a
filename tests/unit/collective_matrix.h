// The collectives test matrix, shared by the ranks-as-threads tests (tests/unit, over shared
// memory channels) and the multi-daemon tests (tests/verbs, over the verbs transport). A World
// has `int size()` and `std::vector<Status> collective(std::vector<CollectiveCall>)`, which
// runs calls[r] on rank r and returns every rank's status.
//
// Inputs are chosen so that the exact result is representable: floating types get small
// integers (sums, products, min/max exact in float16 and bfloat16 too), so every result
// must equal the reference exactly; integer types get full-range values to exercise wrap.
// avg of floating types is checked against float32(sum)/world rounded to the type (float64
// for float64), as documented; avg of integers against the wrapped sum / world toward zero.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "collectives/collective.h"
#include "kernels/half.h"

namespace gradsync::testing {

inline bool is_float(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16;
}

// The value of element i of rank r's input, as a double (floats) or int64 (integers).
inline double float_input(int r, size_t i, ReduceOp op) {
  uint32_t h = uint32_t(r) * 2654435761u ^ uint32_t(i) * 40503u;
  if (op == ReduceOp::kProd) return (h % 3 == 0) ? 2.0 : (h % 3 == 1 ? 1.0 : -1.0);
  return double(int(h % 7) - 3);
}
inline int64_t int_input(int r, size_t i) {
  uint64_t x = (uint64_t(r) + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t(i) + 7) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return int64_t(x);
}

// Stores a value into a buffer of type t (integers truncate to the type's width: wrap).
inline void store(DataType t, void* buf, size_t i, double f, int64_t v) {
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
inline int64_t load_int(DataType t, int64_t v) {
  switch (t) {
    case DataType::kInt8: return int8_t(uint8_t(v));
    case DataType::kUInt8: return uint8_t(v);
    case DataType::kInt32: return int32_t(uint32_t(v));
    default: return v;
  }
}

// Fills buf (count elements) with rank r's input; element offset `first` into the pattern.
inline void fill(DataType t, ReduceOp op, void* buf, int r, size_t count, size_t first = 0) {
  for (size_t i = 0; i < count; ++i) store(t, buf, i, float_input(r, first + i, op), int_input(r, first + i));
}

// The reduction of element i over n ranks, stored into buf as type t.
inline void expect_into(DataType t, ReduceOp op, int n, void* buf, size_t slot, size_t i) {
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

inline const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                           DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64};
inline const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};
// 0, 1, primes, and sizes that are not multiples of the 4 KiB test slot in any type.
inline const size_t kCounts[] = {0, 1, 13, 1031, 5003};

// memcmp and memcpy of n bytes where n may be 0 (an empty vector's data() may be null, which
// the C library's functions do not accept even for 0 bytes).
inline bool same_bytes(const void* a, const void* b, size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

// Every rank's output must equal the reference byte for byte.
inline void check_all(int n, const std::vector<std::vector<uint8_t>>& out, const std::vector<uint8_t>& want,
                      const std::string& what) {
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(out[r].size(), want.size());
    if (!same_bytes(out[r].data(), want.data(), want.size())) {
      size_t b = 0;
      while (out[r][b] == want[b]) ++b;
      FAIL() << what << ": rank " << r << " differs from the reference at byte " << b;
    }
  }
}

// Allreduce: every type x op x count, out-of-place and in place.
template <typename World>
void allreduce_matrix(World& world, Algorithm algo) {
  const int n = world.size();
  for (DataType t : kTypes) {
    for (ReduceOp op : kOps) {
      for (size_t count : kCounts) {
        size_t es = element_size(t);
        for (bool inplace : {false, true}) {
          std::vector<std::vector<uint8_t>> in(n, std::vector<uint8_t>(count * es)),
              out(n, std::vector<uint8_t>(count * es, 0xEE));
          std::vector<CollectiveCall> calls(n);
          for (int r = 0; r < n; ++r) {
            fill(t, op, in[r].data(), r, count);
            if (inplace) out[r] = in[r];
            calls[r] = {CollectiveKind::kAllreduce, inplace ? out[r].data() : in[r].data(), out[r].data(),
                        count, t, op, 0, algo, 0};
          }
          std::vector<uint8_t> want(count * es);
          for (size_t i = 0; i < count; ++i) expect_into(t, op, n, want.data(), i, i);
          auto st = world.collective(calls);
          std::string what = std::string("allreduce ") + to_string(t) + " " + to_string(op) + " count " +
                             std::to_string(count) + (inplace ? " in-place" : "");
          for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << what << " rank " << r << ": " << st[r].to_string();
          check_all(n, out, want, what);
        }
      }
    }
  }
}

// Reduce-scatter (every op), all-gather and broadcast (every root), every type and count;
// with the tree algorithm, which only allreduce and barrier have, the refusal and a barrier.
template <typename World>
void reduce_scatter_all_gather_broadcast_matrix(World& world, Algorithm algo) {
  const int n = world.size();
  if (algo == Algorithm::kTree) {
    // Tree is defined for allreduce and barrier; the others refuse it before sending.
    CollectiveCall c{CollectiveKind::kAllGather, nullptr, nullptr, 0, DataType::kFloat32, ReduceOp::kSum, 0,
                     Algorithm::kTree, 0};
    EXPECT_EQ(validate(c, n, 0).code(), Code::kInvalidArgument);
    std::vector<CollectiveCall> barrier(n, CollectiveCall{CollectiveKind::kBarrier, nullptr, nullptr, 1,
                                                            DataType::kUInt8, ReduceOp::kSum, 0, Algorithm::kTree, 0});
    std::vector<uint8_t> tokens(n);
    for (int r = 0; r < n; ++r) barrier[r].send = barrier[r].recv = &tokens[r];
    auto st = world.collective(barrier);
    for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    return;
  }
  for (DataType t : kTypes) {
    size_t es = element_size(t);
    for (size_t count : kCounts) {
      // Reduce-scatter, each op, out-of-place and in place (recv = send + rank * count).
      for (ReduceOp op : kOps) {
        for (bool inplace : {false, true}) {
          std::vector<std::vector<uint8_t>> in(n, std::vector<uint8_t>(n * count * es)), out(n);
          std::vector<CollectiveCall> calls(n);
          for (int r = 0; r < n; ++r) {
            fill(t, op, in[r].data(), r, n * count);
            out[r].assign(count * es, 0xEE);
            void* recv = inplace ? in[r].data() + size_t(r) * count * es : out[r].data();
            calls[r] = {CollectiveKind::kReduceScatter, in[r].data(), recv, count, t, op, 0, algo, 0};
          }
          auto st = world.collective(calls);
          std::string what = std::string("reduce_scatter ") + to_string(t) + " " + to_string(op) +
                             " count " + std::to_string(count) + (inplace ? " in-place" : "");
          for (int r = 0; r < n; ++r) {
            ASSERT_TRUE(st[r].ok()) << what << ": " << st[r].to_string();
            if (inplace) copy_bytes(out[r].data(), in[r].data() + size_t(r) * count * es, count * es);
            std::vector<uint8_t> want(count * es);
            for (size_t i = 0; i < count; ++i) expect_into(t, op, n, want.data(), i, size_t(r) * count + i);
            ASSERT_TRUE(same_bytes(out[r].data(), want.data(), want.size())) << what << " rank " << r;
          }
        }
      }
      // All-gather, out-of-place and in place (send = recv + rank * count).
      for (bool inplace : {false, true}) {
        std::vector<std::vector<uint8_t>> in(n, std::vector<uint8_t>(count * es)),
            out(n, std::vector<uint8_t>(n * count * es, 0xEE));
        std::vector<CollectiveCall> calls(n);
        std::vector<uint8_t> want(n * count * es);
        for (int r = 0; r < n; ++r) {
          fill(t, ReduceOp::kSum, in[r].data(), r, count);
          copy_bytes(want.data() + size_t(r) * count * es, in[r].data(), count * es);
          const void* send = in[r].data();
          if (inplace) {
            copy_bytes(out[r].data() + size_t(r) * count * es, in[r].data(), count * es);
            send = out[r].data() + size_t(r) * count * es;
          }
          calls[r] = {CollectiveKind::kAllGather, send, out[r].data(), count, t, ReduceOp::kSum, 0, algo, 0};
        }
        auto st = world.collective(calls);
        for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << st[r].to_string();
        check_all(n, out, want, std::string("all_gather ") + to_string(t) + " count " + std::to_string(count));
      }
      // Broadcast from every root.
      for (int root = 0; root < n; ++root) {
        std::vector<std::vector<uint8_t>> buf(n, std::vector<uint8_t>(count * es, 0xEE));
        fill(t, ReduceOp::kSum, buf[root].data(), root, count);
        std::vector<uint8_t> want = buf[root];
        std::vector<CollectiveCall> calls(n);
        for (int r = 0; r < n; ++r) {
          calls[r] = {CollectiveKind::kBroadcast, buf[r].data(), buf[r].data(), count, t, ReduceOp::kSum, root, algo, 0};
        }
        auto st = world.collective(calls);
        for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << st[r].to_string();
        check_all(n, buf, want, std::string("broadcast ") + to_string(t) + " root " + std::to_string(root));
      }
    }
  }
}

}  // namespace gradsync::testing
