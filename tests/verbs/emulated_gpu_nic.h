// The emulated NIC of the GPU tests whose ranks are threads of one process (verbs_gdr_gpu_test,
// verbs_gdr_gpu_bench), and the CUDA settings such a process needs (gpu_world.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gpu_world.h"
#include "kernels/cuda_reduce.cuh"

namespace gradsync::testing {

// Set before CUDA starts in this process (gpu_world.h says why).
inline const bool kEagerLoading = share_one_context();

// The emulated NIC's copy. Host to host (the daemons' channels): memmove. GPU memory: a copy
// kernel on a stream of its own that does not synchronize with other streams, and waited for:
// the NIC has written the bytes when the completion appears. Not cudaMemcpy: a legacy-stream
// copy waits for the ranks' streams, and a device-to-device copy may too (CUDA's implicit
// synchronization), while their wait kernels wait for this very copy.
inline void gpu_copier(void* dst, const void* src, size_t n) {
  static cudaStream_t stream = [] {
    cudaStream_t s = nullptr;
    (void)cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    return s;
  }();
  auto on_gpu = [](const void* p) {
    cudaPointerAttributes a{};
    const bool ok = cudaPointerGetAttributes(&a, p) == cudaSuccess;
    (void)cudaGetLastError();
    return ok && a.type == cudaMemoryTypeDevice;
  };
  const bool d = on_gpu(dst), s = on_gpu(src);
  if (!d && !s) {
    std::memmove(dst, src, n);
    return;
  }
  cudaError_t e = d && s ? kernels::launch_copy(dst, src, n, stream)
                         : cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    std::fprintf(stderr, "emulated NIC: copy of %zu bytes failed: %s\n", n, cudaGetErrorString(e));
    std::abort();
  }
}

}  // namespace gradsync::testing
