// CUDA reduction and copy kernels (cuda_reduce.cuh). The numeric rules mirror
// host_reduce_loops.h operation for operation; see the header for what is guaranteed.
// Each kernel runs one loop of cuda_reduce_body.cuh over its grid.
#include "kernels/cuda_reduce.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_ops.cuh"
#include "kernels/cuda_reduce_body.cuh"

namespace gradsync::kernels {
namespace {

// Launch shape. 512 threads a block; at most 1024 blocks = 524288 threads, about two full
// waves of an H200 (132 SMs x 2048 resident threads) and more than enough bytes in flight to
// saturate HBM; larger arrays are covered by the grid-stride loops, smaller ones get
// ceil(work / 512) blocks.
constexpr int kThreads = 512;
constexpr size_t kMaxBlocks = 1024;

using namespace ops;   // NOLINT: the traits and ops are this file's vocabulary
using namespace body;  // NOLINT: and the loops

__device__ inline size_t thread_index() {
  return size_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline size_t grid_threads() { return size_t(gridDim.x) * blockDim.x; }

template <class S, class Op>
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(S* out1, S* out2, const S* a, const S* b, size_t head, size_t nvec, size_t n,
                  Op op) {
  reduce_body(thread_index(), grid_threads(), out1, out2, a, b, head, nvec, n, op);
}
template <class S, class Op>
__global__ void __launch_bounds__(kThreads)
    map1_kernel(S* buf, size_t head, size_t nvec, size_t n, Op op) {
  map1_body(thread_index(), grid_threads(), buf, head, nvec, n, op);
}
template <class W>
__global__ void __launch_bounds__(kThreads)
    copy_kernel(uint8_t* dst, const uint8_t* src, size_t head, size_t nvec, size_t bytes) {
  copy_body<W>(thread_index(), grid_threads(), dst, src, head, nvec, bytes);
}

// ---- launch helpers ---------------------------------------------------------------------

unsigned blocks_for(size_t work) {
  const size_t b = (work + kThreads - 1) / kThreads;
  return unsigned(std::clamp<size_t>(b, 1, kMaxBlocks));
}

// Threads worth of work for a split: the largest of the three loops, packs two a thread.
size_t work_of(const Split& s, size_t n, size_t per_pack) {
  const size_t tail = n - s.head - s.nvec * per_pack;
  return std::max({s.head, tail, (s.nvec + 1) / 2});
}

template <class Kernel, class... Args>
cudaError_t launch(Kernel kernel, size_t work, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks_for(work));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}


using ops::esize;

bool aligned_to(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }
unsigned mis16(const void* p) { return unsigned(reinterpret_cast<uintptr_t>(p) & 15u); }

template <class Tr, class Op>
cudaError_t launch_binary(void* out1, void* out2, const void* a, const void* b, size_t n,
                          Op op, cudaStream_t stream) {
  using S = typename Tr::S;
  const unsigned m = mis16(out1);
  const bool vec = mis16(a) == m && mis16(b) == m && (out2 == nullptr || mis16(out2) == m);
  const Split s = split(n, sizeof(S), m, vec);
  return launch(reduce_kernel<S, Op>, work_of(s, n, 16 / sizeof(S)), stream,
                static_cast<S*>(out1), static_cast<S*>(out2), static_cast<const S*>(a),
                static_cast<const S*>(b), s.head, s.nvec, n, op);
}

template <class Tr>
cudaError_t launch_op(ReduceOp op, void* out1, void* out2, const void* a, const void* b,
                      size_t n, int world, bool final, cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum: return launch_binary<Tr>(out1, out2, a, b, n, OpSum<Tr>{}, stream);
    case ReduceOp::kProd: return launch_binary<Tr>(out1, out2, a, b, n, OpProd<Tr>{}, stream);
    case ReduceOp::kMin:
      return launch_binary<Tr>(out1, out2, a, b, n, OpMinMax<Tr, false>{}, stream);
    case ReduceOp::kMax:
      return launch_binary<Tr>(out1, out2, a, b, n, OpMinMax<Tr, true>{}, stream);
    case ReduceOp::kAvg:
      if (final && world > 1)
        return launch_binary<Tr>(out1, out2, a, b, n, OpSumDivide<Tr>{world}, stream);
      return launch_binary<Tr>(out1, out2, a, b, n, OpSum<Tr>{}, stream);  // x/1 == x
  }
  return cudaErrorInvalidValue;
}

bool valid_op(ReduceOp op) { return static_cast<unsigned>(op) < unsigned(kNumReduceOps); }

// Shared checks of reduce and reduce_final; cudaSuccess means "go on".
cudaError_t check_binary(DataType type, ReduceOp op, const void* out1, const void* out2,
                         const void* a, const void* b, int world) {
  const size_t es = esize(type);
  if (es == 0 || !valid_op(op) || world < 1) return cudaErrorInvalidValue;
  for (const void* p : {out1, a, b})
    if (p == nullptr || !aligned_to(p, es)) return cudaErrorInvalidValue;
  if (out2 != nullptr && !aligned_to(out2, es)) return cudaErrorInvalidValue;
  return cudaSuccess;
}


}  // namespace

cudaError_t launch_reduce(DataType type, ReduceOp op, void* out, const void* a, const void* b,
                          size_t n, cudaStream_t stream) {
  if (n == 0) return (esize(type) && valid_op(op)) ? cudaSuccess : cudaErrorInvalidValue;
  if (cudaError_t e = check_binary(type, op, out, nullptr, a, b, 1); e != cudaSuccess) return e;
  return with_traits(type, [&]<class Tr>() {
    return launch_op<Tr>(op, out, nullptr, a, b, n, 1, false, stream);
  });
}

cudaError_t launch_reduce_final(DataType type, ReduceOp op, void* out1, void* out2,
                                const void* a, const void* b, size_t n, int world,
                                cudaStream_t stream) {
  if (n == 0)
    return (esize(type) && valid_op(op) && world >= 1) ? cudaSuccess : cudaErrorInvalidValue;
  if (cudaError_t e = check_binary(type, op, out1, out2, a, b, world); e != cudaSuccess)
    return e;
  return with_traits(type, [&]<class Tr>() {
    return launch_op<Tr>(op, out1, out2, a, b, n, world, true, stream);
  });
}

cudaError_t launch_finish_avg(DataType type, void* buf, size_t n, int world,
                              cudaStream_t stream) {
  const size_t es = esize(type);
  if (es == 0 || world < 1) return cudaErrorInvalidValue;
  if (n == 0 || world == 1) return cudaSuccess;  // x/1 == x for every type
  if (buf == nullptr || !aligned_to(buf, es)) return cudaErrorInvalidValue;
  return with_traits(type, [&]<class Tr>() {
    using S = typename Tr::S;
    const Split s = split(n, sizeof(S), mis16(buf), true);
    return launch(map1_kernel<S, OpDivide<Tr>>, work_of(s, n, 16 / sizeof(S)), stream,
                  static_cast<S*>(buf), s.head, s.nvec, n, OpDivide<Tr>{world});
  });
}

cudaError_t launch_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  const CopySplit sp = copy_split(dst, src, bytes);
  const size_t w = sp.width, head = sp.head, nvec = sp.nvec;
  const size_t work = std::max({head, bytes - head - nvec * w, (nvec + 1) / 2});
  auto* o = static_cast<uint8_t*>(dst);
  const auto* i = static_cast<const uint8_t*>(src);
  switch (w) {
    case 16: return launch(copy_kernel<uint4>, work, stream, o, i, head, nvec, bytes);
    case 8: return launch(copy_kernel<uint2>, work, stream, o, i, head, nvec, bytes);
    case 4: return launch(copy_kernel<uint32_t>, work, stream, o, i, head, nvec, bytes);
    case 2: return launch(copy_kernel<uint16_t>, work, stream, o, i, head, nvec, bytes);
    default: return launch(copy_kernel<uint8_t>, work, stream, o, i, head, nvec, bytes);
  }
}

cudaError_t load_reduce_kernels() {
  cudaFuncAttributes attr{};
  cudaError_t e = cudaSuccess;
  auto load = [&](const void* f) {
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, f);
  };
  for (int t = 0; t < kNumDataTypes; ++t) {
    (void)with_traits(DataType(t), [&]<class Tr>() {
      using S = typename Tr::S;
      load(reinterpret_cast<const void*>(reduce_kernel<S, OpSum<Tr>>));
      load(reinterpret_cast<const void*>(reduce_kernel<S, OpProd<Tr>>));
      load(reinterpret_cast<const void*>(reduce_kernel<S, OpMinMax<Tr, false>>));
      load(reinterpret_cast<const void*>(reduce_kernel<S, OpMinMax<Tr, true>>));
      load(reinterpret_cast<const void*>(reduce_kernel<S, OpSumDivide<Tr>>));
      load(reinterpret_cast<const void*>(map1_kernel<S, OpDivide<Tr>>));
      return cudaSuccess;
    });
  }
  load(reinterpret_cast<const void*>(copy_kernel<uint4>));
  load(reinterpret_cast<const void*>(copy_kernel<uint2>));
  load(reinterpret_cast<const void*>(copy_kernel<uint32_t>));
  load(reinterpret_cast<const void*>(copy_kernel<uint16_t>));
  load(reinterpret_cast<const void*>(copy_kernel<uint8_t>));
  return e;
}

}  // namespace gradsync::kernels
