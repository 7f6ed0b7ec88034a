#include "kernels/host_reduce.h"

namespace gradsync::kernels {

void sum_f32(float* out, const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void sum2_f32(float* out1, float* out2, const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float v = a[i] + b[i];
    out1[i] = v;
    out2[i] = v;
  }
}

}  // namespace gradsync::kernels
