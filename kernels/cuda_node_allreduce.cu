// The one-node allreduce kernels of every type and op (cuda_node_launch.cuh).
#include "kernels/cuda_node_launch.cuh"

namespace gradsync::kernels::node {

cudaError_t launch_allreduce(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                             cudaStream_t stream, const NodeTimeline* tl) {
  return launch_reduction<NodeCollective::kAllreduce>(l, a, c, stream, tl);
}

cudaError_t set_ll_stamps(const KernelStampLog& log) { return cudaMemcpyToSymbol(g_ll_stamps, &log, sizeof(log)); }

}  // namespace gradsync::kernels::node
