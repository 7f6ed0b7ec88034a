// gradsync-bench --device cuda: GPU allreduce on device buffers, timed on a CUDA stream with
// CUDA events, beside NCCL's ncclAllReduce on the same buffers, sizes and stream (--nccl 1).
// Built only with CUDA (GRADSYNC_BENCH_CUDA); the NCCL part only where nccl.h and libnccl
// were found (GRADSYNC_BENCH_NCCL).
#pragma once

#include "bench/options.h"
#include "gradsync/gradsync.h"

namespace bench {

// Runs the GPU table on a communicator joined with a device and prints it from rank 0.
// Returns the exit status: 0, or 1 when an element was wrong or anything failed.
int run_gpu(gradsync::Session& session, gradsync::Communicator& comm, const Options& opt);

}  // namespace bench
