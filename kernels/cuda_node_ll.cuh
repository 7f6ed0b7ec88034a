// The low-latency protocol of the one-node collectives (cuda_node.cuh): a flag in every 8
// bytes, no slots, no credits.
#pragma once

#include "kernels/cuda_node_device.cuh"
#include "kernels/kernel_stamps.cuh"

namespace gradsync::kernels::node {

// Launch stamps (kernel_stamps.cuh), one log per translation unit: set only in
// cuda_node_allreduce.cu's (set_ll_stamps), so allreduce launches alone record.
static __device__ KernelStampLog g_ll_stamps;

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
// `what` is the NodeError's (1: a node kernel's wait for a peer's chunk).
__device__ inline bool read_line(const NodeArgs& a, const uint8_t* line, uint32_t flag, int peer,
                          uint2* v, uint32_t what = 1) {
  uint32_t d0, f0, d1, f1;
  load_line(line, &d0, &f0, &d1, &f1);
  if (f0 != flag || f1 != flag) {
    const uint64_t start = now_ns();
    for (uint32_t n = 1;; ++n) {
      load_line(line, &d0, &f0, &d1, &f1);
      if (f0 == flag && f1 == flag) break;
      if ((n & 1023) == 0) {
        if (host_word(&a.error->code) != 0) return false;
        if (host_word(a.abort) != 0) return fail(a.error, 2, peer, what), false;
        if (now_ns() - start > a.timeout_ns) return fail(a.error, 1, peer, what), false;
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
  KernelStamp* const stamp =
      threadIdx.x == 0 ? stamp_begin(g_ll_stamps, reinterpret_cast<uintptr_t>(a.progress), kStampNodeLowLatency)
                       : nullptr;
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
  // Line bytes this block stores into peers' regions (thread 0 counts for the block: the
  // units u = first + j * stride of its threads).
  uint64_t stored = 0;
  if (pushes<K>(me, root)) {
    const size_t bd = blockDim.x, rem = units % stride, lo = size_t(blockIdx.x) * bd;
    const size_t block_units = units / stride * bd + (rem > lo ? min(rem - lo, bd) : 0);
    stored = uint64_t(block_units) * 16 * uint64_t(nranks - 1);
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
    stored = 16 * uint64_t(nranks - 1);
  }
  if (a.sent != nullptr && stored != 0 && threadIdx.x == 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(a.sent), static_cast<unsigned long long>(stored));

  stamp_mark(stamp, 1);

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
  stamp_mark(stamp, 2);
  if (threadIdx.x == 0) *counter = seq;
  // Blocks this launch did not use count the call too: every block's count is the number of
  // low-latency calls, so a flag names one call whatever block wrote the line.
  if (blockIdx.x == 0) {
    for (uint32_t j = gridDim.x + threadIdx.x; j < blocks; j += blockDim.x) a.progress[blocks + j] = seq;
  }
  stamp_end(stamp, 3, 0);
}

}  // namespace gradsync::kernels::node
