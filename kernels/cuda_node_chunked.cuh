// The chunked one-shot protocol of the one-node collectives (cuda_node.cuh says what each
// collective pushes and consumes, and how the flags and the timeline work).
#pragma once

#include "kernels/cuda_node_device.cuh"

namespace gradsync::kernels::node {

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
    if (!wait_credits(a, g, b, blocks, k, &ok)) return false;
    stamp(i, kPushStart);
    // reduce_scatter: peer p gets segment p of the input; the others: the input.
    auto src_of = [&](int p) {
      return in + (K == NodeCollective::kReduceScatter ? size_t(p) * count : 0) + e0;
    };
    auto dst_of = [&](int p) { return reinterpret_cast<S*>(g.slot(a.region[p], b, me, s)); };
    push_chunk<S, K != NodeCollective::kReduceScatter>(src_of, dst_of, n, me, len, vec);
    // kPushEnd before the release: a peer sees ready after this stamp.
    publish_ready(a, g, b, k, uint64_t(len) * sizeof(S) * (n - 1), [&] { stamp(i, kPushEnd); });
    return true;
  };

  auto consume = [&](size_t i) -> bool {
    const uint64_t k = base + i;
    const uint32_t s = uint32_t(k % g.slots);
    size_t e0, len;
    chunk(i, &e0, &len);
    stamp(i, kReadyWait);
    if (!wait_ready(a, g, b, k, [&](int r) { return pushes<K>(r, root); }, &ok)) return false;
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
    // Every read of this slot is done before the peers may refill it; kFoldEnd before the
    // release: a peer's push into the slot starts after it.
    release_slots(a, g, b, blocks, k, [&] { stamp(i, kFoldEnd); });
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

}  // namespace gradsync::kernels::node
