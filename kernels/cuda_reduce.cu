// CUDA reduction and copy kernels (cuda_reduce.cuh). The numeric rules mirror
// host_reduce_loops.h operation for operation; see the header for what is guaranteed.
//
// Shape of every kernel: elements [0, head) scalar, then nvec packs of 16 bytes (uint4
// loads/stores), then a scalar tail; each part a grid-stride loop over the same thread index.
// head == n (nvec == 0) is the all-scalar path for pointers whose offsets modulo 16 differ.
#include "kernels/cuda_reduce.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_ops.cuh"

namespace gradsync::kernels {
namespace {

// Launch shape. 512 threads a block; at most 1024 blocks = 524288 threads, about two full
// waves of an H200 (132 SMs x 2048 resident threads) and more than enough bytes in flight to
// saturate HBM; larger arrays are covered by the grid-stride loops, smaller ones get
// ceil(work / 512) blocks.
constexpr int kThreads = 512;
constexpr size_t kMaxBlocks = 1024;

using namespace ops;  // NOLINT: the traits and ops are this file's vocabulary

__device__ inline size_t thread_index() {
  return size_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline size_t grid_threads() { return size_t(gridDim.x) * blockDim.x; }

// The kernels' bodies are functions of (thread index, thread count) so that a host build can
// run them thread by thread (kernel wrappers below).

// out1[i] (and out2[i] when out2 != nullptr) = op(a[i], b[i]). Every element is loaded
// before it is stored by the same thread, so out1 may be a or b.
template <class S, class Op>
HD void reduce_body(size_t tid, size_t stride, S* out1, S* out2, const S* a, const S* b,
                    size_t head, size_t nvec, size_t n, Op op) {
  using P = Pack<S>;
  const bool two = out2 != nullptr;
  for (size_t i = tid; i < head; i += stride) {
    const S v = op(a[i], b[i]);
    out1[i] = v;
    if (two) out2[i] = v;
  }
  const uint4* va = reinterpret_cast<const uint4*>(a + head);
  const uint4* vb = reinterpret_cast<const uint4*>(b + head);
  uint4* vo1 = reinterpret_cast<uint4*>(out1 + head);
  uint4* vo2 = two ? reinterpret_cast<uint4*>(out2 + head) : nullptr;
  // Two packs a thread per iteration: all four loads are issued before any store (the
  // compiler may not reorder them itself: the pointers may alias).
  size_t i = tid;
  for (; i + stride < nvec; i += 2 * stride) {
    P x0, y0, x1, y1;
    x0.v = va[i];
    y0.v = vb[i];
    x1.v = va[i + stride];
    y1.v = vb[i + stride];
    UNROLL
    for (int k = 0; k < P::kN; ++k) {
      x0.e[k] = op(x0.e[k], y0.e[k]);
      x1.e[k] = op(x1.e[k], y1.e[k]);
    }
    vo1[i] = x0.v;
    vo1[i + stride] = x1.v;
    if (two) {
      vo2[i] = x0.v;
      vo2[i + stride] = x1.v;
    }
  }
  if (i < nvec) {
    P x, y;
    x.v = va[i];
    y.v = vb[i];
    UNROLL
    for (int k = 0; k < P::kN; ++k) x.e[k] = op(x.e[k], y.e[k]);
    vo1[i] = x.v;
    if (two) vo2[i] = x.v;
  }
  for (size_t j = head + nvec * P::kN + tid; j < n; j += stride) {
    const S v = op(a[j], b[j]);
    out1[j] = v;
    if (two) out2[j] = v;
  }
}

// buf[i] = op(buf[i]).
template <class S, class Op>
HD void map1_body(size_t tid, size_t stride, S* buf, size_t head, size_t nvec, size_t n, Op op) {
  using P = Pack<S>;
  for (size_t i = tid; i < head; i += stride) buf[i] = op(buf[i]);
  uint4* vb = reinterpret_cast<uint4*>(buf + head);
  size_t i = tid;
  for (; i + stride < nvec; i += 2 * stride) {
    P x0, x1;
    x0.v = vb[i];
    x1.v = vb[i + stride];
    UNROLL
    for (int k = 0; k < P::kN; ++k) {
      x0.e[k] = op(x0.e[k]);
      x1.e[k] = op(x1.e[k]);
    }
    vb[i] = x0.v;
    vb[i + stride] = x1.v;
  }
  if (i < nvec) {
    P x;
    x.v = vb[i];
    UNROLL
    for (int k = 0; k < P::kN; ++k) x.e[k] = op(x.e[k]);
    vb[i] = x.v;
  }
  for (size_t j = head + nvec * P::kN + tid; j < n; j += stride) buf[j] = op(buf[j]);
}

// dst = src in words of W bytes after a byte-wise head that aligns both, byte-wise tail.
template <class W>
HD void copy_body(size_t tid, size_t stride, uint8_t* dst, const uint8_t* src, size_t head,
                  size_t nvec, size_t bytes) {
  for (size_t i = tid; i < head; i += stride) dst[i] = src[i];
  const W* s = reinterpret_cast<const W*>(src + head);
  W* d = reinterpret_cast<W*>(dst + head);
  size_t i = tid;
  for (; i + stride < nvec; i += 2 * stride) {
    const W x0 = s[i];
    const W x1 = s[i + stride];
    d[i] = x0;
    d[i + stride] = x1;
  }
  if (i < nvec) d[i] = s[i];
  for (size_t j = head + nvec * sizeof(W) + tid; j < bytes; j += stride) dst[j] = src[j];
}

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

// The split of n elements of `es` bytes at offset `mis` (address modulo 16): scalar head
// up to the next 16-byte boundary, packs, scalar tail.
struct Split {
  size_t head;
  size_t nvec;
};
Split split(size_t n, size_t es, unsigned mis, bool vectorise) {
  if (!vectorise) return {n, 0};
  const size_t head = std::min(n, size_t((16u - mis) & 15u) / es);
  return {head, (n - head) * es / 16};
}

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
  // The widest word (up to 16 bytes) for which dst and src can both be aligned: the lowest
  // set bit of their difference.
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  const uintptr_t diff = (d ^ s) | 16u;
  const size_t w = size_t(diff & (~diff + 1));
  const size_t head = std::min(bytes, size_t((w - (d & (w - 1))) & (w - 1)));
  const size_t nvec = (bytes - head) / w;
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
