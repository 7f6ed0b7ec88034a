// The GradientReducer's bucket planner: which gradients share a bucket, in which order the
// buckets start. Pure logic, the same on every rank for the same input.
#pragma once

#include <cstddef>
#include <vector>

#include "gradsync/gradient_reducer.h"

namespace gradsync {

// Reverse registration order: n-1, ..., 0 (a backward pass finishes the last layers first).
std::vector<int> reverse_registration_order(int n);

// Walks `order` (a permutation of the gradients' indices) and fills one open bucket per
// (type, device): a bucket closes once it holds `first_cap` bytes (the first bucket of its
// type and device) or `cap` bytes (every later one); a gradient larger than the cap gets a
// bucket of its own. Buckets are ordered by the position in `order` of their first gradient,
// and a bucket's gradients sit in its buffer in `order`.
std::vector<BucketInfo> plan_buckets(const std::vector<GradientSpec>& gradients,
                                     const std::vector<int>& order, size_t first_cap, size_t cap);

// True when `order` holds every index of n exactly once.
bool is_permutation_of(const std::vector<int>& order, int n);

}  // namespace gradsync
