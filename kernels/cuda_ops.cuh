// Element traits, the reduction ops and the 16-byte pack, shared by the CUDA kernels
// (cuda_reduce.cu, cuda_node.cu). Device code only: include from .cu files.
//
// The numeric rules are those of cuda_reduce.cuh; this header is where they are written down
// in code, once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "gradsync/gradsync.h"

namespace gradsync::kernels::ops {

// Element size without linking the runtime library (the kernels only include its header);
// 0 for a type outside DataType.
inline size_t esize(DataType type) {
  switch (type) {
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    case DataType::kInt8:
    case DataType::kUInt8: return 1;
  }
  return 0;
}

// Traits and ops are host-callable too (cuda_fp16.h's conversions are), so that a host build
// can check them; the kernels are the only users.
#define HD __host__ __device__
#if defined(__CUDA_ARCH__)
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif

// ---- element traits: S is the stored type, C the type the arithmetic happens in ---------

template <class T>
struct Native {
  using S = T;
  using C = T;
  HD static C load(S x) { return x; }
  HD static S store(C x) { return x; }
};
// 16-bit floats travel as raw uint16_t bits; kQuiet is the quiet bit of a NaN.
struct Half {
  using S = uint16_t;
  using C = float;
  static constexpr uint16_t kQuiet = 0x0200;
  HD static bool is_nan(S h) { return (h & 0x7fffu) > 0x7c00u; }
  HD static C load(S x) { return __half2float(__ushort_as_half(x)); }
  HD static S store(C x) { return __half_as_ushort(__float2half_rn(x)); }
};
struct BFloat {
  using S = uint16_t;
  using C = float;
  static constexpr uint16_t kQuiet = 0x0040;
  HD static bool is_nan(S h) { return (h & 0x7fffu) > 0x7f80u; }
  HD static C load(S x) { return __bfloat162float(__ushort_as_bfloat16(x)); }
  HD static S store(C x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};
template <class Tr>
constexpr bool kIs16BitFloat = std::is_same_v<Tr, Half> || std::is_same_v<Tr, BFloat>;

// Integer sum/prod in the unsigned type (wrapping, no UB), as on the host.
template <class T>
using Wide = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

template <class C>
HD C add(C a, C b) {
  if constexpr (std::is_integral_v<C>) return C(Wide<C>(a) + Wide<C>(b));
  else return a + b;
}
template <class C>
HD C mul(C a, C b) {
  if constexpr (std::is_integral_v<C>) return C(Wide<C>(a) * Wide<C>(b));
  else return a * b;
}
// v / world: floats divide in C (IEEE division, nvcc's default -prec-div=true); integers divide
// truncating toward zero. The host divides 8- and 32-bit integers in float/double, which
// its comment proves equal to integer division; the results are the same.
template <class C>
HD C divide(C v, int world) {
  if constexpr (std::is_floating_point_v<C>) return v / C(world);
  else if constexpr (sizeof(C) < sizeof(int)) return C(int(v) / world);
  else return C(v / C(world));
}

// ---- ops: S x S -> S (binary) and S -> S (finish_avg) ------------------------------------

template <class Tr>
struct OpSum {
  using S = typename Tr::S;
  HD S operator()(S a, S b) const { return Tr::store(add(Tr::load(a), Tr::load(b))); }
};
template <class Tr>
struct OpProd {
  using S = typename Tr::S;
  HD S operator()(S a, S b) const { return Tr::store(mul(Tr::load(a), Tr::load(b))); }
};
// min/max: the host's `(a < b || a != a) ? a : b` (a NaN on the left wins, a NaN on the right
// loses every comparison so it is picked too). Explicit compares and a select, not
// fminf/fmaxf, which return the other operand for a NaN. 16-bit floats: the comparison runs in
// float32 and the chosen input's bits are kept (store(load(x)) == x for every non-NaN x); a
// NaN gets its quiet bit, which is what the host's float round trip gives.
template <class Tr, bool kMax>
struct OpMinMax {
  using S = typename Tr::S;
  HD S operator()(S a, S b) const {
    const auto x = Tr::load(a);
    const auto y = Tr::load(b);
    if constexpr (std::is_integral_v<typename Tr::C>) {
      return (kMax ? x > y : x < y) ? a : b;
    } else {
      S r = ((kMax ? x > y : x < y) || x != x) ? a : b;
      if constexpr (kIs16BitFloat<Tr>) {
        if (Tr::is_nan(r)) r = S(r | Tr::kQuiet);
      }
      return r;
    }
  }
};
// kAvg in reduce_final: the sum in C, divided once, stored once.
template <class Tr>
struct OpSumDivide {
  using S = typename Tr::S;
  int world;
  HD S operator()(S a, S b) const {
    return Tr::store(divide(add(Tr::load(a), Tr::load(b)), world));
  }
};
template <class Tr>
struct OpDivide {
  using S = typename Tr::S;
  int world;
  HD S operator()(S a) const { return Tr::store(divide(Tr::load(a), world)); }
};

// ---- 16 bytes of elements, loaded and stored as one uint4 ----------------------------

template <class S>
union Pack {
  static constexpr int kN = 16 / sizeof(S);
  uint4 v;
  S e[kN];
};

// Calls f.template operator()<Traits>() for `type`; cudaErrorInvalidValue for unknown types.
template <class F>
cudaError_t with_traits(DataType type, F&& f) {
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
  return cudaErrorInvalidValue;
}

}  // namespace gradsync::kernels::ops
