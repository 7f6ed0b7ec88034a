// Public entry points: pick the loop set for this CPU once, then call through it.
#include "kernels/host_reduce.h"

#include <atomic>

#if defined(GRADSYNC_KERNELS_AVX2)
#include <cpuid.h>
#endif

#include "kernels/host_reduce_loops.h"

namespace gradsync::kernels {

detail::LoopSet detail::generic_loops() {
  return {&reduce_all<HalfGeneric>, &finish_avg_all<HalfGeneric>};
}

namespace {

std::atomic<bool> g_generic_only{false};

bool cpu_has_avx2_f16c() {
#if defined(GRADSYNC_KERNELS_AVX2)
  // __builtin_cpu_supports("avx2") includes OS support for the AVX register state; F16C is
  // read from CPUID directly (not every compiler's builtin knows "f16c").
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
    return f16c && __builtin_cpu_supports("avx2");
  }();
  return has;
#else
  return false;
#endif
}

detail::LoopSet loops() {
#if defined(GRADSYNC_KERNELS_AVX2)
  if (cpu_has_avx2_f16c() && !g_generic_only.load(std::memory_order_relaxed)) {
    static const detail::LoopSet avx2 = detail::avx2_loops();
    return avx2;
  }
#endif
  static const detail::LoopSet generic = detail::generic_loops();
  return generic;
}

}  // namespace

void reduce(DataType type, ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  loops().reduce(type, op, out, nullptr, a, b, n, 1, false);
}

void reduce_final(DataType type, ReduceOp op, void* out1, void* out2, const void* a,
                  const void* b, size_t n, int world) {
  loops().reduce(type, op, out1, out2, a, b, n, world, true);
}

void finish_avg(DataType type, void* buf, size_t n, int world) {
  loops().finish_avg(type, buf, n, world);
}

const char* loop_set() { return cpu_has_avx2_f16c() && !g_generic_only ? "avx2" : "generic"; }

void use_generic_loops_only(bool on) { g_generic_only = on; }

}  // namespace gradsync::kernels
