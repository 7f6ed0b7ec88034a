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
  m.beta_us_per_byte[0] = m.beta_small_us_per_byte[0] = 2 * (n - 1) / n * kUsPerByte;
  m.alpha_us[1] = 2 * std::ceil(std::log2(n)) * kHopUs;
  m.beta_us_per_byte[1] = m.beta_small_us_per_byte[1] = 2 * kUsPerByte;
  return m;
}

void CostModel::fit(int algo, const double* us) {
  auto slope = [&](int i, int j) {
    return std::max((us[j] - us[i]) / double(kSizes[j] - kSizes[i]), 0.0);
  };
  beta_small_us_per_byte[algo] = slope(0, 1);
  beta_us_per_byte[algo] = slope(1, 2);
  alpha_us[algo] = std::max(us[0] - beta_small_us_per_byte[algo] * double(kSizes[0]), 0.0);
  measured = true;
}

double CostModel::predict_us(Algorithm algo, size_t bytes) const {
  int i = algo == Algorithm::kTree ? 1 : 0;
  double small = double(std::min(bytes, kKnee));
  double large = double(bytes > kKnee ? bytes - kKnee : 0);
  return alpha_us[i] + beta_small_us_per_byte[i] * small + beta_us_per_byte[i] * large;
}

Algorithm CostModel::choose(size_t bytes) const {
  return predict_us(Algorithm::kTree, bytes) < predict_us(Algorithm::kRing, bytes) ? Algorithm::kTree
                                                                                    : Algorithm::kRing;
}

std::string CostModel::describe() const {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "%s: ring alpha=%.1f us beta=%.3f/%.3f us/KiB below/above 64 KiB (%.2f GB/s); "
                "tree alpha=%.1f us beta=%.3f/%.3f us/KiB (%.2f GB/s)",
                measured ? "measured" : "prior", alpha_us[0], beta_small_us_per_byte[0] * 1024,
                beta_us_per_byte[0] * 1024, beta_us_per_byte[0] > 0 ? 1e-3 / beta_us_per_byte[0] : 0.0,
                alpha_us[1], beta_small_us_per_byte[1] * 1024, beta_us_per_byte[1] * 1024,
                beta_us_per_byte[1] > 0 ? 1e-3 / beta_us_per_byte[1] : 0.0);
  return buf;
}

}  // namespace gradsync
