// The two-shot protocol of the one-node collectives (cuda_node.cuh): allreduce and broadcast
// with the bytes of a ring, in two rounds of direct pushes instead of 2(n-1) hops.
//
// The buffer is cut into nranks segments of `seg` elements (the last ones shorter or empty
// when count is not a multiple); rank s owns segment s.
//   round 1  allreduce: every rank pushes segment s of its input to rank s only, and rank s
//            folds segment s of every input in rank order (the reduce_scatter of the one-shot
//            kernel: bit-equal to the host loops' fold), writing it to recv;
//            broadcast: the root pushes segment s to rank s, which copies it to its buffer.
//   round 2  every rank pushes its (now final) segment of recv to every peer, and copies each
//            peer's segment into place (an all_gather in place).
// Bytes each rank sends: 2 (n-1) seg elements, against (n-1) count for the one-shot push:
// at 8 ranks, 1.75 buffers against 7 (a broadcast root sends the same 2 (n-1) seg, a
// non-root (n-1) seg, against the root's (n-1) count one-shot).
//
// Chunk j of a segment belongs to block j % blocks on every rank, as in the chunked
// protocol, and each chunk index i of a block takes two sequence numbers: base + 2i (round
// 1) and base + 2i + 1 (round 2), both with the chunked protocol's slots, credits and flags
// (cuda_node_device.cuh), so two-shot, one-shot and low-latency calls interleave freely.
// Order per block: push1(0), then for each i: consume1(i), push2(i), push1(i + 1),
// consume2(i). Pushes and consumes each go in sequence order, and a push of sequence k waits
// only for the peers' consume of k - slots, which each peer reached before its own push of
// k - slots + 1 <= k: no cycle with slots >= 2.
#pragma once

#include "kernels/cuda_node_device.cuh"

namespace gradsync::kernels::node {

template <class Tr, class Op, class Last, NodeCollective K>
__global__ void __launch_bounds__(kThreads)
    node_two_shot_kernel(NodeArgs a, Geometry g, uint32_t blocks, const typename Tr::S* in,
                         typename Tr::S* out, size_t count, size_t seg, int root,
                         size_t chunk_elems, size_t nchunks, bool vec, Op op, Last last) {
  static_assert(K == NodeCollective::kAllreduce || K == NodeCollective::kBroadcast);
  using S = typename Tr::S;
  const uint32_t b = blockIdx.x;
  const uint32_t nb = gridDim.x;
  const int me = a.me;
  const int n = g.nranks;
  __shared__ uint64_t base;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    base = a.progress[b];
    ok = 1;
  }
  __syncthreads();
  const size_t mine = nchunks > b ? (nchunks - 1 - b) / nb + 1 : 0;
  uint8_t* const my_region = a.region[me];
  auto none = [] {};

  // Chunk i of this block in segment s: elements [start, start + len) of the buffer (len 0
  // where the segment is short or empty).
  auto start = [&](int s, size_t i) { return size_t(s) * seg + (b + i * nb) * chunk_elems; };
  auto len = [&](int s, size_t i) -> size_t {
    const size_t e0 = start(s, i);
    const size_t end = min(min(e0 + chunk_elems, size_t(s + 1) * seg), count);
    return end > e0 ? end - e0 : 0;
  };
  auto slot = [&](uint8_t* region, int src, uint64_t k) {
    return reinterpret_cast<S*>(g.slot(region, b, src, uint32_t(k % g.slots)));
  };

  // Round 1, push: segment p of the input to rank p.
  auto push1 = [&](size_t i) -> bool {
    const uint64_t k = base + 2 * i;
    uint64_t bytes = 0;
    if (K == NodeCollective::kAllreduce || me == root) {
      if (!wait_credits(a, g, b, blocks, k, &ok)) return false;
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        copy_chunk(slot(a.region[p], me, k), in + start(p, i), len(p, i), vec, false);
        bytes += len(p, i) * sizeof(S);
      }
      publish_ready(a, g, b, k, bytes, none);
    }
    return true;
  };
  // Round 1, consume: this rank's segment of the result.
  auto consume1 = [&](size_t i) -> bool {
    const uint64_t k = base + 2 * i;
    auto pushing = [&](int r) { return K == NodeCollective::kAllreduce || r == root; };
    if (!wait_ready(a, g, b, k, pushing, &ok)) return false;
    const size_t e0 = start(me, i), l = len(me, i);
    if constexpr (K == NodeCollective::kAllreduce) {
      auto src_of = [&](int r) -> const S* { return r == me ? in + e0 : slot(my_region, r, k); };
      fold_chunk(src_of, n, me, out + e0, l, vec, op, last);
    } else {
      if (me != root) copy_chunk(out + e0, slot(my_region, root, k), l, vec, true);
    }
    release_slots(a, g, b, blocks, k, none);
    return true;
  };
  // Round 2, push: this rank's final segment to every peer (the barrier in release_slots
  // made consume1's stores visible to the block).
  auto push2 = [&](size_t i) -> bool {
    const uint64_t k = base + 2 * i + 1;
    if (!wait_credits(a, g, b, blocks, k, &ok)) return false;
    const S* src = out + start(me, i);
    auto src_of = [&](int) { return src; };
    auto dst_of = [&](int p) { return slot(a.region[p], me, k); };
    push_chunk<S, true>(src_of, dst_of, n, me, len(me, i), vec);
    publish_ready(a, g, b, k, uint64_t(len(me, i)) * sizeof(S) * (n - 1), none);
    return true;
  };
  // Round 2, consume: every peer's segment into place (a broadcast root has them all and
  // reads nothing; it still releases the sequence).
  auto consume2 = [&](size_t i) -> bool {
    const uint64_t k = base + 2 * i + 1;
    const bool reads = K == NodeCollective::kAllreduce || me != root;
    if (!wait_ready(a, g, b, k, [&](int) { return reads; }, &ok)) return false;
    for (int r = 0; r < n && reads; ++r) {
      if (r != me) copy_chunk(out + start(r, i), slot(my_region, r, k), len(r, i), vec, true);
    }
    release_slots(a, g, b, blocks, k, none);
    return true;
  };

  if (mine == 0) return;
  if (!push1(0)) return;
  for (size_t i = 0; i < mine; ++i) {
    if (!consume1(i) || !push2(i)) return;
    if (i + 1 < mine && !push1(i + 1)) return;
    if (!consume2(i)) return;
  }
  if (threadIdx.x == 0) a.progress[b] = base + 2 * mine;
}

}  // namespace gradsync::kernels::node
