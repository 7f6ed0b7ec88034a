// The emulated NIC of the GPU tests whose ranks are threads of one process (verbs_gdr_gpu_test,
// verbs_gdr_gpu_bench), and the CUDA settings such a process needs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda_reduce.cuh"

namespace gradsync::testing {

// Every rank of these tests is a thread of this process: they share one CUDA context. With
// CUDA's lazy loading, a kernel's first launch may wait for the kernels already running in
// the context, and here those wait for ranks of this very process (a node kernel waiting for
// its peer, a GPUDirect step waiting for a message): the first hierarchical allreduce hung
// that way on the H200. Separate processes (one per GPU) do not share a context; the tests
// load every kernel at start instead, before CUDA starts.
// For the same reason the context gets CUDA's largest number of hardware queues: with the
// default 8, the streams of 6 or 8 ranks share queues, and a kernel of one rank waits behind
// another rank's kernel that is waiting for it (2x4 and 3x2 hung in their first call that way
// on the H200 while 2x2 passed). One process per GPU has a context of its own.
inline const bool kEagerLoading = [] {
  return ::setenv("CUDA_MODULE_LOADING", "EAGER", 0) == 0 && ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0;
}();

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
