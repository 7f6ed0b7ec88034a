// bench/gpu_data.h: the rows' inputs, expected results and checks.
#include "bench/gpu_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "bench/element_types.h"

namespace bench {
namespace {

bool is_float(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16;
}

// Rank r's input element k (of one period). Every partial reduction stays a small integer:
// exact in float16 and bfloat16 (integers to 256) and inside int8 and uint8 for up to 32 ranks,
// so the result must be bit-exact whatever order the ranks are combined in.
double value(DataType t, ReduceOp op, int r, int n, uint64_t k) {
  const bool sgn = t != DataType::kUInt8;
  const int64_t m = std::max(2, 96 / n);  // sum: |sum over ranks| <= 96
  const uint64_t ur = uint64_t(r);
  switch (op) {
    case ReduceOp::kSum: {
      const int64_t v = int64_t((k * 7 + ur * 13 + 5) % uint64_t(m));
      return double(sgn ? v - m / 2 : v);
    }
    case ReduceOp::kAvg: {
      // a on every rank, +b and -b on ranks 2j and 2j+1 (0 on an odd last rank): the sum is
      // n * a, so the average a is exact for integers (no rounding direction involved).
      const int64_t a = int64_t((k * 5 + 3) % uint64_t(m)) + (sgn ? -m / 2 : 2);
      int64_t b = int64_t((k + ur / 2) % 3);
      if (r % 2 == 1)
        b = -b;
      else if (r == n - 1)
        b = 0;
      return double(a + b);
    }
    case ReduceOp::kProd: {
      // 1..3 on rank k % n, +-1 elsewhere: |product| <= 3.
      int64_t v = (k % uint64_t(n) == ur) ? int64_t(1 + k % 3) : 1;
      if (sgn && (k * 3 + ur) % 4 == 0) v = -v;
      return double(v);
    }
    case ReduceOp::kMin:
    case ReduceOp::kMax: {
      const int64_t v = int64_t((k * 7 + ur * 13 + 5) % 61);
      return double(sgn ? v - 30 : v);
    }
  }
  return 0;
}

// Unit roundoff of the floating types.
double unit_roundoff(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return 0x1p-24;
    case DataType::kFloat64:
      return 0x1p-53;
    case DataType::kFloat16:
      return 0x1p-11;
    case DataType::kBFloat16:
      return 0x1p-8;
    default:
      return 0;
  }
}

constexpr size_t kPeriod = size_t(1) << 16;  // the inputs repeat every kPeriod elements

}  // namespace

// Fills row.in (this rank's input, repeated every `period` elements of the whole send
// buffer, so that reduce_scatter's segments differ) and one period of the expected result:
// the reduction (allreduce, reduce_scatter), or every rank's input (the others, whose inputs
// follow the sum pattern: small integers that differ between ranks).
void make_data(Row& w, int rank, int n) {
  const size_t p = std::max<size_t>(1, std::min(kPeriod, w.send_elems));
  w.period = p;
  std::vector<uint8_t> period(p * w.esize);
  w.want.assign(p, 0);
  w.tol.assign(p, 0);
  w.inputs.clear();
  if (!reduces(w.collective)) {
    const int source = w.collective == Collective::kBroadcast ? w.root : rank;
    w.inputs.assign(size_t(n), std::vector<double>(p));
    with_type(w.type, [&](auto tag) {
      using T = decltype(tag);
      T* mine = reinterpret_cast<T*>(period.data());
      for (int r = 0; r < n; ++r) {
        for (size_t k = 0; k < p; ++k) {
          w.inputs[size_t(r)][k] = value(w.type, ReduceOp::kSum, r, n, k);
          if (r == source) mine[k] = Codec<T>::encode(w.inputs[size_t(r)][k]);
        }
      }
    });
  }
  with_type(w.type, [&](auto tag) {
    using T = decltype(tag);
    T* mine = reinterpret_cast<T*>(period.data());
    for (size_t k = 0; k < p && reduces(w.collective); ++k) {
      double acc = w.op == ReduceOp::kProd ? 1 : 0, mag = 0;
      for (int r = 0; r < n; ++r) {
        const double x = value(w.type, w.op, r, n, k);
        if (r == rank) mine[k] = Codec<T>::encode(x);
        fold_reference(w.op, r, x, acc, mag);
      }
      if (w.op == ReduceOp::kAvg) {
        acc /= n;
        // Floating avg may divide before summing (NCCL multiplies each input by 1/n), which
        // is inexact unless n is a power of two: a few roundings per rank. Exact otherwise.
        if (is_float(w.type)) w.tol[k] = 4.0 * n * unit_roundoff(w.type) * std::max(1.0, mag / n);
      }
      w.want[k] = acc;
    }
  });
  const size_t send_bytes = w.send_elems * w.esize, pb = p * w.esize;
  w.in.resize(send_bytes);
  for (size_t off = 0; off < send_bytes; off += pb) {
    std::memcpy(w.in.data() + off, period.data(), std::min(pb, send_bytes - off));
  }
}

// Elements of got (the recv buffer, recv_elems of them) that differ from the expected result.
size_t count_wrong(const Row& w, const void* got) {
  return with_type(w.type, [&](auto tag) {
    using T = decltype(tag);
    const T* g = static_cast<const T*>(got);
    const size_t p = w.period;
    size_t wrong = 0;
    for (size_t i = 0; i < w.recv_elems; ++i) {
      double want = 0, tol = 0;
      switch (w.collective) {
        case Collective::kReduceScatter: {  // this rank's segment of the reduction
          const size_t k = (size_t(w.rank) * w.count + i) % p;
          want = w.want[k];
          tol = w.tol[k];
          break;
        }
        case Collective::kAllGather:  // segment q is rank q's input
          want = w.inputs[i / w.count][(i % w.count) % p];
          break;
        case Collective::kBroadcast:
          want = w.inputs[size_t(w.root)][i % p];
          break;
        default:
          want = w.want[i % p];
          tol = w.tol[i % p];
          break;
      }
      if (!(std::abs(Codec<T>::decode(g[i]) - want) <= tol)) ++wrong;  // NaN is wrong too
    }
    return wrong;
  });
}

// Elements of got (a send buffer) that are not bit-equal to this rank's input.
size_t count_changed(const Row& w, const uint8_t* got) {
  if (std::memcmp(got, w.in.data(), w.in.size()) == 0) return 0;
  size_t changed = 0;
  for (size_t i = 0; i < w.send_elems; ++i) {
    changed += std::memcmp(got + i * w.esize, w.in.data() + i * w.esize, w.esize) != 0;
  }
  return changed;
}

// row.out = a device buffer's worth (alloc bytes) of v (exact in every type).
void fill_constant(Row& w, int v) {
  w.out.resize(w.alloc);
  with_type(w.type, [&](auto tag) {
    using T = decltype(tag);
    std::fill_n(reinterpret_cast<T*>(w.out.data()), w.alloc / w.esize, Codec<T>::encode(v));
  });
}

#ifdef GRADSYNC_BENCH_NCCL
ncclDataType_t nccl_type(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kUInt8:
      return ncclUint8;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kProd:
      return ncclProd;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kAvg:
      return ncclAvg;
  }
  return ncclSum;
}
#endif

}  // namespace bench
