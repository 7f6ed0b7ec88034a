// GPU memory one rank exports and the other ranks of its node map: CUDA IPC between
// processes, and the address itself between ranks of one process (ranks as threads share its
// CUDA context, where cudaIpcOpenMemHandle refuses the process's own memory). The one-node
// kernels' region (gpu/device_comm.cc) and the RDMA channels' direct region
// (gpu/gdr_channels.cc) go round this way.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gradsync/gradsync.h"

namespace gradsync {

// Plain bytes, summed into a set-up exchange like any other row.
struct IpcHandle {
  int32_t pid;
  int32_t device;
  uint64_t addr;
  cudaIpcMemHandle_t handle;
};

// The handle of `ptr`, memory of CUDA device `device` allocated with cudaMalloc.
Result<IpcHandle> ipc_export(void* ptr, int device);
// Maps `h` for use on `device` (the current device afterwards). *opened is true when the
// mapping must be released with ipc_close; false for memory of this very process.
Result<void*> ipc_open(const IpcHandle& h, int device, bool* opened);
void ipc_close(void* ptr, int device);

}  // namespace gradsync
