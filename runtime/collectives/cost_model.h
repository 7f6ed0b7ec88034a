// The alpha-beta cost model that picks ring or tree per allreduce (design §4):
//   t(algo, bytes) = alpha[algo] + beta[algo] * bytes
// Constants are measured on the communicator itself right after it is created (a few ring
// and tree allreduces at two sizes) and then agreed across ranks (the maximum of every
// rank's figure, by an allreduce), so every rank predicts the same and picks the same.
#pragma once

#include <cstddef>
#include <string>

#include "gradsync/gradsync.h"

namespace gradsync {

struct CostModel {
  // Index 0: ring, 1: tree.
  double alpha_us[2] = {0, 0};
  double beta_us_per_byte[2] = {0, 0};
  bool measured = false;

  // A prior for when calibration is switched off (GRADSYNC_TUNE=0): ring pays 2(n-1) hops,
  // the tree 2*log2(n) hops but moves twice the bytes through interior ranks.
  static CostModel prior(int world_size);
  // Fits alpha and beta of one algorithm from times at two sizes.
  void fit(int algo, size_t small_bytes, double small_us, size_t large_bytes, double large_us);

  double predict_us(Algorithm algo, size_t bytes) const;
  Algorithm choose(size_t bytes) const;
  std::string describe() const;
};

}  // namespace gradsync
