#include "gpu/ipc_memory.h"

#include <unistd.h>

#include <string>

namespace gradsync {
namespace {

Status cuda_error(cudaError_t e, const std::string& what) {
  (void)cudaGetLastError();
  return {Code::kInternal, what + ": " + cudaGetErrorString(e)};
}

}  // namespace

Result<IpcHandle> ipc_export(void* ptr, int device) {
  IpcHandle h{};
  h.pid = int32_t(::getpid());
  h.device = device;
  h.addr = reinterpret_cast<uint64_t>(ptr);
  if (cudaError_t e = cudaIpcGetMemHandle(&h.handle, ptr); e != cudaSuccess) return cuda_error(e, "cudaIpcGetMemHandle");
  return h;
}

Result<void*> ipc_open(const IpcHandle& h, int device, bool* opened) {
  *opened = false;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return cuda_error(e, "cudaSetDevice");
  if (h.pid == int32_t(::getpid())) {
    // A rank of this process: its pointer is valid here; another GPU needs peer access.
    if (h.device != device) {
      const cudaError_t e = cudaDeviceEnablePeerAccess(h.device, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
        return cuda_error(e, "peer access to GPU " + std::to_string(h.device));
      }
      (void)cudaGetLastError();
    }
    return reinterpret_cast<void*>(h.addr);
  }
  void* p = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&p, h.handle, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
    return cuda_error(e, "cudaIpcOpenMemHandle (GPU " + std::to_string(h.device) + " of pid " + std::to_string(h.pid) + ")");
  }
  *opened = true;
  return p;
}

void ipc_close(void* ptr, int device) {
  (void)cudaSetDevice(device);
  (void)cudaIpcCloseMemHandle(ptr);
}

}  // namespace gradsync
