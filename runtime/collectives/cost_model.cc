#include "collectives/cost_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace gradsync {

CostModel CostModel::prior(int world_size) {
  // One hop through shared memory with a futex wake-up costs a few microseconds; host memory
  // copies run at a few GB/s per rank. Only the ratio between the algorithms matters here.
  constexpr double kHopUs = 5.0;
  constexpr double kUsPerByte = 1.0 / 2000.0;  // 2 GB/s
  const double n = std::max(world_size, 2);
  CostModel m;
  m.alpha_us[0] = 2 * (n - 1) * kHopUs;
  m.beta_us_per_byte[0] = 2 * (n - 1) / n * kUsPerByte;
  m.alpha_us[1] = 2 * std::ceil(std::log2(n)) * kHopUs;
  m.beta_us_per_byte[1] = 2 * kUsPerByte;
  return m;
}

void CostModel::fit(int algo, size_t small_bytes, double small_us, size_t large_bytes, double large_us) {
  double beta = (large_us - small_us) / double(large_bytes - small_bytes);
  beta = std::max(beta, 0.0);
  alpha_us[algo] = std::max(small_us - beta * double(small_bytes), 0.0);
  beta_us_per_byte[algo] = beta;
}

double CostModel::predict_us(Algorithm algo, size_t bytes) const {
  int i = algo == Algorithm::kTree ? 1 : 0;
  return alpha_us[i] + beta_us_per_byte[i] * double(bytes);
}

Algorithm CostModel::choose(size_t bytes) const {
  return predict_us(Algorithm::kTree, bytes) < predict_us(Algorithm::kRing, bytes) ? Algorithm::kTree
                                                                                    : Algorithm::kRing;
}

std::string CostModel::describe() const {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "%s: ring alpha=%.1f us beta=%.3f us/KiB (%.2f GB/s); tree alpha=%.1f us "
                "beta=%.3f us/KiB (%.2f GB/s)",
                measured ? "measured" : "prior", alpha_us[0], beta_us_per_byte[0] * 1024,
                beta_us_per_byte[0] > 0 ? 1e-3 / beta_us_per_byte[0] : 0.0, alpha_us[1],
                beta_us_per_byte[1] * 1024, beta_us_per_byte[1] > 0 ? 1e-3 / beta_us_per_byte[1] : 0.0);
  return buf;
}

}  // namespace gradsync
