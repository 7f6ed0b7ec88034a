// gradsync-bench data check: seeded inputs that any rank can regenerate for any rank, and an
// independent reference (float64 for floating types, wrapping 64-bit integers for integers).
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradsync/gradsync.h"

namespace bench {

struct DataSpec {
  gradsync::DataType type;
  gradsync::ReduceOp op;  // shapes the inputs: near-1 magnitudes for prod
  uint64_t seed;          // same on every rank for one (collective, type, op, size)
  int world;
};

// buf[i] = rank's input element first + i, for i < count.
void fill_input(const DataSpec& d, int rank, size_t first, size_t count, void* buf);
// buf[i] = v for i < count (v is exactly representable in every type for v = 0, 1).
void fill_constant(gradsync::DataType type, int v, size_t count, void* buf);
// Elements of got[0..count) that are not the reduction over all ranks of input elements
// first..first+count, within the type's tolerance.
size_t count_wrong_reduced(const DataSpec& d, size_t first, size_t count, const void* got);
// Elements of got[0..count) that are not bit-equal to src_rank's inputs first..first+count.
size_t count_wrong_copy(const DataSpec& d, int src_rank, size_t first, size_t count,
                        const void* got);

}  // namespace bench
