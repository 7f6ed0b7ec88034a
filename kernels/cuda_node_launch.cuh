// How a one-node call becomes a launch: the protocol (cuda_node.cuh: node_protocol), the chunk
// and the grid, by element type and op. Instantiated per collective in its own translation
// unit (cuda_node_allreduce.cu, cuda_node_reduce_scatter.cu, cuda_node_gather.cu), so that
// the kernels of the four collectives compile in parallel.
#pragma once

#include <algorithm>

#include "kernels/cuda_node_chunked.cuh"
#include "kernels/cuda_node_ll.cuh"
#include "kernels/cuda_node_two_shot.cuh"

namespace gradsync::kernels::node {

using ops::esize;

inline uint64_t round_up(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }

// The chunk of a launch of `bytes`: spread over every block, at least 1 KiB, at most the
// layout's chunk; a multiple of 256 bytes (so of every element size, and 16-byte aligned).
inline uint64_t chunk_for(const NodeLayout& l, uint64_t bytes) {
  const uint64_t per_block = round_up((bytes + l.blocks - 1) / l.blocks, 256);
  return std::clamp<uint64_t>(per_block, 1024, l.chunk_bytes);
}

// A two-shot segment: a rank's share of the buffer, rounded up to 256 bytes so that every
// segment starts aligned (the last ones shorter, or empty).
inline uint64_t two_shot_segment_bytes(const NodeLayout& l, uint64_t bytes) {
  return round_up((bytes + l.nranks - 1) / l.nranks, 256);
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
  Geometry g{l.flags_bytes(), l.chunk_bytes, l.slots, l.nranks};
  const NodeProtocol protocol = node_protocol(l, K, bytes);
  if constexpr (K == NodeCollective::kAllreduce || K == NodeCollective::kBroadcast) {
    if (protocol == NodeProtocol::kTwoShot) {
      const uint64_t seg_bytes = two_shot_segment_bytes(l, bytes);
      const uint64_t cb = chunk_for(l, seg_bytes);
      const size_t nchunks = (seg_bytes + cb - 1) / cb;
      cfg.gridDim = dim3(uint32_t(std::min<size_t>(l.blocks, nchunks)));
      return cudaLaunchKernelEx(&cfg, node_two_shot_kernel<Tr, Op, Last, K>, a, g, l.blocks,
                                static_cast<const S*>(c.send), static_cast<S*>(c.recv), c.count,
                                size_t(seg_bytes / sizeof(S)), c.root, size_t(cb / sizeof(S)),
                                nchunks, aligned(16), op, last);
    }
  }
  if (protocol == NodeProtocol::kLowLatency) {
    const uint64_t units = (bytes + 7) / 8;
    cfg.gridDim = dim3(uint32_t(std::min<uint64_t>(l.blocks, (units + kThreads - 1) / kThreads)));
    return cudaLaunchKernelEx(&cfg, node_ll_kernel<Tr, Op, Last, K>, a, l.nranks, l.blocks,
                              l.ll_offset(), l.ll_stride(), static_cast<const S*>(c.send),
                              static_cast<S*>(c.recv), c.count, c.root, aligned(8), op, last);
  }
  const uint64_t cb = chunk_for(l, bytes);
  const size_t nchunks = (bytes + cb - 1) / cb;
  cfg.gridDim = dim3(uint32_t(std::min<size_t>(l.blocks, nchunks)));
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

// One collective's launcher (the translation units above define them).
cudaError_t launch_allreduce(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                             cudaStream_t stream, const NodeTimeline* tl);
cudaError_t launch_reduce_scatter(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                                  cudaStream_t stream, const NodeTimeline* tl);
cudaError_t launch_all_gather(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                              cudaStream_t stream, const NodeTimeline* tl);
cudaError_t launch_broadcast(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                             cudaStream_t stream, const NodeTimeline* tl);

}  // namespace gradsync::kernels::node
