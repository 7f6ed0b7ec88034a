// gradsync-bench --simulate: the GPU planning layer on paper. For each shape (nodes x GPUs per
// node, declared link figures) and size, the cost model (runtime/gpu/plan/cost_model.h) over
// the schedules really planned for it, their bytes counted step by step at symbolic sizes:
// predicted time and busbw (nccl-tests' definition), the algorithm and protocol chosen.
#pragma once

#include <vector>

#include "bench/options.h"

namespace bench {

// Prints the tables to stdout; returns the process exit code.
int run_simulate(const Options& opt);

// --model: the GPU choice for a job of `nodes` x `gpus` ranks at each size, one line each.
void print_gpu_choices(const Options& opt, int nodes, int gpus, const std::vector<size_t>& sizes);

}  // namespace bench
