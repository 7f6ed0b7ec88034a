// One-node GPU collectives by peer pushes (cuda_node.cuh): the layout, the protocol choice,
// the checks and dispatch of a call, and the host-flag wait kernels.
#include "kernels/cuda_node.cuh"

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda_node_launch.cuh"

namespace gradsync::kernels {
namespace {

using namespace node;  // NOLINT: the one-node helpers are this file's vocabulary

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

NodeProtocol node_protocol(const NodeLayout& l, NodeCollective kind, size_t bytes) {
  const bool two_shot_kind = kind == NodeCollective::kAllreduce || kind == NodeCollective::kBroadcast;
  if (two_shot_kind && l.nranks >= 3 && l.two_shot_min_bytes != 0 && bytes >= l.two_shot_min_bytes)
    return NodeProtocol::kTwoShot;
  return bytes <= l.ll_max_bytes ? NodeProtocol::kLowLatency : NodeProtocol::kOneShot;
}

const char* to_string(NodeProtocol p) {
  switch (p) {
    case NodeProtocol::kLowLatency: return "low-latency";
    case NodeProtocol::kOneShot: return "one-shot";
    case NodeProtocol::kTwoShot: return "two-shot";
  }
  return "?";
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
    case NodeCollective::kAllreduce: return launch_allreduce(l, a, c, stream, tl);
    case NodeCollective::kReduceScatter: return launch_reduce_scatter(l, a, c, stream, tl);
    case NodeCollective::kAllGather: return launch_all_gather(l, a, c, stream, tl);
    case NodeCollective::kBroadcast: return launch_broadcast(l, a, c, stream, tl);
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
