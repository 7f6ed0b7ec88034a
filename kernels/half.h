// float16 (IEEE binary16) and bfloat16 <-> float32 conversions, header-only.
//
// Plain bit manipulation and float arithmetic, no intrinsics, so the header builds for any
// host (and CUDA host code). There are no branches: every case is computed and one is
// picked with a mask (select below), which lets GCC vectorise loops calling these functions
// (host_reduce_loops.h).
//
// Semantics: round to nearest, ties to even; overflow goes to infinity; subnormals are exact
// both ways; infinities keep their sign; NaN stays NaN with its sign and top payload bits and
// comes out quiet (the quiet bit set), as the F16C/AVX-512 conversion instructions do.
//
// float16 conversions let the FPU do the rounding (an add that puts the float16 rounding
// point at the float32 one), so they assume the default rounding mode (to nearest). Every
// float operation works on normal float32 values, or on values whose float16 result is zero
// either way, so FTZ/DAZ do not change the results.
#pragma once

#include <cstdint>
#include <cstring>

namespace gradsync::kernels {

namespace half_detail {
inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// c ? a : b with masks. With a ternary GCC may move the float arithmetic of one case into a
// branch, and (with the default -ftrapping-math) it then does not vectorise the loop.
inline uint32_t select(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}
}  // namespace half_detail

inline uint16_t float_to_half_rne(float f) {
  using namespace half_detail;
  const uint32_t x = bits(f);
  // Signed compares below (ax < 2^31): SSE2 has no unsigned vector compare.
  const int32_t ax = static_cast<int32_t>(x & 0x7fffffffu);
  // |f| * 4 (scaled through 2^112 so that |f| >= 2^16 becomes infinity; the 2^-110 step can
  // only lose values far below the smallest float16 subnormal).
  const float scaled = from_bits(static_cast<uint32_t>(ax)) * 0x1.0p+112f * 0x1.0p-110f;
  // Add 2^(e+15), e = max(exponent of f, -14): the float32 ulp of the sum is then 4 times the
  // float16 ulp of f, so the FPU rounds |f|*4 to float16 precision, ties to even. The sum's
  // low 10 mantissa bits are the float16 mantissa, bit 10 its leading one (which adds 1 to
  // the exponent field below, or makes a subnormal that rounded up normal; a carry out of a
  // full mantissa rounds up to the next binade or infinity).
  const int32_t e = (ax & 0x7f800000) < 0x38800000 ? 0x38800000 : (ax & 0x7f800000);
  const uint32_t sum = bits(from_bits(static_cast<uint32_t>(e) + 0x07800000u) + scaled);
  const uint32_t finite = ((sum >> 13) & 0x7c00u) + (sum & 0x0fffu);
  // NaN: quiet bit set, top payload bits kept.
  const uint32_t nan = 0x7e00u | ((x >> 13) & 0x03ffu);
  return static_cast<uint16_t>(((x >> 16) & 0x8000u) | select(ax > 0x7f800000, nan, finite));
}

inline float half_to_float(uint16_t h) {
  using namespace half_detail;
  const uint32_t em = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent+mantissa, placed
  // Normal, inf, NaN: add 224 to the exponent and scale by 2^-112, i.e. rebias 15 -> 127,
  // and exponent 31 (inf/NaN) becomes 255. Multiplying keeps a NaN's payload.
  const uint32_t normal = bits(from_bits(em + 0x70000000u) * 0x1.0p-112f);
  // Zero/subnormal: (0.5 + m*2^-24) - 0.5, the mantissa m put at the bottom of 0.5's;
  // exact, and the result is a normal float32.
  const uint32_t sub = bits(from_bits((h & 0x7fffu) + 0x3f000000u) - 0.5f);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  return from_bits(sign | select((h & 0x7c00u) == 0, sub, normal));
}

inline uint16_t float_to_bf16_rne(float f) {
  const uint32_t x = half_detail::bits(f);
  // Round the 16 dropped bits to nearest even; a carry into the exponent is correct, up to
  // infinity. NaN would round into infinity or change sign, so it is handled apart: keep
  // sign and top payload bits and set the quiet bit.
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  const uint32_t nan = x | 0x00400000u;
  const bool is_nan = static_cast<int32_t>(x & 0x7fffffffu) > 0x7f800000;
  // Select in 32 bits and shift once: GCC then narrows one vector instead of both cases.
  return static_cast<uint16_t>(half_detail::select(is_nan, nan, rounded) >> 16);
}

inline float bf16_to_float(uint16_t h) {
  return half_detail::from_bits(static_cast<uint32_t>(h) << 16);
}

}  // namespace gradsync::kernels
