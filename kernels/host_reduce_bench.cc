// Throughput of the host reduction loops, both loop sets. Run by hand:
//   cmake --build build-me --target host_reduce_bench
//   build-me/bin/host_reduce_bench [filter] [KiB of output, default 65536 = 64 MiB]
// GB/s counts output bytes (one output buffer); best of the runs, buffers pre-faulted.
// 64 MiB measures memory bandwidth; a few hundred KiB (cache-resident, like the collectives'
// pipeline slots) measures the loops themselves.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/half.h"
#include "kernels/host_reduce.h"

using namespace gradsync;

namespace {

struct Buf {
  uint8_t* p;
  uint8_t* data() const { return p; }
};

struct Case {
  const char* name;
  DataType type;
  ReduceOp op;
  size_t esize;
  int mode;  // 0: out = a op b; 1: in place (out == a); 2: reduce_final, 2 outputs; 3: avg w=3
};

void fill(DataType t, uint8_t* p, size_t bytes, int seed) {
  for (size_t i = 0; i < bytes / 4; ++i) {
    const float v = float((i * 7919 + seed) % 1000) * 0.37f - 100.0f;
    if (t == DataType::kFloat16 || t == DataType::kBFloat16) {
      const uint16_t h[2] = {t == DataType::kFloat16 ? kernels::float_to_half_rne(v)
                                                     : kernels::float_to_bf16_rne(v),
                             uint16_t(h[0] ^ 1)};
      std::memcpy(p + 4 * i, h, 4);
    } else if (t == DataType::kFloat64) {
      if (i % 2 == 0) { const double d = v; std::memcpy(p + 4 * i, &d, 8); }
    } else {
      std::memcpy(p + 4 * i, &v, 4);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = (argc > 2 ? size_t(std::atol(argv[2])) : size_t{65536}) << 10;
  const int reps = int(std::max<size_t>(15, (size_t{1} << 30) / bytes));
  // 64-byte aligned like the collectives' slots and framework tensors (32-byte vectors then
  // never straddle cache lines), staggered by 1 KiB so no two buffers share page offsets
  // (4K aliasing would slow some pairs and not others).
  std::vector<uint8_t> storage(4 * (bytes + 4096) + 64);
  uint8_t* base = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64);
  const Buf a{base}, b{base + (bytes + 4096) + 1024}, o{base + 2 * (bytes + 4096) + 2048},
      o2{base + 3 * (bytes + 4096) + 3072};
  const Case cases[] = {
      {"f32 sum", DataType::kFloat32, ReduceOp::kSum, 4, 0},
      {"f32 sum in-place", DataType::kFloat32, ReduceOp::kSum, 4, 1},
      {"f32 sum final 2 outs", DataType::kFloat32, ReduceOp::kSum, 4, 2},
      {"f32 avg final w=3", DataType::kFloat32, ReduceOp::kAvg, 4, 3},
      {"f32 max", DataType::kFloat32, ReduceOp::kMax, 4, 0},
      {"f64 sum", DataType::kFloat64, ReduceOp::kSum, 8, 0},
      {"bf16 sum", DataType::kBFloat16, ReduceOp::kSum, 2, 0},
      {"bf16 sum in-place", DataType::kBFloat16, ReduceOp::kSum, 2, 1},
      {"bf16 sum final 2 outs", DataType::kBFloat16, ReduceOp::kSum, 2, 2},
      {"f16 sum", DataType::kFloat16, ReduceOp::kSum, 2, 0},
      {"f16 sum in-place", DataType::kFloat16, ReduceOp::kSum, 2, 1},
      {"f16 avg final w=3", DataType::kFloat16, ReduceOp::kAvg, 2, 3},
      {"int8 sum", DataType::kInt8, ReduceOp::kSum, 1, 0},
      {"int32 sum", DataType::kInt32, ReduceOp::kSum, 4, 0},
      {"int32 avg final w=3", DataType::kInt32, ReduceOp::kAvg, 4, 3},
      {"int64 sum", DataType::kInt64, ReduceOp::kSum, 8, 0},
      {"int64 max", DataType::kInt64, ReduceOp::kMax, 8, 0},
  };
  for (const Case& c : cases) {
    if (argc > 1 && !std::strstr(c.name, argv[1])) continue;
    fill(c.type, a.data(), bytes, 1);
    fill(c.type, b.data(), bytes, 2);
    std::memset(o.data(), 0, bytes);
    std::memset(o2.data(), 0, bytes);
    const size_t n = bytes / c.esize;
    std::printf("%-24s", c.name);
    for (bool generic : {true, false}) {
      kernels::use_generic_loops_only(generic);
      double best = 1e30;
      for (int rep = 0; rep < reps; ++rep) {
        if (c.mode == 1) std::memcpy(o.data(), a.data(), bytes);
        const auto t0 = std::chrono::steady_clock::now();
        switch (c.mode) {
          case 0: kernels::reduce(c.type, c.op, o.data(), a.data(), b.data(), n); break;
          case 1: kernels::reduce(c.type, c.op, o.data(), o.data(), b.data(), n); break;
          case 2: kernels::reduce_final(c.type, c.op, o.data(), o2.data(), a.data(), b.data(), n, 1); break;
          case 3: kernels::reduce_final(c.type, c.op, o.data(), nullptr, a.data(), b.data(), n, 3); break;
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = s < best ? s : best;
      }
      std::printf("  %s %6.2f GB/s", kernels::loop_set(), double(bytes) / best / 1e9);
    }
    std::printf("\n");
  }
  return 0;
}
