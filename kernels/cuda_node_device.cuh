// Device-side helpers of the one-node kernels (cuda_node.cu): system-scope flags, bounded
// waits, the region's geometry and the chunk movers every one-node protocol is written in.
// Included only by .cu files of kernels/.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda_node.cuh"
#include "kernels/cuda_ops.cuh"

namespace gradsync::kernels::node {

using namespace ops;  // NOLINT: the traits and ops are this file's vocabulary


constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // packs a thread keeps in flight per loop trip

// ---- flags: system-scope acquire/release, so peers' GPUs and the host see them in order ----

__device__ inline uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ inline void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// A fence then relaxed stores is a release of all of them at once (one fence, not one per store).
__device__ inline void store_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ inline void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ inline void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ inline uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ inline uint32_t host_word(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}

// Records the first failure of the launch (later ones keep the first).
__device__ inline void fail(NodeError* e, uint32_t code, int peer, uint32_t what) {
  if (atomicCAS(&e->code, 0u, code) == 0u) {
    e->peer = peer;
    e->block = blockIdx.x;
    e->what = what;
    __threadfence_system();
  }
}

// Spins until *flag >= want. False (error recorded) on a deadline, an abort, or a failure
// another block already recorded.
__device__ inline bool wait_at_least(const uint64_t* flag, uint64_t want, const NodeArgs& a, int peer,
                              uint32_t what) {
  if (load_acquire(flag) >= want) return true;
  const uint64_t start = now_ns();
  for (uint32_t n = 1;; ++n) {
    if (load_acquire(flag) >= want) return true;
    if (n > 64) __nanosleep(n > 4096 ? 1000 : 32);
    if ((n & 127) == 0) {
      if (host_word(&a.error->code) != 0) return false;
      if (host_word(a.abort) != 0) return fail(a.error, 2, peer, what), false;
      if (now_ns() - start > a.timeout_ns) return fail(a.error, 1, peer, what), false;
    }
  }
}

// ---- region layout ----------------------------------------------------------------------

struct Geometry {
  uint64_t flags_bytes, chunk_stride;
  uint32_t slots;
  int nranks;
  __device__ uint64_t* ready(uint8_t* region, uint32_t b, int src) const {
    return reinterpret_cast<uint64_t*>(region) + size_t(b) * kMaxNodeRanks + src;
  }
  __device__ uint64_t* freed(uint8_t* region, uint32_t b, int dst, uint32_t blocks) const {
    return reinterpret_cast<uint64_t*>(region) + (size_t(blocks) + b) * kMaxNodeRanks + dst;
  }
  __device__ uint8_t* slot(uint8_t* region, uint32_t b, int src, uint32_t s) const {
    return region + flags_bytes + ((size_t(b) * nranks + src) * slots + s) * chunk_stride;
  }
};

// ---- one sequence number of a block: credit, publish, wait, release ----------------------
// Each is called by every thread of the block (barriers inside); `ok` is the block's shared
// flag, cleared by a failed wait, and false is returned on every thread after one.

// Thread 0 waits until flag(p) >= at_least for every peer p that want(p) names (`stage` tells
// the error word which wait it was); then the block learns the outcome from `ok`.
template <class Flag, class Want>
__device__ inline bool wait_peers(const NodeArgs& a, const Geometry& g, Flag flag, uint64_t at_least,
                                  Want want, int stage, int* ok) {
  if (threadIdx.x == 0) {
    for (int p = 0; p < g.nranks; ++p) {
      if (p != a.me && want(p) && !wait_at_least(flag(p), at_least, a, p, stage)) {
        *ok = 0;
        break;
      }
    }
  }
  __syncthreads();
  return *ok != 0;
}

// Before storing sequence k into peers' slots: every peer finished sequence k - slots (whose
// slot k reuses).
__device__ inline bool wait_credits(const NodeArgs& a, const Geometry& g, uint32_t b,
                                    uint32_t blocks, uint64_t k, int* ok) {
  uint8_t* mine = a.region[a.me];
  return wait_peers(a, g, [&](int p) { return g.freed(mine, b, p, blocks); },
                    k >= g.slots ? k - g.slots + 1 : 0, [&](int) { return k >= g.slots; }, 0, ok);
}

// After every thread stored its part of sequence k (`bytes` in all, payload into peers):
// fence the stores at system scope, run `then` (a timeline stamp) and tell every peer.
template <class Then>
__device__ inline void publish_ready(const NodeArgs& a, const Geometry& g, uint32_t b,
                                     uint64_t k, uint64_t bytes, Then then) {
  __threadfence_system();
  __syncthreads();
  then();
  if (threadIdx.x == 0) {
    for (int p = 0; p < g.nranks; ++p) {
      if (p != a.me) store_release(g.ready(a.region[p], b, a.me), k + 1);
    }
    if (a.sent != nullptr && bytes != 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(a.sent), static_cast<unsigned long long>(bytes));
  }
}

// Before reading sequence k's slots: it arrived from every rank `from(r)` says pushes in this
// sequence.
template <class From>
__device__ inline bool wait_ready(const NodeArgs& a, const Geometry& g, uint32_t b, uint64_t k,
                                  From from, int* ok) {
  uint8_t* mine = a.region[a.me];
  return wait_peers(a, g, [&](int r) { return g.ready(mine, b, r); }, k + 1, from, 1, ok);
}

// After every thread finished reading sequence k's slots: run `then`, and tell every peer
// this rank is done with k, even a rank that read nothing (the peers' credits count on it).
template <class Then>
__device__ inline void release_slots(const NodeArgs& a, const Geometry& g, uint32_t b,
                                     uint32_t blocks, uint64_t k, Then then) {
  __syncthreads();
  then();
  if (threadIdx.x == 0) {
    for (int p = 0; p < g.nranks; ++p) {
      if (p != a.me) store_release(g.freed(a.region[p], b, a.me, blocks), k + 1);
    }
  }
}

template <class S>
__device__ inline Pack<S> load_pack(const S* p, size_t v) {
  Pack<S> x;
  x.v = reinterpret_cast<const uint4*>(p)[v];
  return x;
}
// Slots are written by other GPUs: read them from L2 (ld.cg), never from a stale L1 line.
template <class S>
__device__ inline Pack<S> load_pack_cg(const S* p, size_t v) {
  Pack<S> x;
  x.v = __ldcg(reinterpret_cast<const uint4*>(p) + v);
  return x;
}

// ---- chunk movers: all threads of a block, 16-byte packs when `vec`, a scalar tail --------

// Sources and destinations are functions of a rank (computed, not looked up in a table that
// would live in local memory).

// dst_of(p)[0, len) = src_of(p)[0, len) for every peer p != me; kOneSource: src_of is the same
// for every p, and its packs are loaded once and stored n - 1 times.
template <class S, bool kOneSource, class SrcOf, class DstOf>
__device__ void push_chunk(SrcOf src_of, DstOf dst_of, int n, int me, size_t len, bool vec) {
  using P = Pack<S>;
  constexpr int kN = P::kN;
  const size_t nv = vec ? len / kN : 0;
  for (size_t v0 = threadIdx.x; v0 < nv; v0 += size_t(kThreads) * kUnroll) {
    if constexpr (kOneSource) {
      P x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const size_t v = v0 + size_t(u) * kThreads;
        if (v < nv) x[u] = load_pack(src_of(me), v);
      }
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        uint4* d = reinterpret_cast<uint4*>(dst_of(p));
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const size_t v = v0 + size_t(u) * kThreads;
          if (v < nv) d[v] = x[u].v;
        }
      }
    } else {
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        P x[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const size_t v = v0 + size_t(u) * kThreads;
          if (v < nv) x[u] = load_pack(src_of(p), v);
        }
        uint4* d = reinterpret_cast<uint4*>(dst_of(p));
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const size_t v = v0 + size_t(u) * kThreads;
          if (v < nv) d[v] = x[u].v;
        }
      }
    }
  }
  for (size_t e = nv * kN + threadIdx.x; e < len; e += kThreads) {
    for (int p = 0; p < n; ++p) {
      if (p != me) dst_of(p)[e] = src_of(p)[e];
    }
  }
}

// dst = src; `from_slot`: src was written by another GPU (read from L2).
template <class S>
__device__ void copy_chunk(S* dst, const S* src, size_t len, bool vec, bool from_slot) {
  using P = Pack<S>;
  constexpr int kN = P::kN;
  const size_t nv = vec ? len / kN : 0;
  for (size_t v0 = threadIdx.x; v0 < nv; v0 += size_t(kThreads) * kUnroll) {
    P x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t v = v0 + size_t(u) * kThreads;
      if (v < nv) x[u] = from_slot ? load_pack_cg(src, v) : load_pack(src, v);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t v = v0 + size_t(u) * kThreads;
      if (v < nv) reinterpret_cast<uint4*>(dst)[v] = x[u].v;
    }
  }
  for (size_t e = nv * kN + threadIdx.x; e < len; e += kThreads) {
    dst[e] = from_slot ? __ldcg(src + e) : src[e];
  }
}

// dst = src_of(0) op src_of(1) op ... op src_of(n-1) (the last step with `last`), element by
// element; src_of(me) is this rank's own input, the others are slots. dst may be src_of(me)
// exactly: every element is read before the same thread stores it.
template <class S, class SrcOf, class Op, class Last>
__device__ void fold_chunk(SrcOf src_of, int n, int me, S* dst, size_t len, bool vec, Op op,
                           Last last) {
  using P = Pack<S>;
  constexpr int kN = P::kN;
  auto load = [&](int r, size_t v) {
    return r == me ? load_pack(src_of(r), v) : load_pack_cg(src_of(r), v);
  };
  const size_t nv = vec ? len / kN : 0;
  for (size_t v0 = threadIdx.x; v0 < nv; v0 += size_t(kThreads) * kUnroll) {
    P acc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t v = v0 + size_t(u) * kThreads;
      if (v < nv) acc[u] = load(0, v);
    }
    for (int r = 1; r < n; ++r) {
      P x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const size_t v = v0 + size_t(u) * kThreads;
        if (v < nv) x[u] = load(r, v);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + 1 < n) {
#pragma unroll
          for (int e = 0; e < kN; ++e) acc[u].e[e] = op(acc[u].e[e], x[u].e[e]);
        } else {
#pragma unroll
          for (int e = 0; e < kN; ++e) acc[u].e[e] = last(acc[u].e[e], x[u].e[e]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t v = v0 + size_t(u) * kThreads;
      if (v < nv) reinterpret_cast<uint4*>(dst)[v] = acc[u].v;
    }
  }
  for (size_t e = nv * kN + threadIdx.x; e < len; e += kThreads) {
    auto at = [&](int r) { return r == me ? src_of(r)[e] : __ldcg(src_of(r) + e); };
    S acc = at(0);
    for (int r = 1; r < n; ++r) acc = r + 1 < n ? op(acc, at(r)) : last(acc, at(r));
    dst[e] = acc;
  }
}

// ---- who does what in a call --------------------------------------------------------------

__host__ __device__ constexpr bool is_reduction(NodeCollective k) {
  return k == NodeCollective::kAllreduce || k == NodeCollective::kReduceScatter;
}
// Input or output made of nranks segments of `count` elements.
__host__ __device__ constexpr bool is_strided(NodeCollective k) {
  return k == NodeCollective::kReduceScatter || k == NodeCollective::kAllGather;
}
// Does `r` push data in this call (every rank but a broadcast's non-roots)?
template <NodeCollective K>
__device__ inline bool pushes(int r, int root) {
  return K != NodeCollective::kBroadcast || r == root;
}

// Ops of the collectives that reduce nothing (never called).
struct NoOp {};


}  // namespace gradsync::kernels::node
