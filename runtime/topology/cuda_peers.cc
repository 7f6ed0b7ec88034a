// The CUDA fallback of GPU topology discovery (gpu_topology.h): which devices can reach each
// other's memory, where NVML is not there to say how. Built only with CUDA.
#include <cuda_runtime_api.h>

#include "topology/gpu_topology.h"

namespace gradsync::topology {

CudaPeers probe_cuda_peers() {
  CudaPeers p;
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    p.reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    cudaGetLastError();  // clear it: the communicator asks again later
    return p;
  }
  for (int d = 0; d < count; ++d) {
    char bus[32] = {};
    if (cudaError_t e = cudaDeviceGetPCIBusId(bus, sizeof(bus), d); e != cudaSuccess) {
      p.reason = "cudaDeviceGetPCIBusId(" + std::to_string(d) + "): " + cudaGetErrorString(e);
      cudaGetLastError();
      return p;
    }
    p.pci_bus_ids.push_back(bus);
  }
  p.can_access.assign(size_t(count), std::vector<int>(size_t(count), 0));
  for (int a = 0; a < count; ++a) {
    for (int b = 0; b < count; ++b) {
      int yes = 0;
      if (a != b && cudaDeviceCanAccessPeer(&yes, a, b) == cudaSuccess) p.can_access[size_t(a)][size_t(b)] = yes;
    }
  }
  cudaGetLastError();
  p.available = true;
  return p;
}

}  // namespace gradsync::topology
