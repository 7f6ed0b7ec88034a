// The one-node reduce_scatter kernels of every type and op (cuda_node_launch.cuh).
#include "kernels/cuda_node_launch.cuh"

namespace gradsync::kernels::node {

cudaError_t launch_reduce_scatter(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                                  cudaStream_t stream, const NodeTimeline* tl) {
  return launch_reduction<NodeCollective::kReduceScatter>(l, a, c, stream, tl);
}

}  // namespace gradsync::kernels::node
