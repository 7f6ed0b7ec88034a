// One node: the CUDA IPC region the node kernels push into, mapped from every rank's memory
// (set up collectively, agreed usable or not), and its release.
#include "gpu/device_comm.h"

#include <algorithm>

#include "common/log.h"
#include "gpu/device_comm_impl.h"
#include "kernels/cuda_reduce.cuh"

namespace gradsync {

using namespace device_comm_detail;

// Collective over the whole world, every rank on one node (every rank calls it at the same
// point): the CUDA IPC kernels among them. *usable is agreed.
Status DeviceComm::setup_ipc(bool* usable) {
  Impl& m = *impl_;
  *usable = false;
  const int n = cfg_.world_size, me = cfg_.rank;
  cudaDeviceProp prop{};
  GS_CUDA(cudaGetDeviceProperties(&prop, cfg_.device), "cudaGetDeviceProperties");
  // Every rank's kernel must be resident at once (the blocks wait on each other): ranks that
  // share a GPU share its SMs (count_gpu_shares).
  const int shares = m.gpu_shares;
  // Defaults measured on 2 H200s over NVLink (docs/benchmarks.md): 128 blocks of 256 KiB
  // chunks reach NCCL's bus bandwidth; the chunk shrinks with more ranks so that the region
  // stays 256 MiB. The low-latency protocol below GRADSYNC_GPU_LL_MAX bytes.
  int32_t blocks = int32_t(env_positive("GRADSYNC_GPU_BLOCKS", 128));
  blocks = std::clamp(blocks, 1, std::max(1, prop.multiProcessorCount / shares));
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&blocks, &blocks, 1, DataType::kInt32, ReduceOp::kMin));
  m.layout.nranks = n;
  m.layout.blocks = uint32_t(blocks);
  m.layout.slots = uint32_t(std::max(2L, env_positive("GRADSYNC_GPU_SLOTS", 4)));
  const long chunk = std::max(4096L, (512L << 10) / std::max(2, n));
  m.layout.chunk_bytes = uint64_t(env_positive("GRADSYNC_GPU_CHUNK", chunk)) / 256 * 256;
  const char* ll = std::getenv("GRADSYNC_GPU_LL_MAX");
  m.layout.ll_max_bytes = ll && *ll ? uint64_t(std::strtoull(ll, nullptr, 10)) : uint64_t(1 << 20);
  // From 3 ranks, allreduce and broadcast from this size go two-shot (kernels/
  // cuda_node_two_shot.cuh): 2 (n-1)/n of the buffer sent per rank instead of n - 1 buffers.
  // GRADSYNC_GPU_TWOSHOT_MIN=0: never.
  const char* two_shot = std::getenv("GRADSYNC_GPU_TWOSHOT_MIN");
  m.layout.two_shot_min_bytes = two_shot != nullptr && std::strcmp(two_shot, "0") == 0
                                    ? 0
                                    : uint64_t(env_positive("GRADSYNC_GPU_TWOSHOT_MIN", kTwoShotMinBytes));
  // The region is most of the communicator's GPU memory, which stays within
  // GRADSYNC_GPU_MEMORY_MAX MiB (default 320, above the defaults at every rank count: 264 MiB
  // at 2 ranks, 288 at 8); a smaller budget shrinks the chunk, then the low-latency lines.
  const uint64_t limit = gpu_memory_budget(), used = memory().gpu_bytes;
  const uint64_t budget = limit > used ? limit - used : 0;
  while (m.layout.region_bytes() > budget && m.layout.chunk_bytes > 4096)
    m.layout.chunk_bytes = std::max<uint64_t>(4096, m.layout.chunk_bytes / 2 / 256 * 256);
  while (m.layout.region_bytes() > budget && m.layout.ll_max_bytes > (64u << 10)) m.layout.ll_max_bytes /= 2;
  // Every rank must cut chunks, slots and protocols alike (each computes where it writes in
  // its peers' regions): the smallest of every rank's settings.
  {
    int64_t agreed[4] = {int64_t(m.layout.slots), int64_t(m.layout.chunk_bytes),
                         int64_t(m.layout.ll_max_bytes), int64_t(m.layout.two_shot_min_bytes)};
    GS_RETURN_IF_ERROR(ops_.allreduce_now(agreed, agreed, 4, DataType::kInt64, ReduceOp::kMin));
    m.layout.slots = uint32_t(agreed[0]);
    m.layout.chunk_bytes = uint64_t(agreed[1]);
    m.layout.ll_max_bytes = uint64_t(agreed[2]);
    m.layout.two_shot_min_bytes = uint64_t(agreed[3]);
  }
  // Agreed: a rank whose region does not fit fails the set-up on every rank, not only its own.
  int32_t fits = m.layout.region_bytes() <= budget ? 1 : 0;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&fits, &fits, 1, DataType::kInt32, ReduceOp::kMin));
  if (fits == 0) {
    const std::string over = "the CUDA IPC region needs " + std::to_string(m.layout.region_bytes() >> 20) +
                             " MiB with " + std::to_string(blocks) + " blocks and " + std::to_string(n) +
                             " ranks, over the " + std::to_string(budget >> 20) + " MiB left on some rank of " +
                             "GRADSYNC_GPU_MEMORY_MAX = " + std::to_string(limit >> 20) + " MiB";
    return {Code::kInvalidArgument, who() + ": " + over + ": raise it, or lower GRADSYNC_GPU_BLOCKS"};
  }
  if (!m.layout.valid()) {
    return {Code::kInvalidArgument, who() + ": GPU layout blocks=" + std::to_string(blocks) +
                                         " slots=" + std::to_string(m.layout.slots) + " chunk=" +
                                         std::to_string(m.layout.chunk_bytes) + " is invalid"};
  }
  GS_CUDA(cudaMalloc(&m.region, m.layout.region_bytes()), "cudaMalloc of the IPC region (" +
                                                              std::to_string(m.layout.region_bytes()) + " bytes)");
  GS_CUDA(cudaMemset(m.region, 0, m.layout.flags_bytes()), "cudaMemset");
  GS_CUDA(cudaMemset(static_cast<uint8_t*>(m.region) + m.layout.ll_offset(), 0,
                     m.layout.region_bytes() - m.layout.ll_offset()), "cudaMemset");
  // The blocks' counts, then the bytes-sent counter (NodeArgs::sent).
  const size_t progress_bytes = (2 * m.layout.blocks + 1) * sizeof(uint64_t);
  GS_CUDA(cudaMalloc(reinterpret_cast<void**>(&m.progress), progress_bytes), "cudaMalloc");
  GS_CUDA(cudaMemset(m.progress, 0, progress_bytes), "cudaMemset");
  m.held.gpu_bytes += m.layout.region_bytes() + progress_bytes;
  GS_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  std::vector<IpcEntry> table(static_cast<size_t>(n));
  std::memset(table.data(), 0, table.size() * sizeof(IpcEntry));
  IpcEntry& mine = table[size_t(cfg_.rank)];
  auto exported = ipc_export(m.region, cfg_.device);
  if (!exported.ok()) return Status(exported.status().code(), who() + ": " + exported.status().message());
  mine.ipc = *exported;
  (void)cudaDeviceGetPCIBusId(mine.bus_id, sizeof(mine.bus_id) - 1, cfg_.device);
  GS_RETURN_IF_ERROR(ops_.allreduce_now(table.data(), table.data(), table.size() * sizeof(IpcEntry),
                                        DataType::kUInt8, ReduceOp::kSum));

  std::string why;
  m.args.me = me;
  for (int p = 0; p < n; ++p) {
    if (p == me) {
      m.args.region[p] = static_cast<uint8_t*>(m.region);
      continue;
    }
    const IpcEntry& e = table[size_t(p)];
    bool opened = false;
    auto ptr = ipc_open(e.ipc, cfg_.device, &opened);
    if (!ptr.ok()) {
      why = "the region of rank " + std::to_string(p) + " (GPU " + e.bus_id + "): " +
            ptr.status().message();
      break;
    }
    if (opened) m.opened.push_back(*ptr);
    m.args.region[p] = static_cast<uint8_t*>(*ptr);
  }
  int32_t ok = why.empty() ? 1 : 0;
  GS_RETURN_IF_ERROR(ops_.allreduce_now(&ok, &ok, 1, DataType::kInt32, ReduceOp::kMin));
  if (ok == 0) {
    auto log = log::get("gpu");
    if (!why.empty()) log->warn("{}: no CUDA IPC path: {}", who(), why);
    else log->warn("{}: a peer could not open CUDA IPC", who());
    release_ipc();
    return Status::Ok();
  }
  m.args.progress = m.progress;
  m.args.sent = m.progress + 2 * m.layout.blocks;
  m.args.error = &m.words_dev->error;
  m.args.abort = &m.words_dev->abort;
  m.args.timeout_ns = uint64_t(cfg_.op_timeout.count()) * 1'000'000ull;
  *usable = true;
  return Status::Ok();
}

void DeviceComm::release_ipc() {
  Impl& m = *impl_;
  for (void* p : m.opened) ipc_close(p, cfg_.device);
  m.opened.clear();
  if (m.region) (void)cudaFree(m.region);
  if (m.progress) (void)cudaFree(m.progress);
  if (m.progress) m.held.gpu_bytes -= m.layout.region_bytes() + (2 * m.layout.blocks + 1) * sizeof(uint64_t);
  m.region = nullptr;
  m.progress = nullptr;
}

}  // namespace gradsync
