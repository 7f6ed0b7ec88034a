// Host reduction kernels: every type x op for reduce, reduce_final and finish_avg on both
// loop sets (generic and, where the CPU has it, AVX2+F16C), against references computed here.
//
// References and tolerances:
// - floats: exact (bitwise; NaN matches any NaN). The reference computes in a format with at
//   least 2p+2 bits (double for float32/16-bit types, binary128 for float64) and rounds to
//   the result type: for + * / such double rounding equals rounding once (Figueroa), so it
//   reproduces the contract's "combine in float32 (float64), round once" exactly. 16-bit
//   types then round that float with half.h, itself checked here against bit patterns and an
//   independent double-based rounding (and _Float16 where the compiler has it).
// - integers: exact, against __int128 arithmetic reduced modulo 2^bits; avg divides the
//   wrapped sum truncating toward zero (C++ integer division).
// - min/max: NaN if either input is NaN; +0 and -0 count as equal (either may be returned).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/half.h"
#include "kernels/host_reduce.h"

namespace gradsync::kernels {
namespace {

template <class To, class From>
To bits_as(From f) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &f, sizeof t);
  return t;
}

// ---- independent 16-bit references (double arithmetic, no bit tricks) -------------------

double ref_half_to_double(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double mag = e == 0 ? std::ldexp(m, -24)
                     : e == 31 ? (m ? std::numeric_limits<double>::quiet_NaN() : INFINITY)
                               : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

// Rounds x to a binary format with `mant` stored mantissa bits and `ebits` exponent bits
// (IEEE layout, subnormals, ties to even, overflow to infinity); returns its bits.
uint32_t ref_round(double x, int mant, int ebits) {
  const int bias = (1 << (ebits - 1)) - 1;
  const uint32_t sign = std::signbit(x) ? 1u << (mant + ebits) : 0u;
  const uint32_t inf = ((1u << ebits) - 1) << mant;
  const double a = std::fabs(x);
  if (a == INFINITY) return sign | inf;
  int e;
  std::frexp(a, &e);               // a = f * 2^e, f in [0.5, 1)
  e = std::max(e - 1, 1 - bias);   // a = m * 2^e, m < 2; subnormals share the lowest exponent
  double q = std::nearbyint(std::ldexp(a, mant - e));  // ties to even (default mode)
  if (q == std::ldexp(1.0, mant + 1)) { q /= 2; ++e; }  // rounded up into the next binade
  if (e > bias) return sign | inf;
  if (q < std::ldexp(1.0, mant)) return sign | uint32_t(q);  // subnormal or zero
  return sign | (uint32_t(e + bias) << mant) | (uint32_t(q) - (1u << mant));
}
uint16_t ref_float_to_half(float f) { return uint16_t(ref_round(f, 10, 5)); }
uint16_t ref_float_to_bf16(float f) { return uint16_t(ref_round(f, 7, 8)); }

TEST(Half, KnownBitPatterns) {
  EXPECT_EQ(half_to_float(0x3C00), 1.0f);
  EXPECT_EQ(half_to_float(0xC000), -2.0f);
  EXPECT_EQ(half_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(half_to_float(0x7C00), INFINITY);
  EXPECT_EQ(half_to_float(0xFC00), -INFINITY);
  EXPECT_EQ(half_to_float(0x0001), 5.9604644775390625e-8f);  // 2^-24
  EXPECT_EQ(half_to_float(0x03FF), 6.0975551605224609375e-5f);  // largest subnormal
  EXPECT_EQ(half_to_float(0x0400), 6.103515625e-5f);  // 2^-14
  EXPECT_EQ(bits_as<uint32_t>(half_to_float(0x8000)), 0x80000000u);
  EXPECT_TRUE(std::isnan(half_to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(half_to_float(0x7C01)));  // signalling NaN stays NaN

  EXPECT_EQ(float_to_half_rne(1.0f), 0x3C00);
  EXPECT_EQ(float_to_half_rne(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_half_rne(65519.99f), 0x7BFF);
  EXPECT_EQ(float_to_half_rne(65520.0f), 0x7C00);  // tie between 65504 and 2^16: to even = inf
  EXPECT_EQ(float_to_half_rne(1e6f), 0x7C00);
  EXPECT_EQ(float_to_half_rne(-INFINITY), 0xFC00);
  EXPECT_EQ(float_to_half_rne(-0.0f), 0x8000);
  EXPECT_EQ(float_to_half_rne(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_half_rne(std::ldexp(1.0f, -25)), 0x0000);  // tie 0 / 1 ulp -> 0
  EXPECT_EQ(float_to_half_rne(std::ldexp(3.0f, -25)), 0x0002);  // tie 1 / 2 -> 2
  EXPECT_EQ(float_to_half_rne(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(float_to_half_rne(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(float_to_half_rne(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie -> even (down)
  EXPECT_EQ(float_to_half_rne(1.0f + std::ldexp(3.0f, -11)), 0x3C02);  // tie -> even (up)
  EXPECT_EQ(float_to_half_rne(std::ldexp(2047.0f, -25)), 0x0400);  // subnormal rounds to normal
  const uint16_t qnan = float_to_half_rne(bits_as<float>(0xFFC00000u));
  EXPECT_EQ(qnan, 0xFE00);  // sign kept, quiet
  const uint16_t snan = float_to_half_rne(bits_as<float>(0x7F800001u));
  EXPECT_EQ(snan & 0x7E00, 0x7E00);  // signalling NaN comes out quiet NaN

  EXPECT_EQ(float_to_bf16_rne(1.0f), 0x3F80);
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(float_to_bf16_rne(bits_as<float>(0x3F808000u)), 0x3F80);  // tie -> even (down)
  EXPECT_EQ(float_to_bf16_rne(bits_as<float>(0x3F818000u)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(float_to_bf16_rne(bits_as<float>(0x3F808001u)), 0x3F81);
  EXPECT_EQ(float_to_bf16_rne(bits_as<float>(0x7F7FFFFFu)), 0x7F80);  // FLT_MAX -> inf
  EXPECT_EQ(float_to_bf16_rne(bits_as<float>(0x00010000u)), 0x0001);  // subnormal
  EXPECT_EQ(float_to_bf16_rne(bits_as<float>(0x7FC00001u)), 0x7FC0);
  EXPECT_EQ(float_to_bf16_rne(bits_as<float>(0xFF800001u)), 0xFFC0);  // sNaN: quiet, sign kept
  EXPECT_EQ(float_to_bf16_rne(-INFINITY), 0xFF80);
}

TEST(Half, AllHalvesAndSampledFloatsMatchReference) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const double ref = ref_half_to_double(uint16_t(h));
    const float f = half_to_float(uint16_t(h));
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_EQ(float_to_half_rne(f) & 0xFE00, (h & 0x8000) | 0x7E00) << h;  // quiet, signed
      continue;
    }
    ASSERT_EQ(double(f), ref) << std::hex << h;
    ASSERT_EQ(float_to_half_rne(f), h) << std::hex << h;  // round trip
    const uint16_t b = uint16_t(h);
    ASSERT_EQ(float_to_bf16_rne(bf16_to_float(b)), b) << std::hex << h;
  }
  // Floats: a stride through all bit patterns, plus every float16 rounding boundary
  // (midpoints between neighbours) and its float neighbours.
  std::vector<float> probe;
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 4093) probe.push_back(bits_as<float>(uint32_t(u)));
  for (uint32_t h = 0; h < 0x7C00; ++h) {
    const float mid = float((ref_half_to_double(uint16_t(h)) + ref_half_to_double(uint16_t(h + 1))) / 2);
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      probe.push_back(v);
      probe.push_back(-v);
    }
  }
  for (float v : probe) {
    if (std::isnan(v)) continue;
    ASSERT_EQ(float_to_half_rne(v), ref_float_to_half(v)) << std::hexfloat << v;
    ASSERT_EQ(float_to_bf16_rne(v), ref_float_to_bf16(v)) << std::hexfloat << v;
#ifdef __FLT16_MAX__  // GCC/Clang _Float16: a third, compiler-provided reference
    const _Float16 c = static_cast<_Float16>(v);
    ASSERT_EQ(float_to_half_rne(v), bits_as<uint16_t>(c)) << std::hexfloat << v;
#endif
  }
}

// ---- reductions ---------------------------------------------------------------------------

enum class Kind { kF32, kF64, kF16, kBF16, kInt };

const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax,
                         ReduceOp::kAvg};
const char* op_name(ReduceOp op) {
  const char* names[] = {"sum", "prod", "min", "max", "avg"};
  return names[int(op)];
}

// Integer reference: exact in __int128, wrapped to S (two's complement, modulo 2^bits).
template <class S>
S wrap(__int128 v) {
  using U = std::make_unsigned_t<S>;
  return bits_as<S>(static_cast<U>(static_cast<unsigned __int128>(v)));
}

template <class D>
D ref_minmax(ReduceOp op, D a, D b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<D>::quiet_NaN();
  return op == ReduceOp::kMin ? std::min(a, b) : std::max(a, b);
}

// op(a, b) as the contract says; world > 0: reduce_final (kAvg divides), world == 0: reduce.
// float64 reference arithmetic: 113-bit binary128, wide enough (>= 2*53+2) for rounding to
// double afterwards to be exact; x87 long double (64 bits) is not.
#if defined(__x86_64__) || defined(__i386__)
using Quad = __float128;
#else
using Quad = long double;  // binary128 on aarch64 / ppc64le Linux
static_assert(std::numeric_limits<long double>::digits >= 108);
#endif

template <class S>
S ref_combine(Kind kind, ReduceOp op, S a, S b, int world) {
  const bool divide = op == ReduceOp::kAvg && world > 0;
  if (op == ReduceOp::kAvg) op = ReduceOp::kSum;
  if constexpr (std::is_integral_v<S> && sizeof(S) == 2) {  // float16 / bfloat16
    const double x = kind == Kind::kF16 ? ref_half_to_double(a) : double(bf16_to_float(a));
    const double y = kind == Kind::kF16 ? ref_half_to_double(b) : double(bf16_to_float(b));
    float r = op == ReduceOp::kSum ? float(x + y) : op == ReduceOp::kProd ? float(x * y)
                                                                         : float(ref_minmax(op, x, y));
    if (divide) r = float(double(r) / world);
    return kind == Kind::kF16 ? float_to_half_rne(r) : float_to_bf16_rne(r);
  } else if constexpr (std::is_integral_v<S>) {
    const __int128 x = a, y = b;
    S r = op == ReduceOp::kSum ? wrap<S>(x + y) : op == ReduceOp::kProd ? wrap<S>(x * y)
          : op == ReduceOp::kMin ? std::min(a, b) : std::max(a, b);
    return divide ? S(int64_t(r) / world) : r;
  } else if constexpr (sizeof(S) == 4) {
    const double x = a, y = b;
    float r = op == ReduceOp::kSum ? float(x + y) : op == ReduceOp::kProd ? float(x * y)
                                                                         : float(ref_minmax(op, x, y));
    return divide ? float(double(r) / world) : r;
  } else {
    const Quad x = a, y = b;
    double r = op == ReduceOp::kSum ? double(x + y) : op == ReduceOp::kProd ? double(x * y)
                                                                           : ref_minmax(op, a, b);
    return divide ? double(Quad(r) / world) : r;
  }
}

template <class S>
S ref_divide(Kind kind, S v, int world) {
  if constexpr (std::is_integral_v<S> && sizeof(S) == 2) {
    if (kind == Kind::kInt) return S(v / world);
    const double x = kind == Kind::kF16 ? ref_half_to_double(v) : double(bf16_to_float(v));
    const float r = float(x / world);
    return kind == Kind::kF16 ? float_to_half_rne(r) : float_to_bf16_rne(r);
  } else if constexpr (std::is_integral_v<S>) {
    return S(int64_t(v) / world);
  } else if constexpr (sizeof(S) == 4) {
    return float(double(v) / world);
  } else {
    return double(Quad(v) / world);
  }
}

template <class S>
bool is_nan(Kind kind, S v) {
  if constexpr (std::is_floating_point_v<S>) return std::isnan(v);
  else if constexpr (sizeof(S) == 2) return kind != Kind::kInt && std::isnan(kind == Kind::kF16 ? half_to_float(v) : bf16_to_float(v));
  else return false;
}

template <class S>
bool is_zero(Kind kind, S v) {
  if constexpr (std::is_floating_point_v<S>) return v == 0;
  else if constexpr (sizeof(S) == 2) return kind != Kind::kInt && (v & 0x7fff) == 0;
  else return false;
}

// Bitwise equal; NaN equals NaN; ±0 equal when zero_sign_free.
template <class S>
bool matches(Kind kind, S got, S want, bool zero_sign_free) {
  if (is_nan(kind, got) || is_nan(kind, want)) return is_nan(kind, got) && is_nan(kind, want);
  if (zero_sign_free && is_zero(kind, got) && is_zero(kind, want)) return true;
  return std::memcmp(&got, &want, sizeof(S)) == 0;
}

// Random inputs without NaN: integers over their full range; floats a mix of small integers,
// values near 1, wide exponents, zeros, infinities and (float16/bfloat16) any bit pattern.
template <class S>
std::vector<S> random_values(Kind kind, size_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<S> v(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng();
    if constexpr (std::is_floating_point_v<S>) {
      const int pick = int(r % 8);
      const double u = double(r >> 11) / double(1ull << 53) * 2 - 1;  // [-1, 1)
      v[i] = pick < 3 ? S(int(r >> 40) % 129 - 64)
             : pick < 6 ? S(u)
             : pick < 7 ? S(std::ldexp(u, int((r >> 8) % 61) - 30))
                        : S(std::array<double, 4>{0.0, -0.0, INFINITY, -INFINITY}[(r >> 8) % 4]);
    } else if constexpr (sizeof(S) == 2) {
      S h = S(r);
      if (is_nan(kind, h)) h = S(h & 0x8000);
      v[i] = h;
    } else {
      v[i] = S(r);
    }
  }
  return v;
}

constexpr size_t kGuard = 8;        // elements past n that must stay untouched
constexpr uint8_t kPoison = 0xA5;

template <class S>
std::vector<S> poisoned(size_t n) {
  std::vector<S> v(n + kGuard);
  std::memset(v.data(), kPoison, v.size() * sizeof(S));
  return v;
}

template <class S>
void expect_guard(const std::vector<S>& v, size_t n) {
  const auto* p = reinterpret_cast<const uint8_t*>(v.data() + n);
  for (size_t i = 0; i < kGuard * sizeof(S); ++i) ASSERT_EQ(p[i], kPoison) << "wrote past n";
}

template <class S>
void expect_all(Kind kind, const S* got, const std::vector<S>& want, bool zero_sign_free,
                const char* what) {
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!matches(kind, got[i], want[i], zero_sign_free) && bad++ < 3) {
      ADD_FAILURE() << what << " i=" << i << " got " << +got[i] << " want " << +want[i];
    }
  }
  ASSERT_EQ(bad, 0u) << what;
}

template <class S>
void check_type(DataType type, Kind kind) {
  const size_t kLengths[] = {0, 1, 15, 1025, 1000003};
  const int kWorlds[] = {1, 2, 3, 5, 8};
  for (bool generic : {true, false}) {
    use_generic_loops_only(generic);
    SCOPED_TRACE(loop_set());
    for (ReduceOp op : kOps) {
      SCOPED_TRACE(op_name(op));
      const bool zsf = op == ReduceOp::kMin || op == ReduceOp::kMax;
      for (size_t n : kLengths) {
        SCOPED_TRACE(n);
        const auto a = random_values<S>(kind, n, uint32_t(n * 31 + int(op)));
        const auto b = random_values<S>(kind, n, uint32_t(n * 17 + int(op) + 1000));
        std::vector<S> want(n);
        for (size_t i = 0; i < n; ++i) want[i] = ref_combine(kind, op, a[i], b[i], 0);

        auto out = poisoned<S>(n);
        reduce(type, op, out.data(), a.data(), b.data(), n);
        expect_all(kind, out.data(), want, zsf, "reduce");
        expect_guard(out, n);
        auto in_a = a, in_b = b;  // out == a, out == b
        reduce(type, op, in_a.data(), in_a.data(), b.data(), n);
        expect_all(kind, in_a.data(), want, zsf, "reduce out==a");
        reduce(type, op, in_b.data(), a.data(), in_b.data(), n);
        expect_all(kind, in_b.data(), want, zsf, "reduce out==b");

        for (int world : kWorlds) {
          if (n == 1000003 && world != 3) continue;  // the long case once is enough
          SCOPED_TRACE(world);
          for (size_t i = 0; i < n; ++i) want[i] = ref_combine(kind, op, a[i], b[i], world);
          auto o1 = poisoned<S>(n), o2 = poisoned<S>(n);
          reduce_final(type, op, o1.data(), o2.data(), a.data(), b.data(), n, world);
          expect_all(kind, o1.data(), want, zsf, "final out1");
          expect_all(kind, o2.data(), want, zsf, "final out2");
          expect_guard(o1, n);
          expect_guard(o2, n);
          auto fa = a;  // out1 == a, no out2
          reduce_final(type, op, fa.data(), nullptr, fa.data(), b.data(), n, world);
          expect_all(kind, fa.data(), want, zsf, "final out1==a");
          auto fb = b;  // out1 == b, with out2
          auto o3 = poisoned<S>(n);
          reduce_final(type, op, fb.data(), o3.data(), a.data(), fb.data(), n, world);
          expect_all(kind, fb.data(), want, zsf, "final out1==b");
          expect_all(kind, o3.data(), want, zsf, "final out1==b, out2");

          if (op == ReduceOp::kAvg) {
            std::vector<S> buf = a;
            for (size_t i = 0; i < n; ++i) want[i] = ref_divide(kind, a[i], world);
            finish_avg(type, buf.data(), n, world);
            expect_all(kind, buf.data(), want, false, "finish_avg");
          }
        }
      }
    }
  }
  use_generic_loops_only(false);
}

TEST(HostReduce, Float32) { check_type<float>(DataType::kFloat32, Kind::kF32); }
TEST(HostReduce, Float64) { check_type<double>(DataType::kFloat64, Kind::kF64); }
TEST(HostReduce, Float16) { check_type<uint16_t>(DataType::kFloat16, Kind::kF16); }
TEST(HostReduce, BFloat16) { check_type<uint16_t>(DataType::kBFloat16, Kind::kBF16); }
TEST(HostReduce, Int8) { check_type<int8_t>(DataType::kInt8, Kind::kInt); }
TEST(HostReduce, UInt8) { check_type<uint8_t>(DataType::kUInt8, Kind::kInt); }
TEST(HostReduce, Int32) { check_type<int32_t>(DataType::kInt32, Kind::kInt); }
TEST(HostReduce, Int64) { check_type<int64_t>(DataType::kInt64, Kind::kInt); }

// ---- named cases -------------------------------------------------------------------------

template <class F>
void on_both_loop_sets(F f) {
  for (bool generic : {true, false}) {
    use_generic_loops_only(generic);
    SCOPED_TRACE(loop_set());
    f();
  }
  use_generic_loops_only(false);
}

template <class S>
S one(DataType t, ReduceOp op, S a, S b, int world = 0) {  // world 0: reduce
  S out{};
  if (world == 0) reduce(t, op, &out, &a, &b, 1);
  else reduce_final(t, op, &out, nullptr, &a, &b, 1, world);
  return out;
}

TEST(HostReduce, IntegersWrap) {
  on_both_loop_sets([] {
    EXPECT_EQ(one<int8_t>(DataType::kInt8, ReduceOp::kSum, 127, 1), -128);
    EXPECT_EQ(one<int8_t>(DataType::kInt8, ReduceOp::kProd, -128, -1), -128);
    EXPECT_EQ(one<uint8_t>(DataType::kUInt8, ReduceOp::kProd, 255, 2), 254);
    EXPECT_EQ(one<uint8_t>(DataType::kUInt8, ReduceOp::kSum, 255, 1), 0);
    EXPECT_EQ(one<uint8_t>(DataType::kUInt8, ReduceOp::kMax, 255, 1), 255);  // unsigned compare
    EXPECT_EQ(one<int8_t>(DataType::kInt8, ReduceOp::kMin, -128, 1), -128);   // signed compare
    EXPECT_EQ(one<int32_t>(DataType::kInt32, ReduceOp::kSum, INT32_MAX, 1), INT32_MIN);
    EXPECT_EQ(one<int32_t>(DataType::kInt32, ReduceOp::kProd, 65536, 65536), 0);
    EXPECT_EQ(one<int64_t>(DataType::kInt64, ReduceOp::kSum, INT64_MAX, 1), INT64_MIN);
    EXPECT_EQ(one<int64_t>(DataType::kInt64, ReduceOp::kProd, INT64_MIN, -1), INT64_MIN);
    EXPECT_EQ(one<int64_t>(DataType::kInt64, ReduceOp::kProd, int64_t{1} << 32, int64_t{1} << 32), 0);
    EXPECT_EQ(one<int64_t>(DataType::kInt64, ReduceOp::kMin, INT64_MIN, INT64_MAX), INT64_MIN);
  });
}

TEST(HostReduce, IntegerAvgTruncatesTowardZeroAfterWrapping) {
  on_both_loop_sets([] {
    EXPECT_EQ(one<int32_t>(DataType::kInt32, ReduceOp::kAvg, -3, -4, 2), -3);  // -7/2
    EXPECT_EQ(one<int32_t>(DataType::kInt32, ReduceOp::kAvg, 3, 4, 2), 3);
    EXPECT_EQ(one<int64_t>(DataType::kInt64, ReduceOp::kAvg, -3, -4, 2), -3);
    EXPECT_EQ(one<int8_t>(DataType::kInt8, ReduceOp::kAvg, -3, -4, 2), -3);
    EXPECT_EQ(one<int8_t>(DataType::kInt8, ReduceOp::kAvg, 100, 100, 2), -28);  // wrapped -56
    EXPECT_EQ(one<uint8_t>(DataType::kUInt8, ReduceOp::kAvg, 200, 100, 3), 14);  // 44/3
    EXPECT_EQ(one<int32_t>(DataType::kInt32, ReduceOp::kAvg, INT32_MIN, 0, 7), INT32_MIN / 7);
    EXPECT_EQ(one<int32_t>(DataType::kInt32, ReduceOp::kAvg, INT32_MAX, 0, 3), INT32_MAX / 3);
    EXPECT_EQ(one<int32_t>(DataType::kInt32, ReduceOp::kAvg, -3, -4, 0), -7);  // reduce: a sum
    int32_t v[3] = {-7, 7, -1};
    finish_avg(DataType::kInt32, v, 3, 2);
    EXPECT_EQ(v[0], -3);
    EXPECT_EQ(v[1], 3);
    EXPECT_EQ(v[2], 0);
    int64_t w = INT64_MIN;
    finish_avg(DataType::kInt64, &w, 1, 3);
    EXPECT_EQ(w, INT64_MIN / 3);
  });
}

TEST(HostReduce, MinMaxPropagateNaN) {
  on_both_loop_sets([] {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const double dnan = std::numeric_limits<double>::quiet_NaN();
    for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
      SCOPED_TRACE(op_name(op));
      // Long enough for the vector loops, with NaN on either side at a few positions.
      const size_t n = 37;
      std::vector<float> a(n, 1.0f), b(n, 2.0f), o(n);
      std::vector<double> da(n, 1.0), db(n, 2.0), dout(n);
      std::vector<uint16_t> ha(n, 0x3C00), hb(n, 0x4000), ho(n), ba(n, 0x3F80), bb(n, 0x4000), bo(n);
      for (size_t i : {size_t{0}, size_t{9}, size_t{33}}) { a[i] = nan; da[i] = dnan; ha[i] = 0x7E00; ba[i] = 0x7FC0; }
      for (size_t i : {size_t{1}, size_t{9}, size_t{34}}) { b[i] = nan; db[i] = dnan; hb[i] = 0xFE00; bb[i] = 0xFFC0; }
      reduce(DataType::kFloat32, op, o.data(), a.data(), b.data(), n);
      reduce(DataType::kFloat64, op, dout.data(), da.data(), db.data(), n);
      reduce(DataType::kFloat16, op, ho.data(), ha.data(), hb.data(), n);
      reduce(DataType::kBFloat16, op, bo.data(), ba.data(), bb.data(), n);
      for (size_t i = 0; i < n; ++i) {
        const bool want_nan = i == 0 || i == 1 || i == 9 || i == 33 || i == 34;
        const float want = op == ReduceOp::kMin ? 1.0f : 2.0f;
        EXPECT_EQ(std::isnan(o[i]), want_nan) << i;
        EXPECT_EQ(std::isnan(dout[i]), want_nan) << i;
        EXPECT_EQ(std::isnan(half_to_float(ho[i])), want_nan) << i;
        EXPECT_EQ(std::isnan(bf16_to_float(bo[i])), want_nan) << i;
        if (!want_nan) {
          EXPECT_EQ(o[i], want);
          EXPECT_EQ(dout[i], want);
          EXPECT_EQ(half_to_float(ho[i]), want);
          EXPECT_EQ(bf16_to_float(bo[i]), want);
        }
      }
    }
  });
}

// float16 NaNs pass through two conversions; both loop sets must give the same bits (quiet
// bit set, sign and payload kept), like half.h does.
TEST(HostReduce, Float16NaNBitsSameOnBothLoopSets) {
  const std::vector<uint16_t> nans = {0x7C01, 0x7D00, 0x7E00, 0x7E01, 0x7FFF, 0xFC01, 0xFE55};
  std::vector<uint16_t> a, b;
  for (int rep = 0; rep < 3; ++rep) {  // 21 elements: vector body and scalar tail
    for (uint16_t h : nans) { a.push_back(h); b.push_back(0x3C00); }
  }
  std::vector<std::vector<uint16_t>> got;
  on_both_loop_sets([&] {
    std::vector<uint16_t> o(a.size());
    reduce(DataType::kFloat16, ReduceOp::kMax, o.data(), a.data(), b.data(), a.size());
    got.push_back(o);
  });
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(got[0][i], float_to_half_rne(half_to_float(a[i]))) << std::hex << a[i];
    EXPECT_EQ(got[0][i], a[i] | 0x0200) << std::hex << a[i];
  }
  EXPECT_EQ(got[0], got[1]);
}

TEST(HostReduce, HalfRoundsOncePerStep) {
  on_both_loop_sets([] {
    // 2048 + 1 is a float16 tie (ulp 2 there): rounds to even, 2048.
    EXPECT_EQ(one<uint16_t>(DataType::kFloat16, ReduceOp::kSum, 0x6800, 0x3C00), 0x6800);
    // 2048 + 3 = 2051, tie between 2050 and 2052: to even, 2052 (0x6802).
    EXPECT_EQ(one<uint16_t>(DataType::kFloat16, ReduceOp::kSum, 0x6800, 0x4200), 0x6802);
    // 65504 + 16 = 65520 overflows to inf; avg divides the float sum before rounding: 32760.
    EXPECT_EQ(one<uint16_t>(DataType::kFloat16, ReduceOp::kSum, 0x7BFF, 0x4C00), 0x7C00);
    EXPECT_EQ(one<uint16_t>(DataType::kFloat16, ReduceOp::kAvg, 0x7BFF, 0x4C00, 2),
              float_to_half_rne(32760.0f));
    // bfloat16: 1 + 2^-8 is a tie (ulp 2^-7): to even, 1.0.
    EXPECT_EQ(one<uint16_t>(DataType::kBFloat16, ReduceOp::kSum, 0x3F80, 0x3B80), 0x3F80);
    // finish_avg with world 1 leaves the buffer alone.
    uint16_t h[2] = {0x3C01, 0x7E00};
    finish_avg(DataType::kFloat16, h, 2, 1);
    EXPECT_EQ(h[0], 0x3C01);
    EXPECT_EQ(h[1], 0x7E00);
  });
}

TEST(HostReduce, ReportsLoopSet) {
  const std::string set = loop_set();
  EXPECT_TRUE(set == "avx2" || set == "generic") << set;
  std::printf("loop set on this CPU: %s\n", set.c_str());
  use_generic_loops_only(true);
  EXPECT_STREQ(loop_set(), "generic");
  use_generic_loops_only(false);
}

}  // namespace
}  // namespace gradsync::kernels
