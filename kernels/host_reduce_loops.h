// The reduction loops behind host_reduce.h, included by one .cc per instruction set
// (host_reduce.cc: baseline x86-64/any CPU; host_reduce_avx2.cc: AVX2+F16C). Internal.
//
// Everything below sits in an anonymous namespace: each including file gets its own copy of
// every instantiation, so the linker can never merge an AVX2 copy into the baseline path.
// (half.h's inline functions live outside it; host_reduce_avx2.cc switches AVX2 on only
// after including half.h, so any out-of-line copy of those is baseline code too.)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gradsync/gradsync.h"
#include "kernels/half.h"

namespace gradsync::kernels {

namespace detail {
// One instruction set's loops. final: the last step of reduce_final (kAvg divides).
struct LoopSet {
  void (*reduce)(DataType, ReduceOp, void* out1, void* out2, const void* a, const void* b,
                 size_t n, int world, bool final);
  void (*finish_avg)(DataType, void* buf, size_t n, int world);
};
LoopSet generic_loops();
LoopSet avx2_loops();  // defined only where host_reduce_avx2.cc is built (x86-64)
}  // namespace detail

namespace {

// Element traits: S is the stored type, C the type the arithmetic happens in. Traits with
// kStaged convert whole blocks (load_n/store_n) instead of one element at a time.
template <class T>
struct Native {
  using S = T;
  using C = T;
  static constexpr bool kStaged = false;
  static C load(S x) { return x; }
  static S store(C x) { return x; }
};
struct BFloat {
  using S = uint16_t;
  using C = float;
  static constexpr bool kStaged = false;
  static C load(S x) { return bf16_to_float(x); }
  static S store(C x) { return float_to_bf16_rne(x); }
};
// float16 through the portable converters, by blocks: converting a block, combining, and
// converting back in separate loops keeps few values live per loop, which measured ~1.4x
// faster than one fused loop with SSE2's 16 registers. (bfloat16 is cheap enough fused;
// hand-written AVX2 bfloat16 conversions measured no faster than GCC's vectorisation.)
struct HalfGeneric {
  using S = uint16_t;
  using C = float;
  static constexpr bool kStaged = true;
  static void load_n(const uint16_t* s, float* d, size_t k) {
    for (size_t j = 0; j < k; ++j) d[j] = half_to_float(s[j]);
  }
  static void store_n(const float* s, uint16_t* d, size_t k) {
    for (size_t j = 0; j < k; ++j) d[j] = float_to_half_rne(s[j]);
  }
};

// Integer sum/prod in the unsigned type (wrapping, no UB); types narrower than unsigned int
// go through unsigned int so that integer promotion cannot make a signed overflow.
template <class T>
using Wide = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

struct Sum {
  template <class C>
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) return C(Wide<C>(a) + Wide<C>(b));
    else return a + b;
  }
};
struct Prod {
  template <class C>
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) return C(Wide<C>(a) * Wide<C>(b));
    else return a * b;
  }
};
// `a != a` is the NaN test: with it the select propagates a NaN from either side (a NaN b
// makes the comparison false, which picks b) and still vectorises to compare+blend.
struct Min {
  template <class C>
  C operator()(C a, C b) const {
    if constexpr (std::is_floating_point_v<C>) return (a < b || a != a) ? a : b;
    else return a < b ? a : b;
  }
};
struct Max {
  template <class C>
  C operator()(C a, C b) const {
    if constexpr (std::is_floating_point_v<C>) return (a > b || a != a) ? a : b;
    else return a > b ? a : b;
  }
};

// v / world. Floats divide natively. x86 has no vector integer division, so the narrow
// integers divide in floating point, which is exact here: the true quotient q = v/world is
// either an integer (representable, so a correctly rounded division returns it) or at least
// 1/world away from one, while the rounding error is at most |q|*2^-24 (float) or |q|*2^-53
// (double), below 1/world since |v| < 2^24 resp. 2^53; truncating the rounded quotient thus
// equals integer division toward zero. int64 divides as an integer (scalar).
template <class C>
struct Divide {
  using D = std::conditional_t<std::is_floating_point_v<C>, C,
                               std::conditional_t<(sizeof(C) == 1), float,
                                                  std::conditional_t<(sizeof(C) == 4), double, C>>>;
  D world;
  explicit Divide(int w) : world(D(w)) {}
  C operator()(C v) const { return C(D(v) / world); }
};

// The combine of reduce_final for kAvg.
template <class C>
struct SumDivide {
  Divide<C> div;
  C operator()(C a, C b) const { return div(Sum{}(a, b)); }
};

// Elements per block: staged conversions and the copy to a second output work on blocks
// that stay in L1.
constexpr size_t kBlock = 1024;

// o[i] = store(f(load(x[i]), load(y[i]))). No __restrict: o may be x or y (same index), which
// vector code handles because each element is loaded before it is stored; GCC adds a
// run-time overlap check that passes for exact aliasing.
template <class Tr, class F>
void combine(typename Tr::S* o, const typename Tr::S* x, const typename Tr::S* y, size_t n, F f) {
  if constexpr (Tr::kStaged) {
    using C = typename Tr::C;
    alignas(64) C cx[kBlock];
    alignas(64) C cy[kBlock];
    for (size_t i = 0; i < n; i += kBlock) {
      const size_t k = std::min(kBlock, n - i);
      Tr::load_n(x + i, cx, k);  // both inputs are read before o is written
      Tr::load_n(y + i, cy, k);
      for (size_t j = 0; j < k; ++j) cx[j] = f(cx[j], cy[j]);
      Tr::store_n(cx, o + i, k);
    }
  } else {
    for (size_t i = 0; i < n; ++i) o[i] = Tr::store(f(Tr::load(x[i]), Tr::load(y[i])));
  }
}

// out1 = combine(a, b), and a copy in out2 when given. Two outputs go block by block:
// combine into out1, then memcpy the block, still in L1, to out2. One loop with two stores
// per element measured 2x slower in cache and ~7% slower at 64 MiB (Xeon, GCC 12).
template <class Tr, class F>
void map2(void* out1, void* out2, const void* a, const void* b, size_t n, F f) {
  using S = typename Tr::S;
  S* o1 = static_cast<S*>(out1);
  S* o2 = static_cast<S*>(out2);
  const S* x = static_cast<const S*>(a);
  const S* y = static_cast<const S*>(b);
  if (o2 == nullptr) return combine<Tr>(o1, x, y, n, f);
  for (size_t i = 0; i < n; i += kBlock) {
    const size_t k = std::min(kBlock, n - i);
    combine<Tr>(o1 + i, x + i, y + i, k, f);
    std::memcpy(o2 + i, o1 + i, k * sizeof(S));
  }
}

template <class Tr>
void map1_divide(void* buf, size_t n, int world) {
  using S = typename Tr::S;
  using C = typename Tr::C;
  S* p = static_cast<S*>(buf);
  const Divide<C> div(world);
  if constexpr (Tr::kStaged) {
    alignas(64) C c[kBlock];
    for (size_t i = 0; i < n; i += kBlock) {
      const size_t k = std::min(kBlock, n - i);
      Tr::load_n(p + i, c, k);
      for (size_t j = 0; j < k; ++j) c[j] = div(c[j]);
      Tr::store_n(c, p + i, k);
    }
  } else {
    for (size_t i = 0; i < n; ++i) p[i] = Tr::store(div(Tr::load(p[i])));
  }
}

template <class Tr>
void reduce_t(ReduceOp op, void* out1, void* out2, const void* a, const void* b, size_t n,
              int world, bool final) {
  using C = typename Tr::C;
  switch (op) {
    case ReduceOp::kSum: return map2<Tr>(out1, out2, a, b, n, Sum{});
    case ReduceOp::kProd: return map2<Tr>(out1, out2, a, b, n, Prod{});
    case ReduceOp::kMin: return map2<Tr>(out1, out2, a, b, n, Min{});
    case ReduceOp::kMax: return map2<Tr>(out1, out2, a, b, n, Max{});
    case ReduceOp::kAvg:
      if (final && world > 1) return map2<Tr>(out1, out2, a, b, n, SumDivide<C>{Divide<C>(world)});
      return map2<Tr>(out1, out2, a, b, n, Sum{});  // a sum while reducing; x/1 == x
  }
}

// Calls f.template operator()<Traits>() with the traits of `type`; Half: the float16 traits
// of this loop set.
template <class Half, class F>
void with_traits(DataType type, F&& f) {
  switch (type) {
    case DataType::kFloat32: return f.template operator()<Native<float>>();
    case DataType::kFloat64: return f.template operator()<Native<double>>();
    case DataType::kFloat16: return f.template operator()<Half>();
    case DataType::kBFloat16: return f.template operator()<BFloat>();
    case DataType::kInt8: return f.template operator()<Native<int8_t>>();
    case DataType::kUInt8: return f.template operator()<Native<uint8_t>>();
    case DataType::kInt32: return f.template operator()<Native<int32_t>>();
    case DataType::kInt64: return f.template operator()<Native<int64_t>>();
  }
}

template <class Half>
void reduce_all(DataType type, ReduceOp op, void* out1, void* out2, const void* a,
                const void* b, size_t n, int world, bool final) {
  with_traits<Half>(type, [&]<class Tr>() { reduce_t<Tr>(op, out1, out2, a, b, n, world, final); });
}

template <class Half>
void finish_avg_all(DataType type, void* buf, size_t n, int world) {
  if (world <= 1) return;  // x/1 == x for every type
  with_traits<Half>(type, [&]<class Tr>() { map1_divide<Tr>(buf, n, world); });
}

}  // namespace
}  // namespace gradsync::kernels
