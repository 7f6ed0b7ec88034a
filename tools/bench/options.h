// gradsync-bench command line: nccl-tests' flag names, plus --collective, --algo, --inplace.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "gpu/plan/shape.h"
#include "gradsync/gradsync.h"

namespace bench {

enum class Collective { kAllreduce, kReduceScatter, kAllGather, kBroadcast, kBarrier };
// Where the buffers live: host memory (the host path), or CUDA device memory (GPU allreduce on
// a stream, beside NCCL; bench/gpu.h).
enum class Device { kHost, kCuda };

struct TypeName {
  gradsync::DataType type;
  const char* name;  // as nccl-tests prints it
};
struct OpName {
  gradsync::ReduceOp op;
  const char* name;
};

// --simulate 1 (bench/simulate.h): shapes and declared link figures; no daemon, no GPU.
struct SimOptions {
  std::vector<int> nodes = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};  // --sim-nodes
  int gpus = 8;                             // --sim-gpus: GPUs (ranks) per node
  int nics = 8;                             // --sim-nics: NICs (rails) per node
  gradsync::plan::LinkFigures links;        // --intra-gbps, --intra-lat-us, --intra-link,
                                            // --nic-gbps, --nic-lat-us
};

struct Options {
  size_t min_bytes = 32u << 20;  // nccl-tests' defaults
  size_t max_bytes = 32u << 20;
  size_t factor = 2;
  std::vector<TypeName> types;  // -d, default float
  std::vector<OpName> ops;      // -o, default sum
  int iters = 20;
  int warmup = 5;
  bool check = true;
  int root = 0;
  gradsync::Algorithm algo = gradsync::Algorithm::kAuto;
  Collective collective = Collective::kAllreduce;
  bool out_of_place = true;  // --inplace 1 leaves only the in-place group
  bool in_place = true;      // --inplace 0 leaves only the out-of-place group
  bool model = false;        // --model 1: the selection table after the main one
  bool median = false;       // --timing median: each call after a barrier, the median call
  Device device = Device::kHost;
  bool nccl = false;  // --nccl 1: NCCL beside gradsync (default with --device cuda where built)
  // --timeline 1 (--device cuda, cuda-ipc path): instead of the table, the in-kernel timeline
  // of the chunked protocol per size (GRADSYNC_GPU_TIMELINE=1, runtime/gpu/timeline.h).
  bool timeline = false;
  bool simulate = false;  // --simulate 1: predicted busbw of the planned GPU schedules
  SimOptions sim;
};

// What this build of gradsync-bench can do.
bool built_with_cuda();
bool built_with_nccl();

// Parses argv; on a bad or help argument prints to stderr and returns false.
bool parse_options(int argc, char** argv, Options* o, bool* help);
std::vector<size_t> sizes(const Options& o);

const char* name(Collective c);
const char* name(gradsync::Algorithm a);
const char* name(Device d);

}  // namespace bench
