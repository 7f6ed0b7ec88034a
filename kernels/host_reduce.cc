#include "kernels/host_reduce.h"

#include <cstdint>
#include <type_traits>

#include "kernels/half.h"

namespace gradsync::kernels {
namespace {

// Element traits: S is the stored type, C the type the arithmetic happens in.
template <class T>
struct Native {
  using S = T;
  using C = T;
  static C load(S x) { return x; }
  static S store(C x) { return x; }
};
struct Half {
  using S = uint16_t;
  using C = float;
  static C load(S x) { return half_to_float(x); }
  static S store(C x) { return float_to_half_rne(x); }
};
struct BFloat {
  using S = uint16_t;
  using C = float;
  static C load(S x) { return bf16_to_float(x); }
  static S store(C x) { return float_to_bf16_rne(x); }
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
// `a != a` is the NaN test: with it the select below propagates a NaN from either side
// (a NaN b makes the comparison false and picks b) and still vectorises to compare+blend.
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
// either an integer (then representable, and a correctly rounded division returns it) or at
// least 1/world away from one, while the rounding error is at most |q|*2^-24 (float) or
// |q|*2^-53 (double) < 1/world because |v| < 2^24 resp. 2^53; so truncating the rounded
// quotient gives the same as integer division toward zero. int64 divides as an integer.
template <class C>
struct Divide {
  using D = std::conditional_t<std::is_floating_point_v<C>, C,
                               std::conditional_t<(sizeof(C) == 1), float,
                                                  std::conditional_t<(sizeof(C) == 4), double, C>>>;
  D world;
  explicit Divide(int w) : world(D(w)) {}
  C operator()(C v) const { return C(D(v) / world); }
};

// Sum, then divide: the combine of reduce_final for kAvg.
template <class C>
struct SumDivide {
  Divide<C> div;
  C operator()(C a, C b) const { return div(Sum{}(a, b)); }
};

// The loops. No __restrict: out may be a or b (same index), which is safe for vector code
// because each element is loaded before it is stored; GCC adds a run-time overlap check.
template <class Tr, class F>
void map2(void* out1, void* out2, const void* a, const void* b, size_t n, F f) {
  using S = typename Tr::S;
  S* o1 = static_cast<S*>(out1);
  S* o2 = static_cast<S*>(out2);
  const S* x = static_cast<const S*>(a);
  const S* y = static_cast<const S*>(b);
  if (o2 == nullptr) {
    for (size_t i = 0; i < n; ++i) o1[i] = Tr::store(f(Tr::load(x[i]), Tr::load(y[i])));
  } else {
    for (size_t i = 0; i < n; ++i) {
      const S v = Tr::store(f(Tr::load(x[i]), Tr::load(y[i])));
      o1[i] = v;
      o2[i] = v;
    }
  }
}

template <class Tr>
void map1_divide(void* buf, size_t n, int world) {
  using S = typename Tr::S;
  S* p = static_cast<S*>(buf);
  const Divide<typename Tr::C> div(world);
  for (size_t i = 0; i < n; ++i) p[i] = Tr::store(div(Tr::load(p[i])));
}

template <class Tr>
void reduce_t(ReduceOp op, void* out1, void* out2, const void* a, const void* b, size_t n,
              int world, bool final) {
  switch (op) {
    case ReduceOp::kSum: return map2<Tr>(out1, out2, a, b, n, Sum{});
    case ReduceOp::kProd: return map2<Tr>(out1, out2, a, b, n, Prod{});
    case ReduceOp::kMin: return map2<Tr>(out1, out2, a, b, n, Min{});
    case ReduceOp::kMax: return map2<Tr>(out1, out2, a, b, n, Max{});
    case ReduceOp::kAvg:
      if (final && world > 1) {
        return map2<Tr>(out1, out2, a, b, n, SumDivide<typename Tr::C>{Divide<typename Tr::C>(world)});
      }
      return map2<Tr>(out1, out2, a, b, n, Sum{});  // x/1 == x
  }
}

// Calls f.template operator()<Traits>() for the traits of `type`.
template <class F>
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

}  // namespace

void reduce(DataType type, ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  with_traits(type, [&]<class Tr>() { reduce_t<Tr>(op, out, nullptr, a, b, n, 1, false); });
}

void reduce_final(DataType type, ReduceOp op, void* out1, void* out2, const void* a,
                  const void* b, size_t n, int world) {
  with_traits(type, [&]<class Tr>() { reduce_t<Tr>(op, out1, out2, a, b, n, world, true); });
}

void finish_avg(DataType type, void* buf, size_t n, int world) {
  if (world <= 1) return;  // x/1 == x for every type
  with_traits(type, [&]<class Tr>() { map1_divide<Tr>(buf, n, world); });
}

}  // namespace gradsync::kernels
