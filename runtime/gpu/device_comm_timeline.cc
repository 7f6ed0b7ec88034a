// GRADSYNC_GPU_TIMELINE: the node kernels' per-chunk records of the last call, kept in GPU
// memory and read back as a gpu::Timeline.
#include "gpu/device_comm.h"

#include "common/log.h"
#include "gpu/device_comm_impl.h"

namespace gradsync {

using namespace device_comm_detail;

// GRADSYNC_GPU_TIMELINE: one record per block of the layout, kMaxChunksPerBlock chunks each.
Status DeviceComm::setup_timeline() {
  Impl& m = *impl_;
  const uint64_t words = uint64_t(m.layout.blocks) *
                         kernels::node_timeline_stride(gpu::kMaxChunksPerBlock);
  GS_CUDA(cudaMalloc(reinterpret_cast<void**>(&m.timeline), words * sizeof(uint64_t)),
          "cudaMalloc of the timeline");
  GS_CUDA(cudaMemset(m.timeline, 0, words * sizeof(uint64_t)), "cudaMemset");
  m.held.gpu_bytes += words * sizeof(uint64_t);
  GS_CUDA(cudaEventCreateWithFlags(&m.timeline_event, cudaEventDisableTiming), "cudaEventCreate");
  GS_CUDA(cudaStreamCreateWithFlags(&m.timeline_stream, cudaStreamNonBlocking), "cudaStreamCreate");
  GS_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  log::get("gpu")->info("{}: GPU timeline on (GRADSYNC_GPU_TIMELINE): {} blocks x {} chunks, {} KiB",
                        who(), m.layout.blocks, gpu::kMaxChunksPerBlock, words * 8 / 1024);
  return Status::Ok();
}

Result<gpu::Timeline> DeviceComm::last_timeline() {
  Impl& m = *impl_;
  if (m.path != Impl::Path::kIpc) {
    return Status(Code::kFailedPrecondition,
                  who() + ": the GPU timeline is only recorded on the cuda-ipc path (this "
                          "communicator's is " + path() + ")");
  }
  if (m.timeline == nullptr) {
    return Status(Code::kFailedPrecondition,
                  who() + ": the GPU timeline is off (set GRADSYNC_GPU_TIMELINE=1 before the "
                          "communicator is created)");
  }
  if (!m.last.recorded) return Status(Code::kFailedPrecondition, who() + ": " + m.last.why_not);
  DeviceScope scope;
  if (Status e = scope.enter(cfg_.device); !e.ok()) return Status(e.code(), who() + ": " + e.message());
  GS_CUDA(cudaEventSynchronize(m.timeline_event), "cudaEventSynchronize (timeline)");
  if (Status s = async_error(); !s.ok()) {
    return Status(s.code(), "no GPU timeline: the last call failed: " + s.message());
  }

  gpu::Timeline t;
  t.rank = cfg_.rank;
  t.world = cfg_.world_size;
  t.collective = to_string(m.last.kind);
  t.bytes = m.last.bytes;
  t.chunk_bytes = kernels::node_chunk_bytes(m.layout, t.bytes);
  t.slots = m.layout.slots;
  t.nchunks = (t.bytes + t.chunk_bytes - 1) / t.chunk_bytes;
  t.blocks = m.layout.blocks;
  t.blocks_used = kernels::node_blocks_used(m.layout, t.bytes);
  const uint64_t stride = kernels::node_timeline_stride(gpu::kMaxChunksPerBlock);
  std::vector<uint64_t> words(size_t(t.blocks_used) * stride);
  GS_CUDA(cudaMemcpyAsync(words.data(), m.timeline, words.size() * sizeof(uint64_t),
                          cudaMemcpyDeviceToHost, m.timeline_stream),
          "cudaMemcpyAsync (timeline)");
  GS_CUDA(cudaStreamSynchronize(m.timeline_stream), "cudaStreamSynchronize (timeline)");
  for (uint32_t b = 0; b < t.blocks_used; ++b) {
    const uint64_t* r = words.data() + b * stride;
    gpu::BlockTimeline bt;
    bt.block = b;
    bt.start_ns = r[0];
    bt.end_ns = r[1];
    bt.chunks = uint32_t(r[2]);
    bt.first_seq = r[3];
    const uint32_t want = gpu::chunks_of_block(t.nchunks, t.blocks_used, b);
    if (bt.chunks != want) {
      return Status(Code::kInternal, who() + ": GPU timeline: block " + std::to_string(b) +
                                         " recorded " + std::to_string(bt.chunks) +
                                         " chunks, the call has " + std::to_string(want));
    }
    const uint32_t kept = std::min(bt.chunks, gpu::kMaxChunksPerBlock);
    for (uint32_t i = 0; i < kept; ++i) {
      const uint64_t* c = r + kernels::kTimelineHeader + size_t(i) * kernels::kTimelineSteps;
      bt.steps.push_back({c[kernels::kCreditWait], c[kernels::kPushStart], c[kernels::kPushEnd],
                          c[kernels::kReadyWait], c[kernels::kFoldStart], c[kernels::kFoldEnd]});
    }
    t.block.push_back(std::move(bt));
  }
  t.summary = gpu::summarize(t);
  return t;
}

}  // namespace gradsync
