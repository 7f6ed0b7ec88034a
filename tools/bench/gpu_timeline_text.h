// gradsync-bench --device cuda --timeline 1, in text: the first chunks of block 0 of the
// last call on every rank, on rank 0's clock, and rank 0's activity profile.
#pragma once

#include <cstdint>
#include <vector>

#include "gpu/timeline.h"

namespace bench {

constexpr uint32_t kTextChunks = 3;  // chunks of block 0 printed as text
constexpr int kBins = 12;            // the activity profile

// Prints every rank's timeline (all[r]: rank r's) from rank 0.
void print_text_timeline(const std::vector<gradsync::gpu::Timeline>& all);

}  // namespace bench
