#include "bench/data.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bench/element_types.h"

namespace bench {
namespace {

using gradsync::DataType;
using gradsync::ReduceOp;

// Relative tolerance per rank in the reduction, against sum(|x|) for sum/avg and |result| for
// prod. Each reduction step rounds once to the type (unit roundoff u = 2^-24, 2^-53, 2^-11,
// 2^-8), so the error stays below (world-1) * u * scale; the margins below are 2-100x that,
// loose enough for any summation order (ring, tree) and still far below the O(1) error of a
// misplaced or missing element. min/max must be exact. Integers are exact.
template <class T>
double rel_tol() {
  if constexpr (std::is_same_v<T, float>) return 1e-5;
  if constexpr (std::is_same_v<T, double>) return 1e-12;
  if constexpr (std::is_same_v<T, Half>) return 1e-3;
  if constexpr (std::is_same_v<T, BHalf>) return 8e-3;
  return 0;
}


uint64_t mix(uint64_t z) {  // splitmix64's finalizer: counter-based, so any element is O(1)
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
uint64_t rank_key(const DataSpec& d, int rank) {
  return mix(d.seed + kGolden * uint64_t(rank + 1));
}
uint64_t raw(uint64_t key, size_t i) { return mix(key + kGolden * (uint64_t(i) + 1)); }

// Floats: uniform in [-1, 1), or magnitudes in [0.5, 1.5) with random sign for prod so that
// products over many ranks stay far from overflow and underflow.
double gen_float(uint64_t r, ReduceOp op) {
  double u = double(r >> 11) * 0x1p-53;
  if (op == ReduceOp::kProd) return (r & 1) ? -(0.5 + u) : 0.5 + u;
  return 2 * u - 1;
}

// Rank's input element i as stored in T. Integers use the full range: sums and products wrap.
template <class T>
T input(uint64_t key, size_t i, ReduceOp op) {
  if constexpr (kIsFloat<T>)
    return Codec<T>::encode(gen_float(raw(key, i), op));
  else
    return static_cast<T>(raw(key, i));
}

template <class T>
size_t wrong_reduced(const DataSpec& d, size_t first, size_t count, const T* got) {
  std::vector<uint64_t> keys;
  for (int r = 0; r < d.world; ++r) keys.push_back(rank_key(d, r));
  const ReduceOp op = d.op;
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    const size_t e = first + i;
    if constexpr (kIsFloat<T>) {
      double acc = op == ReduceOp::kProd ? 1 : 0, mag = 0;
      for (int r = 0; r < d.world; ++r) {
        double x = Codec<T>::decode(input<T>(keys[r], e, op));
        fold_reference(op, r, x, acc, mag);
      }
      if (op == ReduceOp::kAvg) acc /= d.world, mag /= d.world;
      if (op == ReduceOp::kProd) mag = std::abs(acc);
      double v = Codec<T>::decode(got[i]);
      if (!(std::abs(v - acc) <= rel_tol<T>() * d.world * mag)) ++wrong;  // NaN is wrong too
    } else {
      // Reference in 64-bit two's complement, then wrapped to T like the runtime does.
      uint64_t acc = op == ReduceOp::kProd ? 1 : 0;
      int64_t best = 0;
      for (int r = 0; r < d.world; ++r) {
        T x = input<T>(keys[r], e, op);
        acc = op == ReduceOp::kProd ? acc * uint64_t(int64_t(x)) : acc + uint64_t(int64_t(x));
        if (r == 0 || (op == ReduceOp::kMin ? int64_t(x) < best : int64_t(x) > best)) best = x;
      }
      int64_t want = (op == ReduceOp::kMin || op == ReduceOp::kMax) ? best : int64_t(T(acc));
      if (op == ReduceOp::kAvg) want /= d.world;  // wrapped sum, rounded toward zero
      if (int64_t(got[i]) != want) ++wrong;
    }
  }
  return wrong;
}

template <class T>
size_t wrong_copy(const DataSpec& d, int src, size_t first, size_t count, const T* got) {
  const uint64_t key = rank_key(d, src);
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    T want = input<T>(key, first + i, d.op);
    if (std::memcmp(&want, &got[i], sizeof(T)) != 0) ++wrong;
  }
  return wrong;
}

}  // namespace

void fill_input(const DataSpec& d, int rank, size_t first, size_t count, void* buf) {
  with_type(d.type, [&](auto tag) {
    using T = decltype(tag);
    const uint64_t key = rank_key(d, rank);
    T* out = static_cast<T*>(buf);
    for (size_t i = 0; i < count; ++i) out[i] = input<T>(key, first + i, d.op);
  });
}

void fill_constant(DataType type, int v, size_t count, void* buf) {
  with_type(type, [&](auto tag) {
    using T = decltype(tag);
    T x;
    if constexpr (kIsFloat<T>)
      x = Codec<T>::encode(v);
    else
      x = static_cast<T>(v);
    T* out = static_cast<T*>(buf);
    for (size_t i = 0; i < count; ++i) out[i] = x;
  });
}

size_t count_wrong_reduced(const DataSpec& d, size_t first, size_t count, const void* got) {
  return with_type(d.type, [&](auto tag) {
    using T = decltype(tag);
    return wrong_reduced<T>(d, first, count, static_cast<const T*>(got));
  });
}

size_t count_wrong_copy(const DataSpec& d, int src_rank, size_t first, size_t count,
                        const void* got) {
  return with_type(d.type, [&](auto tag) {
    using T = decltype(tag);
    return wrong_copy<T>(d, src_rank, first, count, static_cast<const T*>(got));
  });
}

}  // namespace bench
