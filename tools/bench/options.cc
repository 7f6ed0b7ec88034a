#include "bench/options.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

namespace bench {
namespace {

using gradsync::DataType;
using gradsync::ReduceOp;

constexpr TypeName kTypes[] = {
    {DataType::kFloat32, "float"},     {DataType::kFloat64, "double"}, {DataType::kFloat16, "half"},
    {DataType::kBFloat16, "bfloat16"}, {DataType::kInt8, "int8"},      {DataType::kUInt8, "uint8"},
    {DataType::kInt32, "int32"},       {DataType::kInt64, "int64"},
};
constexpr OpName kOps[] = {{ReduceOp::kSum, "sum"},
                           {ReduceOp::kProd, "prod"},
                           {ReduceOp::kMin, "min"},
                           {ReduceOp::kMax, "max"},
                           {ReduceOp::kAvg, "avg"}};

constexpr const char* kUsage =
    "usage: gradsyncrun [...] gradsync-bench [options]\n"
    "  -b, --minbytes N        smallest size in bytes, K/M/G suffixes (default 32M)\n"
    "  -e, --maxbytes N        largest size (default 32M)\n"
    "  -f, --stepfactor F      multiply the size by F each step (default 2)\n"
    "  -d, --datatype T        float double half bfloat16 int8 uint8 int32 int64 | all\n"
    "  -o, --op OP             sum prod min max avg | all (reducing collectives only)\n"
    "  -n, --iters N           timed iterations per size (default 20)\n"
    "  -w, --warmup_iters N    untimed iterations first (default 5)\n"
    "  -c, --check 0|1         check results against a reference (default 1)\n"
    "  -r, --root R            root of broadcast (default 0)\n"
    "      --collective C      allreduce reduce_scatter all_gather broadcast barrier\n"
    "      --algo A            ring tree auto (default auto)\n"
    "      --model 0|1         allreduce: also time ring and tree at every size (medians of 5\n"
    "                          interleaved rounds) and print the cost model's\n"
    "                          predictions and choice beside them\n"
    "      --timing T          mean (default, nccl-tests): the mean of back-to-back calls;\n"
    "                          median: each call after a barrier, the median call (the CPU\n"
    "                          anchors' method); the slowest rank's either way (host path)\n"
    "      --inplace 0|1       only out-of-place (0) or in-place (1); default both\n"
    "      --device D          host (default): host buffers, the host path; cuda: device\n"
    "                          buffers on the device of LOCAL_RANK (or $GRADSYNC_DEVICE),\n"
    "                          GPU collectives on a stream timed with CUDA events (allreduce,\n"
    "                          reduce_scatter, all_gather, broadcast)\n"
    "      --nccl 0|1          --device cuda: NCCL's collective on the same buffers and stream\n"
    "                          beside gradsync's, with ratio columns (default 1 where built)\n"
    "      --timeline 0|1      --device cuda on one node (cuda-ipc): no table; per size, the\n"
    "                          in-kernel timeline of the chunked protocol (push, wait, fold\n"
    "                          stamps of every block; GRADSYNC_GPU_TIMELINE=1 is set): busy\n"
    "                          times, the fraction of transfer time hidden under folds, and\n"
    "                          the first chunks of block 0 (gradsync only, no NCCL)\n"
    "      --simulate 0|1      no job: the GPU cost model over the planned GPU schedules\n"
    "                          (runtime/gpu/plan) for --sim-nodes x --sim-gpus shapes with\n"
    "                          declared links; prints predicted time and busbw per size, the\n"
    "                          algorithm and protocol chosen (--algo forces one), and a\n"
    "                          busbw table; sizes default to -b 8 -e 4G\n"
    "      --sim-nodes LIST    node counts, e.g. 1,2,4 (default 1,2,4,...,1024)\n"
    "      --sim-gpus N        GPUs per node (default 8)   --sim-nics N  NICs per node (8)\n"
    "      --intra-gbps X      GB/s per GPU per direction inside a node (default 450)\n"
    "      --intra-lat-us L,B  per-hop latency inside a node, LL and bulk (default 0.6,3.4)\n"
    "      --intra-link K      nvlink (default) or pcie\n"
    "      --nic-gbps X        GB/s per NIC per direction (default 48: 400 Gb/s NDR)\n"
    "      --nic-lat-us L,B    per-hop latency between nodes, LL and bulk (default 2.7,14)\n"
    "size is the bytes of the full buffer (reduce_scatter's input, all_gather's output);\n"
    "time is the mean per iteration, max over ranks; busbw = algbw x 2(n-1)/n for\n"
    "allreduce, (n-1)/n for reduce_scatter and all_gather, 1 for broadcast.\n";

bool parse_size(const char* s, size_t* out) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (end == s || v < 0) return false;
  switch (*end) {  // nccl-tests: binary multiples
    case 'k':
    case 'K':
      v *= 1024.0;
      ++end;
      break;
    case 'm':
    case 'M':
      v *= 1024.0 * 1024;
      ++end;
      break;
    case 'g':
    case 'G':
      v *= 1024.0 * 1024 * 1024;
      ++end;
      break;
  }
  if (*end != '\0') return false;
  *out = static_cast<size_t>(v);
  return true;
}

bool parse_double(const char* s, double lo, double* out) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (end == s || *end != '\0' || !(v > lo)) return false;
  *out = v;
  return true;
}

// "L,B": two latencies in microseconds.
bool parse_latency(const std::string& v, gradsync::plan::HopLatency* out) {
  const auto comma = v.find(',');
  if (comma == std::string::npos) return false;
  double ll = 0, bulk = 0;
  if (!parse_double(v.substr(0, comma).c_str(), -1e-12, &ll) ||
      !parse_double(v.substr(comma + 1).c_str(), -1e-12, &bulk))
    return false;
  *out = {ll, bulk};
  return true;
}

bool parse_int(const char* s, int lo, int hi, int* out) {
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < lo || v > hi) return false;
  *out = static_cast<int>(v);
  return true;
}

// "1,2,4": node counts, each 1..65536.
bool parse_int_list(const std::string& v, std::vector<int>* out) {
  out->clear();
  size_t start = 0;
  while (start <= v.size()) {
    const size_t comma = std::min(v.find(',', start), v.size());
    int x = 0;
    if (!parse_int(v.substr(start, comma - start).c_str(), 1, 1 << 16, &x)) return false;
    out->push_back(x);
    start = comma + 1;
  }
  return !out->empty();
}

// nccl-tests' type names, plus the spellings gradsync's own to_string uses.
std::string_view alias(std::string_view v) {
  if (v == "float32") return "float";
  if (v == "float64") return "double";
  if (v == "float16") return "half";
  if (v == "bf16") return "bfloat16";
  return v;
}

template <class Table, class Out>
bool pick(std::string_view v, const Table& table, std::vector<Out>* out) {
  out->clear();
  for (const auto& e : table) {
    if (v == "all" || alias(v) == e.name) out->push_back(e);
  }
  return !out->empty();
}

}  // namespace

const char* name(Collective c) {
  switch (c) {
    case Collective::kAllreduce:
      return "allreduce";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kBarrier:
      return "barrier";
  }
  return "?";
}

const char* name(gradsync::Algorithm a) {
  switch (a) {
    case gradsync::Algorithm::kAuto:
      return "auto";
    case gradsync::Algorithm::kRing:
      return "ring";
    case gradsync::Algorithm::kTree:
      return "tree";
  }
  return "?";
}

bool built_with_cuda() {
#ifdef GRADSYNC_BENCH_CUDA
  return true;
#else
  return false;
#endif
}

bool built_with_nccl() {
#ifdef GRADSYNC_BENCH_NCCL
  return true;
#else
  return false;
#endif
}

const char* name(Device d) { return d == Device::kCuda ? "cuda" : "host"; }

bool parse_options(int argc, char** argv, Options* o, bool* help) {
  *help = false;
  int nccl = -1;  // not given
  bool sizes_given = false;
  o->types = {kTypes[0]};
  o->ops = {kOps[0]};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], v;
    if (a == "-h" || a == "--help") {
      *help = true;
      std::fputs(kUsage, stderr);
      return false;
    }
    if (auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (i + 1 < argc) {
      v = argv[++i];
    } else {
      std::fprintf(stderr, "gradsync-bench: %s needs a value\n%s", a.c_str(), kUsage);
      return false;
    }
    const char* s = v.c_str();
    int flag = 0;
    bool ok = true;
    if (a == "-b" || a == "--minbytes")
      ok = parse_size(s, &o->min_bytes), sizes_given = true;
    else if (a == "-e" || a == "--maxbytes")
      ok = parse_size(s, &o->max_bytes), sizes_given = true;
    else if (a == "-f" || a == "--stepfactor")
      ok = parse_size(s, &o->factor) && o->factor >= 2;
    else if (a == "-d" || a == "--datatype")
      ok = pick(v, kTypes, &o->types);
    else if (a == "-o" || a == "--op")
      ok = pick(v, kOps, &o->ops);
    else if (a == "-n" || a == "--iters")
      ok = parse_int(s, 1, 1 << 30, &o->iters);
    else if (a == "-w" || a == "--warmup_iters")
      ok = parse_int(s, 0, 1 << 30, &o->warmup);
    else if (a == "-c" || a == "--check")
      ok = parse_int(s, 0, 1, &flag), o->check = flag;
    else if (a == "-r" || a == "--root")
      ok = parse_int(s, 0, 1 << 30, &o->root);
    else if (a == "--inplace") {
      ok = parse_int(s, 0, 1, &flag);
      o->in_place = flag == 1;
      o->out_of_place = flag == 0;
    } else if (a == "--algo") {
      ok = v == "auto" || v == "ring" || v == "tree";
      o->algo = v == "ring"   ? gradsync::Algorithm::kRing
                : v == "tree" ? gradsync::Algorithm::kTree
                              : gradsync::Algorithm::kAuto;
    } else if (a == "--device") {
      ok = v == "host" || v == "cuda";
      o->device = v == "cuda" ? Device::kCuda : Device::kHost;
    } else if (a == "--nccl") {
      ok = parse_int(s, 0, 1, &nccl);
    } else if (a == "--timeline") {
      ok = parse_int(s, 0, 1, &flag), o->timeline = flag;
    } else if (a == "--model") {
      ok = parse_int(s, 0, 1, &flag), o->model = flag;
    } else if (a == "--simulate") {
      ok = parse_int(s, 0, 1, &flag), o->simulate = flag;
    } else if (a == "--sim-nodes") {
      ok = parse_int_list(v, &o->sim.nodes);
    } else if (a == "--sim-gpus") {
      ok = parse_int(s, 1, 64, &o->sim.gpus);
    } else if (a == "--sim-nics") {
      ok = parse_int(s, 1, 64, &o->sim.nics);
    } else if (a == "--intra-gbps") {
      ok = parse_double(s, 0, &o->sim.links.intra_gbps);
    } else if (a == "--nic-gbps") {
      ok = parse_double(s, 0, &o->sim.links.nic_gbps);
    } else if (a == "--intra-lat-us") {
      ok = parse_latency(v, &o->sim.links.intra_lat);
    } else if (a == "--nic-lat-us") {
      ok = parse_latency(v, &o->sim.links.nic_lat);
    } else if (a == "--intra-link") {
      ok = v == "nvlink" || v == "pcie";
      o->sim.links.intra_class = v == "pcie" ? gradsync::plan::LinkClass::kPCIe : gradsync::plan::LinkClass::kNVLink;
    } else if (a == "--timing") {
      ok = v == "mean" || v == "median";
      o->median = v == "median";
    } else if (a == "--collective") {
      ok = false;
      for (auto c : {Collective::kAllreduce, Collective::kReduceScatter, Collective::kAllGather,
                     Collective::kBroadcast, Collective::kBarrier}) {
        if (v == name(c)) o->collective = c, ok = true;
      }
    } else {
      std::fprintf(stderr, "gradsync-bench: unknown option %s\n%s", a.c_str(), kUsage);
      return false;
    }
    if (!ok) {
      std::fprintf(stderr, "gradsync-bench: bad value '%s' for %s\n%s", s, a.c_str(), kUsage);
      return false;
    }
  }
  if (o->simulate) {
    if (!sizes_given) o->min_bytes = 8, o->max_bytes = size_t{4} << 30;
    if (o->device == Device::kCuda || o->collective == Collective::kBarrier || o->timeline) {
      std::fprintf(stderr, "gradsync-bench: --simulate 1 runs no job: drop --device cuda, --timeline and barrier\n");
      return false;
    }
  }
  if (o->device == Device::kCuda) {
    if (!built_with_cuda()) {
      std::fprintf(stderr,
                   "gradsync-bench: --device cuda: this gradsync-bench was built without CUDA "
                   "(configure with -DGRADSYNC_WITH_CUDA=ON where nvcc is installed)\n");
      return false;
    }
    if (o->collective == Collective::kBarrier) {
      std::fprintf(stderr,
                   "gradsync-bench: --device cuda has no barrier (it moves no device data)\n");
      return false;
    }
    if (o->collective == Collective::kBroadcast && !o->in_place) {
      std::fprintf(stderr,
                   "gradsync-bench: broadcast is in-place only in gradsync; drop --inplace 0\n");
      return false;
    }
    if (o->model) {
      std::fprintf(stderr, "gradsync-bench: --model 1 times the host path; drop --device cuda\n");
      return false;
    }
    if (nccl == 1 && !built_with_nccl()) {
      std::fprintf(stderr,
                   "gradsync-bench: --nccl 1: this gradsync-bench was built without NCCL "
                   "(nccl.h and libnccl were not found at configure time)\n");
      return false;
    }
    if (o->timeline && nccl == 1) {
      std::fprintf(stderr, "gradsync-bench: --timeline 1 times gradsync only; drop --nccl 1\n");
      return false;
    }
    o->nccl = o->timeline ? false : nccl < 0 ? built_with_nccl() : nccl == 1;
  } else if (o->timeline) {
    std::fprintf(stderr, "gradsync-bench: --timeline 1 needs --device cuda\n");
    return false;
  } else if (nccl == 1) {
    std::fprintf(stderr, "gradsync-bench: --nccl 1 needs --device cuda\n");
    return false;
  }
  if (o->min_bytes > o->max_bytes) {
    std::fprintf(stderr, "gradsync-bench: -b %zu is larger than -e %zu\n", o->min_bytes,
                 o->max_bytes);
    return false;
  }
  return true;
}

std::vector<size_t> sizes(const Options& o) {
  std::vector<size_t> out;
  for (size_t b = o.min_bytes; b <= o.max_bytes; b *= o.factor) {
    out.push_back(b);
    if (b == 0) break;  // -b 0: one size, then stop (0 * f stays 0)
  }
  return out;
}

}  // namespace bench
