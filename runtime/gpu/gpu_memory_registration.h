// Registering GPU memory with a verbs device, so the NIC reads and writes slots in GPU memory
// (GPUDirect RDMA, design §3 and docs/gpudirect.md).
//
// Order, as NCCL and UCX do it (shared/reference/gdr_verbs.md §1):
//   1. dma-buf: the GPU says CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, the driver exports the
//      host-page-aligned range around the buffer as a dma-buf fd (cuMemGetHandleForAddressRange,
//      CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, flags 0), and the verbs device registers it
//      (ibv_reg_dmabuf_mr, offset 0, iova = the aligned start, so remote peers address the
//      buffer with its GPU virtual address, exactly as with a peermem MR).
//   2. peermem: plain ibv_reg_mr on the device pointer, when nvidia-peermem (or the older
//      nv_peer_mem) is loaded (/sys/module/nvidia_peermem, /sys/module/nv_peer_mem).
//   3. Neither: kUnavailable, saying that host staging will be used and why each method failed.
//
// The CUDA driver API is reached through cudaGetDriverEntryPointByVersion (the CUDA 13 form of
// cudaGetDriverEntryPoint): nothing links libcuda, and a binary with this code starts where the
// driver or an entry point is missing (registration then fails with the reason).
//
// Built only with CUDA and the verbs headers (runtime/CMakeLists.txt).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/fd.h"
#include "gradsync/status.h"
#include "transport/verbs/verbs.h"

namespace gradsync {

// A registered GPU buffer. Move-only; destroying it deregisters the MR, then closes the
// dma-buf fd. The fd is kept open for the MR's whole life: ibv_reg_dmabuf_mr(3) says nothing
// about closing it after registration (NCCL and perftest close it at once, relying on the
// kernel's own reference), so we take the reading that is safe on every kernel and provider.
class GpuRegistration {
 public:
  // The MR. For dma-buf it covers the host-page-aligned range around the buffer, so
  // mr().addr() may be below ptr(); remote peers write to ptr() + k with mr().rkey().
  const verbs::MemoryRegion& mr() const { return mr_; }
  const std::string& method() const { return method_; }  // "dma-buf" or "peermem"
  int dmabuf_fd() const { return fd_.get(); }            // -1 for peermem
  uint64_t ptr() const { return ptr_; }                  // the buffer as given
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }  // the CUDA device the memory is on

 private:
  friend Result<GpuRegistration> register_gpu_memory(const verbs::ProtectionDomain&, void*, size_t, int);
  // Members are destroyed in reverse order: the MR first, then the fd.
  Fd fd_;
  std::string method_;
  uint64_t ptr_ = 0;
  size_t bytes_ = 0;
  int device_ = -1;
  verbs::MemoryRegion mr_;
};

// Registers [dptr, dptr + bytes) of CUDA device memory (cudaMalloc, cuMemAlloc) with the
// verbs device of `pd`, dma-buf first, then peermem. `access`: IBV_ACCESS_* flags (dma-buf
// allows only LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC, RELAXED_ORDERING).
// Errors: kInvalidArgument for a null/empty range or memory that is not CUDA device memory
// (host, pinned host or managed: register those with verbs::MemoryRegion::create);
// kUnavailable when neither method works, naming both reasons ("host staging will be used").
// Also sets CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on the buffer (best effort), so a synchronous
// cudaMemcpy into it has landed when it returns, before the NIC reads it.
Result<GpuRegistration> register_gpu_memory(const verbs::ProtectionDomain& pd, void* dptr, size_t bytes,
                                            int access);

// GPUDirect RDMA write ordering (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING):
// true when it is below OWNER (i.e. NONE), meaning that a completed RDMA write into this
// device's memory may not yet be visible to its kernels. The H200 reports OWNER (false).
Result<bool> gdr_flush_needed(int device);

// cuFlushGPUDirectRDMAWrites(TARGET_CURRENT_CTX, TO_OWNER) on the current device (through the
// driver entry point). Blocks until RDMA writes already completed into the current device's
// memory are visible to it.
//
// When to call it: on a device where gdr_flush_needed() is true, the host thread that polls
// the WRITE_WITH_IMM completion for a slot in GPU memory must call it after that completion
// and before it launches (or releases, through a flag) the kernel that reads the slot. The
// completion only says the NIC is done; without ordering the GPU may still see stale bytes.
// Where gdr_flush_needed() is false (OWNER), the owning GPU needs no flush and this call would
// be a no-op; a *different* GPU reading the slot (NVLink peer access) is outside OWNER scope
// and is not covered by this function (it flushes to the owner only).
Status flush_gdr_writes();

}  // namespace gradsync
