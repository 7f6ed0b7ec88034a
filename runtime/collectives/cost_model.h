// The alpha-beta cost model that picks ring or tree per allreduce (design §4), with a knee:
//   t(algo, bytes) = alpha[algo] + beta_small[algo] * bytes            bytes <= knee
//                  = t(algo, knee) + beta_large[algo] * (bytes - knee)  bytes >  knee
// A single line fits badly on a pipelined algorithm: below a slot per chunk the time is
// nearly flat (hand-offs), above it grows with the bytes moved. Constants are measured on the
// communicator itself right after it is created (ring and tree allreduces at kSizes) and then
// agreed across ranks (the maximum of every rank's figure, by an allreduce), so every rank
// predicts the same and picks the same.
#pragma once

#include <cstddef>
#include <string>

#include "gradsync/gradsync.h"

namespace gradsync {

struct CostModel {
  static constexpr int kPoints = 3;
  static constexpr size_t kSizes[kPoints] = {size_t{1} << 10, size_t{64} << 10, size_t{4} << 20};
  static constexpr size_t kKnee = kSizes[1];

  // Index 0: ring, 1: tree.
  double alpha_us[2] = {0, 0};
  double beta_us_per_byte[2] = {0, 0};        // above the knee
  double beta_small_us_per_byte[2] = {0, 0};  // below the knee
  bool measured = false;

  // A prior for when calibration is switched off (GRADSYNC_TUNE=0): ring pays 2(n-1) hops,
  // the tree 2*log2(n) hops but moves twice the bytes through interior ranks.
  static CostModel prior(int world_size);
  // Fits one algorithm from its times (us) at kSizes.
  void fit(int algo, const double* us);

  double predict_us(Algorithm algo, size_t bytes) const;
  Algorithm choose(size_t bytes) const;
  std::string describe() const;
};

}  // namespace gradsync
