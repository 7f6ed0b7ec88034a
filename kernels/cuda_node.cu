// One-node GPU collectives by peer pushes (cuda_node.cuh) and the host-flag wait kernels.
#include "kernels/cuda_node.cuh"

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda_ops.cuh"

namespace gradsync::kernels {
namespace {

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
__device__ inline uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ inline uint32_t host_word(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}

// Records the first failure of the launch (later ones keep the first).
__device__ void fail(NodeError* e, uint32_t code, int peer, uint32_t what) {
  if (atomicCAS(&e->code, 0u, code) == 0u) {
    e->peer = peer;
    e->block = blockIdx.x;
    e->what = what;
    __threadfence_system();
  }
}

// Spins until *flag >= want. False (error recorded) on a deadline, an abort, or a failure
// another block already recorded.
__device__ bool wait_at_least(const uint64_t* flag, uint64_t want, const NodeArgs& a, int peer,
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

// ---- the chunked protocol -----------------------------------------------------------------

// kTimeline: thread 0 stamps the steps into `tl` (cuda_node.cuh); without it `tl` is unused
// and the kernel is the plain protocol.
template <class Tr, class Op, class Last, NodeCollective K, bool kTimeline>
__global__ void __launch_bounds__(kThreads)
    node_chunked_kernel(NodeArgs a, Geometry g, uint32_t blocks, const typename Tr::S* in,
                        typename Tr::S* out, size_t count, int root, size_t chunk_elems,
                        size_t nchunks, bool vec, Op op, Last last, NodeTimeline tl) {
  using S = typename Tr::S;
  const uint32_t b = blockIdx.x;
  const uint32_t nb = gridDim.x;
  const int me = a.me;
  const int n = g.nranks;
  __shared__ uint64_t base;
  __shared__ int ok;
  // This block's timeline record (cuda_node.cuh): only thread 0 writes it.
  auto record = [&]() { return tl.stamps + b * node_timeline_stride(tl.chunks); };
  auto stamp = [&](size_t i, TimelineStep step, bool happens = true) {
    if constexpr (kTimeline) {
      if (threadIdx.x == 0 && i < tl.chunks)
        record()[kTimelineHeader + i * kTimelineSteps + step] = happens ? now_ns() : 0;
    }
  };
  if (threadIdx.x == 0) {
    if constexpr (kTimeline) record()[0] = now_ns();
    base = a.progress[b];
    ok = 1;
  }
  __syncthreads();
  const size_t mine = nchunks > b ? (nchunks - 1 - b) / nb + 1 : 0;
  uint8_t* const my_region = a.region[me];

  // Chunk i of this block: elements [e0, e0 + len) of the segment, sequence number base + i,
  // slot k % slots.
  auto chunk = [&](size_t i, size_t* e0, size_t* len) {
    *e0 = (b + i * nb) * chunk_elems;
    *len = min(chunk_elems, count - *e0);
  };

  auto push = [&](size_t i) -> bool {
    if (!pushes<K>(me, root)) {  // uniform over the block
      for (TimelineStep st : {kCreditWait, kPushStart, kPushEnd}) stamp(i, st, false);
      return true;
    }
    const uint64_t k = base + i;
    const uint32_t s = uint32_t(k % g.slots);
    size_t e0, len;
    chunk(i, &e0, &len);
    stamp(i, kCreditWait);
    if (threadIdx.x == 0 && k >= g.slots) {
      for (int p = 0; p < n; ++p) {
        if (p != me && !wait_at_least(g.freed(my_region, b, p, blocks), k - g.slots + 1, a, p, 0)) {
          ok = 0;
          break;
        }
      }
    }
    __syncthreads();
    if (!ok) return false;
    stamp(i, kPushStart);
    // reduce_scatter: peer p gets segment p of the input; the others: the input.
    auto src_of = [&](int p) {
      return in + (K == NodeCollective::kReduceScatter ? size_t(p) * count : 0) + e0;
    };
    auto dst_of = [&](int p) { return reinterpret_cast<S*>(g.slot(a.region[p], b, me, s)); };
    push_chunk<S, K != NodeCollective::kReduceScatter>(src_of, dst_of, n, me, len, vec);
    __threadfence_system();
    __syncthreads();
    stamp(i, kPushEnd);  // before the release: a peer sees ready after this stamp
    if (threadIdx.x == 0) {
      for (int p = 0; p < n; ++p) {
        if (p != me) store_release(g.ready(a.region[p], b, me), k + 1);
      }
    }
    return true;
  };

  auto consume = [&](size_t i) -> bool {
    const uint64_t k = base + i;
    const uint32_t s = uint32_t(k % g.slots);
    size_t e0, len;
    chunk(i, &e0, &len);
    stamp(i, kReadyWait);
    if (threadIdx.x == 0) {
      for (int p = 0; p < n; ++p) {
        if (p != me && pushes<K>(p, root) &&
            !wait_at_least(g.ready(my_region, b, p), k + 1, a, p, 1)) {
          ok = 0;
          break;
        }
      }
    }
    __syncthreads();
    if (!ok) return false;
    stamp(i, kFoldStart);
    // What rank r contributed to this chunk: its slot in my region, or my own input.
    auto slot_of = [&](int r) { return reinterpret_cast<const S*>(g.slot(my_region, b, r, s)); };
    if constexpr (is_reduction(K)) {
      const S* own = in + (K == NodeCollective::kReduceScatter ? size_t(me) * count : 0) + e0;
      auto src_of = [&](int r) { return r == me ? own : slot_of(r); };
      fold_chunk(src_of, n, me, out + e0, len, vec, op, last);
    } else if constexpr (K == NodeCollective::kAllGather) {
      for (int r = 0; r < n; ++r) {
        S* dst = out + size_t(r) * count + e0;
        if (r != me)
          copy_chunk(dst, slot_of(r), len, vec, true);
        else if (dst != in + e0)
          copy_chunk(dst, in + e0, len, vec, false);  // not in place
      }
    } else {
      if (me != root) copy_chunk(out + e0, slot_of(root), len, vec, true);
    }
    __syncthreads();  // every read of this slot is done before the peers may refill it
    stamp(i, kFoldEnd);  // before the release: a peer's push into the slot starts after it
    // Every rank says it is done with sequence k, to every peer, even a broadcast root that
    // read nothing: the peers' next pushes into this sequence's slot wait for it.
    if (threadIdx.x == 0) {
      for (int p = 0; p < n; ++p) {
        if (p != me) store_release(g.freed(a.region[p], b, me, blocks), k + 1);
      }
    }
    return true;
  };

  if (mine == 0) return;
  if (!push(0)) return;
  for (size_t i = 0; i < mine; ++i) {
    if (i + 1 < mine && !push(i + 1)) return;
    if (!consume(i)) return;
  }
  if (threadIdx.x == 0) {
    a.progress[b] = base + mine;
    if constexpr (kTimeline) {
      uint64_t* r = record();
      r[1] = now_ns();
      r[2] = mine;
      r[3] = base;
    }
  }
}

// ---- low-latency protocol ---------------------------------------------------------------

__device__ inline void store_line(uint8_t* p, uint32_t d0, uint32_t d1, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(flag),
               "r"(d1), "r"(flag)
               : "memory");
}
__device__ inline void load_line(const uint8_t* p, uint32_t* d0, uint32_t* f0, uint32_t* d1,
                                 uint32_t* f1) {
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(*d0), "=r"(*f0), "=r"(*d1), "=r"(*f1)
               : "l"(p)
               : "memory");
}

// 8 bytes of elements.
template <class S>
union Unit {
  static constexpr int kN = 8 / sizeof(S);
  uint2 v;
  S e[kN];
};

// Unit u of buf (bytes long): one 8-byte load when aligned and whole, else byte by byte
// (zero beyond the end).
template <class S>
__device__ inline Unit<S> load_unit(const S* buf, size_t u, size_t bytes, bool aligned8) {
  Unit<S> x;
  if (aligned8 && (u + 1) * 8 <= bytes) {
    x.v = reinterpret_cast<const uint2*>(buf)[u];
  } else {
    x.v = make_uint2(0, 0);
    uint8_t* dst = reinterpret_cast<uint8_t*>(&x.v);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(buf) + u * 8;
    for (size_t i = 0; i < 8 && u * 8 + i < bytes; ++i) dst[i] = src[i];
  }
  return x;
}
template <class S>
__device__ inline void store_unit(S* buf, size_t u, size_t bytes, bool aligned8, const Unit<S>& x) {
  if (aligned8 && (u + 1) * 8 <= bytes) {
    reinterpret_cast<uint2*>(buf)[u] = x.v;
  } else {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(&x.v);
    uint8_t* dst = reinterpret_cast<uint8_t*>(buf) + u * 8;
    for (size_t i = 0; i < 8 && u * 8 + i < bytes; ++i) dst[i] = src[i];
  }
}

// Waits for the line `line` to carry `flag` in both halves; its data goes to *v. False (error
// recorded) on a deadline, an abort, or a failure another thread already recorded.
__device__ bool read_line(const NodeArgs& a, const uint8_t* line, uint32_t flag, int peer,
                          uint2* v) {
  uint32_t d0, f0, d1, f1;
  load_line(line, &d0, &f0, &d1, &f1);
  if (f0 != flag || f1 != flag) {
    const uint64_t start = now_ns();
    for (uint32_t n = 1;; ++n) {
      load_line(line, &d0, &f0, &d1, &f1);
      if (f0 == flag && f1 == flag) break;
      if ((n & 1023) == 0) {
        if (host_word(&a.error->code) != 0) return false;
        if (host_word(a.abort) != 0) return fail(a.error, 2, peer, 1), false;
        if (now_ns() - start > a.timeout_ns) return fail(a.error, 1, peer, 1), false;
      }
    }
  }
  *v = make_uint2(d0, d1);
  return true;
}

template <class Tr, class Op, class Last, NodeCollective K>
__global__ void __launch_bounds__(kThreads)
    node_ll_kernel(NodeArgs a, int nranks, uint32_t blocks, uint64_t ll_offset, uint64_t ll_stride,
                   const typename Tr::S* in, typename Tr::S* out, size_t count, int root,
                   bool aligned8, Op op, Last last) {
  using S = typename Tr::S;
  using U = Unit<S>;
  const int me = a.me;
  const size_t bytes = count * sizeof(S);  // of one segment
  const size_t units = (bytes + 7) / 8;
  uint64_t* counter = a.progress + blocks + blockIdx.x;
  const uint64_t seq = *counter + 1;
  const uint32_t flag = uint32_t(seq) == 0 ? 1u : uint32_t(seq);
  const uint32_t parity = uint32_t(seq & 1);
  auto lines = [&](uint8_t* region, int src) {
    return region + ll_offset + (size_t(parity) * nranks + src) * ll_stride;
  };
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // This rank's own input: reduce_scatter's segment me, else the send buffer.
  const S* const own = in + (K == NodeCollective::kReduceScatter ? size_t(me) * count : 0);

  // Push.
  if (pushes<K>(me, root)) {
    for (size_t u = first; u < units; u += stride) {
      if constexpr (K == NodeCollective::kReduceScatter) {
        for (int p = 0; p < nranks; ++p) {
          if (p == me) continue;
          const U x = load_unit(in + size_t(p) * count, u, bytes, aligned8);
          store_line(lines(a.region[p], me) + u * 16, x.v.x, x.v.y, flag);
        }
      } else {
        const U x = load_unit(in, u, bytes, aligned8);
        for (int p = 0; p < nranks; ++p) {
          if (p != me) store_line(lines(a.region[p], me) + u * 16, x.v.x, x.v.y, flag);
        }
      }
    }
  } else if (first == 0) {
    // A broadcast's non-root: one acknowledgement line to every peer (see the header).
    for (int p = 0; p < nranks; ++p) {
      if (p != me) store_line(lines(a.region[p], me), 0, 0, flag);
    }
  }

  // Consume.
  uint8_t* const mine = lines(a.region[me], 0);  // source r's lines: mine + r * ll_stride
  bool failed = false;
  auto input = [&](int r, size_t u, U* x) -> bool {
    if (r == me) {
      *x = load_unit(own, u, bytes, aligned8);
      return true;
    }
    return read_line(a, mine + size_t(r) * ll_stride + u * 16, flag, r, &x->v);
  };
  if constexpr (K == NodeCollective::kBroadcast) {
    if (first == 0) {
      for (int r = 0; r < nranks && !failed; ++r) {
        U ack;
        if (r != me && r != root) failed = !input(r, 0, &ack);
      }
    }
  }
  for (size_t u = first; u < units && !failed; u += stride) {
    if constexpr (is_reduction(K)) {
      U acc;
      if (!input(0, u, &acc)) {
        failed = true;
        break;
      }
      for (int r = 1; r < nranks; ++r) {
        U x;
        if (!input(r, u, &x)) {
          failed = true;
          break;
        }
#pragma unroll
        for (int e = 0; e < U::kN; ++e)
          acc.e[e] = r + 1 < nranks ? op(acc.e[e], x.e[e]) : last(acc.e[e], x.e[e]);
      }
      if (!failed) store_unit(out, u, bytes, aligned8, acc);
    } else if constexpr (K == NodeCollective::kAllGather) {
      for (int r = 0; r < nranks && !failed; ++r) {
        S* dst = out + size_t(r) * count;
        if (r == me && dst == in) continue;  // in place
        U x;
        if (!input(r, u, &x))
          failed = true;
        else
          store_unit(dst, u, bytes, aligned8, x);
      }
    } else {
      if (me == root) break;  // the root's buffer is the data
      U x;
      if (!input(root, u, &x))
        failed = true;
      else
        store_unit(out, u, bytes, aligned8, x);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter = seq;
  // Blocks this launch did not use count the call too: every block's count is the number of
  // low-latency calls, so a flag names one call whatever block wrote the line.
  if (blockIdx.x == 0) {
    for (uint32_t j = gridDim.x + threadIdx.x; j < blocks; j += blockDim.x) a.progress[blocks + j] = seq;
  }
}

__global__ void wait_host_kernel(const volatile uint64_t* flag, uint64_t value,
                                 const uint32_t* abort, NodeError* error, uint64_t timeout_ns,
                                 uint64_t* waited_ns, int32_t peer, uint32_t what) {
  const uint64_t start = now_ns();
  while (*flag < value) {
    // A wait of this stream already failed: the rest of the queue drains at once, instead of
    // each later wait spending its own timeout.
    if (host_word(&error->code) != 0) return;
    if (host_word(abort) != 0) return fail(error, 2, peer, what);
    if (now_ns() - start > timeout_ns) return fail(error, 1, peer, what);
    __nanosleep(500);
  }
  if (waited_ns != nullptr) *waited_ns += now_ns() - start;  // one kernel at a time: a plain add
}

__global__ void signal_host_kernel(uint64_t* word, uint64_t value, uint64_t* stamp_ns) {
  if (stamp_ns != nullptr) *reinterpret_cast<volatile uint64_t*>(stamp_ns) = now_ns();
  __threadfence_system();
  if (word != nullptr) store_release(word, value);
}

using ops::esize;

uint64_t round_up(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }

// The chunk of a launch of `bytes`: spread over every block, at least 1 KiB, at most the
// layout's chunk; a multiple of 256 bytes (so of every element size, and 16-byte aligned).
uint64_t chunk_for(const NodeLayout& l, uint64_t bytes) {
  const uint64_t per_block = round_up((bytes + l.blocks - 1) / l.blocks, 256);
  return std::clamp<uint64_t>(per_block, 1024, l.chunk_bytes);
}

template <class Tr, NodeCollective K, class Op, class Last>
cudaError_t launch_typed(const NodeLayout& l, const NodeArgs& a, const NodeCall& c, Op op,
                         Last last, cudaStream_t stream, const NodeTimeline* tl) {
  using S = typename Tr::S;
  const auto send = reinterpret_cast<uintptr_t>(c.send), recv = reinterpret_cast<uintptr_t>(c.recv);
  const uint64_t bytes = uint64_t(c.count) * sizeof(S);  // of one segment
  // Every segment's start shares the buffer's alignment when the segment's size keeps it.
  auto aligned = [&](uint64_t m) {
    return send % m == 0 && recv % m == 0 && (!is_strided(K) || bytes % m == 0);
  };
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  if (bytes <= l.ll_max_bytes) {
    const uint64_t units = (bytes + 7) / 8;
    cfg.gridDim = dim3(uint32_t(std::min<uint64_t>(l.blocks, (units + kThreads - 1) / kThreads)));
    return cudaLaunchKernelEx(&cfg, node_ll_kernel<Tr, Op, Last, K>, a, l.nranks, l.blocks,
                              l.ll_offset(), l.ll_stride(), static_cast<const S*>(c.send),
                              static_cast<S*>(c.recv), c.count, c.root, aligned(8), op, last);
  }
  const uint64_t cb = chunk_for(l, bytes);
  const size_t nchunks = (bytes + cb - 1) / cb;
  cfg.gridDim = dim3(uint32_t(std::min<size_t>(l.blocks, nchunks)));
  Geometry g{l.flags_bytes(), l.chunk_bytes, l.slots, l.nranks};
  auto* kernel = tl != nullptr ? node_chunked_kernel<Tr, Op, Last, K, true>
                               : node_chunked_kernel<Tr, Op, Last, K, false>;
  return cudaLaunchKernelEx(&cfg, kernel, a, g, l.blocks, static_cast<const S*>(c.send),
                            static_cast<S*>(c.recv), c.count, c.root, size_t(cb / sizeof(S)),
                            nchunks, aligned(16), op, last, tl != nullptr ? *tl : NodeTimeline{});
}

// allreduce, reduce_scatter: by type and op.
template <NodeCollective K>
cudaError_t launch_reduction(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                             cudaStream_t stream, const NodeTimeline* tl) {
  const int world = l.nranks;
  return with_traits(c.type, [&]<class Tr>() -> cudaError_t {
    switch (c.op) {
      case ReduceOp::kSum:
        return launch_typed<Tr, K>(l, a, c, OpSum<Tr>{}, OpSum<Tr>{}, stream, tl);
      case ReduceOp::kProd:
        return launch_typed<Tr, K>(l, a, c, OpProd<Tr>{}, OpProd<Tr>{}, stream, tl);
      case ReduceOp::kMin:
        return launch_typed<Tr, K>(l, a, c, OpMinMax<Tr, false>{}, OpMinMax<Tr, false>{}, stream, tl);
      case ReduceOp::kMax:
        return launch_typed<Tr, K>(l, a, c, OpMinMax<Tr, true>{}, OpMinMax<Tr, true>{}, stream, tl);
      case ReduceOp::kAvg:
        return launch_typed<Tr, K>(l, a, c, OpSum<Tr>{}, OpSumDivide<Tr>{world}, stream, tl);
    }
    return cudaErrorInvalidValue;
  });
}

// all_gather, broadcast: bits moved as unsigned words of the element's size.
template <NodeCollective K>
cudaError_t launch_copy(const NodeLayout& l, const NodeArgs& a, const NodeCall& c, size_t es,
                        cudaStream_t stream, const NodeTimeline* tl) {
  switch (es) {
    case 1:
      return launch_typed<Native<uint8_t>, K>(l, a, c, NoOp{}, NoOp{}, stream, tl);
    case 2:
      return launch_typed<Native<uint16_t>, K>(l, a, c, NoOp{}, NoOp{}, stream, tl);
    case 4:
      return launch_typed<Native<uint32_t>, K>(l, a, c, NoOp{}, NoOp{}, stream, tl);
    case 8:
      return launch_typed<Native<uint64_t>, K>(l, a, c, NoOp{}, NoOp{}, stream, tl);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

uint64_t NodeLayout::flags_bytes() const {
  return round_up(2ull * blocks * kMaxNodeRanks * sizeof(uint64_t), 4096);
}
uint64_t NodeLayout::ll_offset() const {
  return flags_bytes() + uint64_t(blocks) * nranks * slots * chunk_bytes;
}
uint64_t NodeLayout::ll_stride() const { return round_up((ll_max_bytes + 7) / 8 * 16, 4096); }
uint64_t NodeLayout::region_bytes() const { return ll_offset() + 2 * nranks * ll_stride(); }
bool NodeLayout::valid() const {
  return nranks >= 1 && nranks <= kMaxNodeRanks && blocks >= 1 && blocks <= 1024 &&
         slots >= 2 && chunk_bytes >= 1024 && chunk_bytes % 256 == 0;
}

uint64_t node_chunk_bytes(const NodeLayout& l, size_t bytes) {
  if (bytes == 0 || !l.valid() || bytes <= l.ll_max_bytes) return 0;
  return chunk_for(l, bytes);
}

uint32_t node_blocks_used(const NodeLayout& l, size_t bytes) {
  if (bytes == 0 || !l.valid()) return 0;
  const uint64_t cb = chunk_for(l, bytes);
  return uint32_t(std::min<uint64_t>(l.blocks, (bytes + cb - 1) / cb));
}

cudaError_t launch_node_collective(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                                   cudaStream_t stream, const NodeTimeline* tl) {
  const size_t es = esize(c.type);
  const bool reduction =
      c.kind == NodeCollective::kAllreduce || c.kind == NodeCollective::kReduceScatter;
  if (!l.valid() || es == 0 || unsigned(c.kind) > unsigned(NodeCollective::kBroadcast) ||
      (reduction && unsigned(c.op) >= unsigned(kNumReduceOps)) ||
      (c.kind == NodeCollective::kBroadcast && (c.root < 0 || c.root >= l.nranks)) || a.me < 0 ||
      a.me >= l.nranks || a.progress == nullptr || a.error == nullptr || a.abort == nullptr ||
      (tl != nullptr && tl->stamps == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (c.count == 0) return cudaSuccess;
  if (c.send == nullptr || c.recv == nullptr || reinterpret_cast<uintptr_t>(c.send) % es != 0 ||
      reinterpret_cast<uintptr_t>(c.recv) % es != 0) {
    return cudaErrorInvalidValue;
  }
  for (int r = 0; r < l.nranks; ++r) {
    if (a.region[r] == nullptr) return cudaErrorInvalidValue;
  }
  switch (c.kind) {
    case NodeCollective::kAllreduce:
      return launch_reduction<NodeCollective::kAllreduce>(l, a, c, stream, tl);
    case NodeCollective::kReduceScatter:
      return launch_reduction<NodeCollective::kReduceScatter>(l, a, c, stream, tl);
    case NodeCollective::kAllGather:
      return launch_copy<NodeCollective::kAllGather>(l, a, c, es, stream, tl);
    case NodeCollective::kBroadcast:
      return launch_copy<NodeCollective::kBroadcast>(l, a, c, es, stream, tl);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_wait_host(const volatile uint64_t* flag, uint64_t value,
                             const uint32_t* abort, NodeError* error, uint64_t timeout_ns,
                             uint64_t* waited_ns, cudaStream_t stream, int32_t peer,
                             uint32_t what) {
  if (flag == nullptr || abort == nullptr || error == nullptr) return cudaErrorInvalidValue;
  wait_host_kernel<<<1, 1, 0, stream>>>(flag, value, abort, error, timeout_ns, waited_ns, peer, what);
  return cudaGetLastError();
}

cudaError_t load_host_sync_kernels() {
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(wait_host_kernel));
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(signal_host_kernel));
  return e;
}

cudaError_t launch_signal_host(uint64_t* word, uint64_t value, uint64_t* stamp_ns,
                               cudaStream_t stream) {
  signal_host_kernel<<<1, 1, 0, stream>>>(word, value, stamp_ns);
  return cudaGetLastError();
}

}  // namespace gradsync::kernels
