// Host reduction loops: element-wise combine of two buffers of any gradsync DataType.
//
// Numeric rules (the contract in gradsync/gradsync.h, same on every path):
// - float32, float64: native arithmetic.
// - float16, bfloat16: both inputs converted to float32, combined in float32, rounded to
//   nearest even once when stored (kernels/half.h).
// - integers: sum and prod wrap in two's complement; min/max compare as the type (signed or
//   unsigned).
// - min/max propagate NaN: if either input is NaN the result is NaN (the first NaN input,
//   quieted when stored as float16/bfloat16). min/max of +0 and -0 may return either zero.
// - kAvg is a sum while reducing; the division by the world size happens once, in
//   reduce_final or finish_avg: (a+b)/world computed in float32 (float32, float16, bfloat16)
//   or float64 (float64), rounded once when stored; integers divide the wrapped sum by
//   world, truncating toward zero (-7/2 = -3).
//
// Aliasing: an output may be the same buffer as an input (out == a or out == b, element i
// over element i: in-place collectives); partially overlapping buffers are not allowed.
// Preconditions: `type` and `op` are valid values (the communicator validates them; unknown
// values leave the output untouched); world >= 1 (smaller counts as 1: no division).
//
// The loops are simple indexed loops that GCC vectorises at -O3 (host_reduce_loops.h); on
// x86-64 a second copy built for AVX2+F16C is picked at run time where the CPU has both.
#pragma once

#include <cstddef>

#include "gradsync/gradsync.h"

namespace gradsync::kernels {

// out[i] = op(a[i], b[i]) for i < n; kAvg sums.
void reduce(DataType type, ReduceOp op, void* out, const void* a, const void* b, size_t n);

// The last reduction step of a collective: v = op(a[i], b[i]), for kAvg (a[i]+b[i])/world;
// v goes to out1[i] and, when out2 is not null, to out2[i] (the user's buffer and the
// outgoing slot in one pass). out1 may alias a or b; out2 must not alias anything.
void reduce_final(DataType type, ReduceOp op, void* out1, void* out2, const void* a,
                  const void* b, size_t n, int world);

// buf[i] /= world for kAvg results with no final reduction step (e.g. world size 1).
void finish_avg(DataType type, void* buf, size_t n, int world);

// The loop set in use: "avx2" or "generic" (baseline ISA, portable float16 converters).
const char* loop_set();
// Forces the generic loops even where AVX2 is available, for every thread: tests and
// benchmarks only.
void use_generic_loops_only(bool on);

}  // namespace gradsync::kernels
