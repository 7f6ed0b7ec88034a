// The one-node all_gather and broadcast kernels of every type width (cuda_node_launch.cuh).
#include "kernels/cuda_node_launch.cuh"

namespace gradsync::kernels::node {

cudaError_t launch_all_gather(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                              cudaStream_t stream, const NodeTimeline* tl) {
  return launch_copy<NodeCollective::kAllGather>(l, a, c, esize(c.type), stream, tl);
}

cudaError_t launch_broadcast(const NodeLayout& l, const NodeArgs& a, const NodeCall& c,
                             cudaStream_t stream, const NodeTimeline* tl) {
  return launch_copy<NodeCollective::kBroadcast>(l, a, c, esize(c.type), stream, tl);
}

}  // namespace gradsync::kernels::node
