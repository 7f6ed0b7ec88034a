// What the GradientReducer's ranks agree on through collectives: that they registered the same
// gradients with the same options (once, at create), how each step ended (every finish), and
// the bucket order of the rebuild (rank 0's observed order, once).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gradsync/gradient_reducer.h"

namespace gradsync {

// `local_problem` is this rank's own objection (bad arguments), or Ok. Every rank gathers
// every rank's registration; any difference, or any rank's objection, fails every rank with
// an error that names the ranks and the first gradient that differs.
Status agree_on_registrations(Communicator& comm, const std::vector<GradientSpec>& gradients,
                              const ReducerOptions& options, const Status& local_problem);

// How a step went on this rank.
struct StepReport {
  Status error;             // a hook failed, a gradient was marked twice, ...
  int64_t unmarked = 0;     // gradients never marked ready and not declared maybe_unused
  int64_t first_unmarked = -1;
};

// Gathers every rank's report: Ok when every rank's step went well, else the same error on
// every rank, naming each rank that failed and why (this rank's own error in full).
Status agree_on_step(Communicator& comm, const StepReport& report, int64_t step);

// Rank 0's `order` on every rank (a broadcast); an order that is not a permutation of the n
// gradients is refused.
Status agree_on_order(Communicator& comm, std::vector<int>& order);

}  // namespace gradsync
