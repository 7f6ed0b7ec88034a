// The loops of the reduction and copy kernels (cuda_reduce.cu) and of the step kernel
// (cuda_step.cu), as functions of (thread index, thread count): a kernel passes its grid's
// or its block's, and a host build can run them thread by thread.
//
// Shape of every loop: elements [0, head) scalar, then nvec packs of 16 bytes (uint4
// loads/stores), then a scalar tail; each part a stride loop over the same thread index.
// head == n (nvec == 0) is the all-scalar path for pointers whose offsets modulo 16 differ.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda_ops.cuh"

namespace gradsync::kernels::body {

using ops::Pack;

// The split of n elements of `es` bytes at offset `mis` (address modulo 16): scalar head
// up to the next 16-byte boundary, packs, scalar tail.
struct Split {
  size_t head;
  size_t nvec;
};
HD inline Split split(size_t n, size_t es, unsigned mis, bool vectorise) {
  if (!vectorise) return {n, 0};
  const size_t head = (size_t((16u - mis) & 15u) / es < n ? size_t((16u - mis) & 15u) / es : n);
  return {head, (n - head) * es / 16};
}

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

// The most operands of one fold (fold_body; the step kernel's runs of chained operations,
// cuda_step.cuh): a rank's own and 7 peers' (plan::kMaxPeers).
constexpr int kMaxFold = 8;

// The sources of a fold, p[0..k) with 2 <= k <= kMaxFold (p[k..) unused).
template <class S>
struct FoldSrcs {
  const S* p[kMaxFold];
  int k;
};

namespace fold_detail {

// Inlined wherever called (the sources' pointers then stay in registers, not local memory).
#define GS_FOLD_INLINE HD __forceinline__
// A stride loop the device compiler must not unroll (each iteration holds up to kGroup packs).
#if defined(__CUDA_ARCH__)
#define NO_UNROLL _Pragma("unroll 1")
#else
#define NO_UNROLL
#endif

// The sources a vector iteration loads at once (one 16-byte pack each), then folds.
constexpr int kGroup = 4;

// Element i of K sources folded: every source loaded, then folded in order.
template <int K, class S, class Op, class Last>
GS_FOLD_INLINE S fold_at(const S* const (&p)[K], size_t i, Op op, Last last) {
  S x[K];
  UNROLL
  for (int j = 0; j < K; ++j) x[j] = p[j][i];
  S acc = x[0];
  UNROLL
  for (int j = 1; j < K - 1; ++j) acc = op(acc, x[j]);
  return last(acc, x[K - 1]);
}

// fold_body for K sources, K known at compile time (no predicates, no array indexed at run
// time, and the registers of K pointers, not kMaxFold). Per pack, the sources kGroup at a
// time, each group's loads issued together, then folded in order into the accumulator.
template <int K, class S, class Op, class Last>
GS_FOLD_INLINE void fold_k(size_t tid, size_t stride, S* out1, S* out2, const FoldSrcs<S>& src, size_t head,
                           size_t nvec, size_t n, Op op, Last last) {
  using P = Pack<S>;
  const bool two = out2 != nullptr;
  const S* p[K];
  UNROLL
  for (int j = 0; j < K; ++j) p[j] = src.p[j];
  NO_UNROLL
  for (size_t i = tid; i < head; i += stride) {
    const S x = fold_at<K>(p, i, op, last);
    out1[i] = x;
    if (two) out2[i] = x;
  }
  const uint4* v[K];
  UNROLL
  for (int j = 0; j < K; ++j) v[j] = reinterpret_cast<const uint4*>(p[j] + head);
  uint4* vo1 = reinterpret_cast<uint4*>(out1 + head);
  uint4* vo2 = two ? reinterpret_cast<uint4*>(out2 + head) : nullptr;
  NO_UNROLL
  for (size_t i = tid; i < nvec; i += stride) {
    P acc;
    UNROLL
    for (int j0 = 0; j0 < K; j0 += kGroup) {
      P x[kGroup];
      UNROLL
      for (int g = 0; g < kGroup; ++g) {
        if (j0 + g < K) x[g].v = v[j0 + g][i];
      }
      UNROLL
      for (int g = 0; g < kGroup; ++g) {
        const int j = j0 + g;
        if (j == 0) {
          acc = x[0];
        } else if (j < K - 1) {
          UNROLL
          for (int e = 0; e < P::kN; ++e) acc.e[e] = op(acc.e[e], x[g].e[e]);
        } else if (j == K - 1) {
          UNROLL
          for (int e = 0; e < P::kN; ++e) acc.e[e] = last(acc.e[e], x[g].e[e]);
        }
      }
    }
    vo1[i] = acc.v;
    if (two) vo2[i] = acc.v;
  }
  NO_UNROLL
  for (size_t j = head + nvec * P::kN + tid; j < n; j += stride) {
    const S x = fold_at<K>(p, j, op, last);
    out1[j] = x;
    if (two) out2[j] = x;
  }
}

}  // namespace fold_detail

// out1[i] (and out2[i] when out2 != nullptr) = the left fold of src.p[0][i] .. src.p[k-1][i]:
// ((x0 op x1) op x2) .. op x(k-1), the last step by `last` (kAvg's division), every step's
// result an S: the same bytes as k - 1 passes of reduce_body (acc = op(acc, x[j]), the last
// with `last`), in one pass. A thread loads every source of an element (a pack) before it
// stores that element, so out1 may be any of the sources. Every source and out2 must have
// out1's offset modulo 16 where nvec > 0. Packs: one a thread per iteration, its sources
// loaded 4 at a time (fold_detail::kGroup: 4 loads issued together, as reduce_body's, and 4
// packs held, not k), each group folded before the next is loaded. A loop per k (2 .. 8).
template <class S, class Op, class Last>
GS_FOLD_INLINE void fold_body(size_t tid, size_t stride, S* out1, S* out2, const FoldSrcs<S>& src, size_t head,
                              size_t nvec, size_t n, Op op, Last last) {
  using fold_detail::fold_k;
  switch (src.k) {
    case 2: return fold_k<2>(tid, stride, out1, out2, src, head, nvec, n, op, last);
    case 3: return fold_k<3>(tid, stride, out1, out2, src, head, nvec, n, op, last);
    case 4: return fold_k<4>(tid, stride, out1, out2, src, head, nvec, n, op, last);
    case 5: return fold_k<5>(tid, stride, out1, out2, src, head, nvec, n, op, last);
    case 6: return fold_k<6>(tid, stride, out1, out2, src, head, nvec, n, op, last);
    case 7: return fold_k<7>(tid, stride, out1, out2, src, head, nvec, n, op, last);
    default: return fold_k<8>(tid, stride, out1, out2, src, head, nvec, n, op, last);
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

// The widest word (up to 16 bytes) in which dst and src can both be aligned, and the
// bytes before dst reaches it: a copy's split (copy_body).
struct CopySplit {
  size_t width, head, nvec;
};
HD inline CopySplit copy_split(const void* dst, const void* src, size_t bytes) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  const uintptr_t diff = (d ^ s) | 16u;
  const size_t w = size_t(diff & (~diff + 1));
  size_t head = size_t((w - (d & (w - 1))) & (w - 1));
  if (head > bytes) head = bytes;
  return {w, head, (bytes - head) / w};
}

}  // namespace gradsync::kernels::body
