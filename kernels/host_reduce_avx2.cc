// The loops of host_reduce_loops.h built for AVX2 (256-bit vectors, vpcmpgtq for int64
// min/max) and F16C (hardware float16 conversions); picked at run time by host_reduce.cc on
// CPUs that have both. x86-64 only.
//
// The ISA is switched on with a pragma after every shared header, not with -mavx2 on the
// file: inline functions of those headers that GCC emits out of line are then baseline code,
// so the copy the linker keeps is safe on any CPU.
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gradsync/gradsync.h"
#include "kernels/half.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif

#include "kernels/host_reduce_loops.h"

namespace gradsync::kernels {
namespace {

// float16 by blocks through vcvtph2ps/vcvtps2ph, rounding to nearest even by the
// instruction's immediate (not MXCSR). Same results as half.h, NaN included.
struct HalfF16C {
  using S = uint16_t;
  using C = float;
  static constexpr bool kStaged = true;
  static void load_n(const uint16_t* s, float* d, size_t k) {
    size_t j = 0;
    for (; j + 8 <= k; j += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + j));
      _mm256_storeu_ps(d + j, _mm256_cvtph_ps(h));
    }
    for (; j < k; ++j) d[j] = _cvtsh_ss(s[j]);
  }
  static void store_n(const float* s, uint16_t* d, size_t k) {
    constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    size_t j = 0;
    for (; j + 8 <= k; j += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + j), kRne);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + j), h);
    }
    for (; j < k; ++j) d[j] = _cvtss_sh(s[j], kRne);
  }
};

}  // namespace

detail::LoopSet detail::avx2_loops() {
  return {&reduce_all<HalfF16C>, &finish_avg_all<HalfF16C>};
}

}  // namespace gradsync::kernels

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
