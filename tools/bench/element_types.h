// The bench's element types: 16-bit floats as raw bits with exact codecs, and a dispatch
// from DataType to a tag value of the element type. Shared by the host data (data.cc) and the
// GPU bench (gpu.cc).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "gradsync/gradsync.h"

namespace bench {

// 16-bit floats as raw bits. Inputs are made by truncating a float (any representable value
// will do, so no rounding mode is needed); outputs are decoded exactly, subnormals and
// inf/NaN included, so that a wrong result cannot hide in the decoder.
struct Half {
  uint16_t bits;
};
struct BHalf {
  uint16_t bits;
};

template <class T>
struct Codec {  // float, double
  static T encode(double v) { return static_cast<T>(v); }
  static double decode(T x) { return x; }
};
template <>
struct Codec<Half> {
  static Half encode(double v) {
    float f = static_cast<float>(v);
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
    int exp = int((x >> 23) & 0xff) - 127 + 15;
    if (exp <= 0) return {sign};  // below half's normal range: a (signed) zero is exact
    return {static_cast<uint16_t>(sign | (exp << 10) | ((x >> 13) & 0x3ff))};  // |v| < 2 here
  }
  static double decode(Half h) {
    int exp = (h.bits >> 10) & 0x1f, mant = h.bits & 0x3ff;
    double v = exp == 0    ? std::ldexp(mant, -24)
               : exp == 31 ? (mant ? std::numeric_limits<double>::quiet_NaN()
                                   : std::numeric_limits<double>::infinity())
                           : std::ldexp(1024 + mant, exp - 25);
    return (h.bits & 0x8000) ? -v : v;
  }
};
template <>
struct Codec<BHalf> {
  static BHalf encode(double v) {
    float f = static_cast<float>(v);
    uint32_t x;
    std::memcpy(&x, &f, 4);
    return {static_cast<uint16_t>(x >> 16)};
  }
  static double decode(BHalf h) {
    uint32_t x = uint32_t(h.bits) << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
  }
};

template <class T>
constexpr bool kIsFloat =
    std::is_floating_point_v<T> || std::is_same_v<T, Half> || std::is_same_v<T, BHalf>;

// Calls f(T{}) with the element type of `t`.
template <class F>
auto with_type(gradsync::DataType t, F&& f) {
  switch (t) {
    case gradsync::DataType::kFloat32:
      return f(float{});
    case gradsync::DataType::kFloat64:
      return f(double{});
    case gradsync::DataType::kFloat16:
      return f(Half{});
    case gradsync::DataType::kBFloat16:
      return f(BHalf{});
    case gradsync::DataType::kInt8:
      return f(int8_t{});
    case gradsync::DataType::kUInt8:
      return f(uint8_t{});
    case gradsync::DataType::kInt32:
      return f(int32_t{});
    case gradsync::DataType::kInt64:
      return f(int64_t{});
  }
  return f(float{});
}

// One rank's step of a reference reduction in double: acc becomes the fold of the first r + 1
// values (rank 0's value itself for min and max); mag sums |x|, which bounds a sum's rounding.
inline void fold_reference(gradsync::ReduceOp op, int r, double x, double& acc, double& mag) {
  switch (op) {
    case gradsync::ReduceOp::kSum:
    case gradsync::ReduceOp::kAvg:
      acc += x;
      mag += std::abs(x);
      break;
    case gradsync::ReduceOp::kProd:
      acc *= x;
      break;
    case gradsync::ReduceOp::kMin:
      acc = r == 0 ? x : std::min(acc, x);
      break;
    case gradsync::ReduceOp::kMax:
      acc = r == 0 ? x : std::max(acc, x);
      break;
  }
}

}  // namespace bench
