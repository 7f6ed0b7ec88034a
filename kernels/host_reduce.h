// Host reduction loops. Plain loops over contiguous arrays that the compiler vectorises
// (built with -O3; see kernels/CMakeLists.txt). Outputs may alias inputs element for element
// (in-place collectives), so no __restrict here.
#pragma once

#include <cstddef>

namespace gradsync::kernels {

// out[i] = a[i] + b[i]
void sum_f32(float* out, const float* a, const float* b, size_t n);
// out1[i] = out2[i] = a[i] + b[i]: the reduced chunk goes to the user's buffer and the
// outgoing slot in one pass.
void sum2_f32(float* out1, float* out2, const float* a, const float* b, size_t n);

}  // namespace gradsync::kernels
