// Memory of the GradientReducer's buckets (bucket_memory.h).
#include "client/bucket_memory.h"

#include <cstring>
#include <new>
#include <string>

#if GRADSYNC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace gradsync {
namespace {

// Host buckets are aligned to a cache line: every element type is aligned within them.
constexpr std::align_val_t kHostAlignment{64};

#if GRADSYNC_HAVE_CUDA
Status cuda_status(cudaError_t e, const char* what, int device) {
  if (e == cudaSuccess) return Status::Ok();
  return {Code::kInternal, std::string("gradient reducer: ") + what + " on GPU " + std::to_string(device) +
                               ": " + cudaGetErrorString(e)};
}
#endif

#if !GRADSYNC_HAVE_CUDA
Status no_cuda(int device) {
  return {Code::kUnimplemented, "gradient reducer: a gradient on GPU " + std::to_string(device) +
                                    ", but gradsync was built without CUDA"};
}
#endif

}  // namespace

void BucketFree::operator()(void* p) const {
  if (device == kHostDevice) {
    ::operator delete(p, kHostAlignment);
    return;
  }
#if GRADSYNC_HAVE_CUDA
  (void)cudaFree(p);
#endif
}

Result<BucketMemory> BucketMemory::allocate(size_t bytes, int device) {
  BucketMemory m;
  m.bytes_ = bytes;
  const size_t n = bytes == 0 ? 1 : bytes;
  if (device == kHostDevice) {
    void* p = ::operator new(n, kHostAlignment, std::nothrow);
    if (p == nullptr) {
      return Status(Code::kInternal, "gradient reducer: out of host memory for a bucket of " +
                                         std::to_string(bytes) + " bytes");
    }
    std::memset(p, 0, n);
    m.ptr_ = std::unique_ptr<void, BucketFree>(p, BucketFree{kHostDevice});
    return m;
  }
#if GRADSYNC_HAVE_CUDA
  int before = 0;
  GS_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&before), "cudaGetDevice", device));
  GS_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "cudaSetDevice", device));
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, n);
  if (e == cudaSuccess) e = cudaMemset(p, 0, n);
  (void)cudaSetDevice(before);
  if (e != cudaSuccess) {
    if (p != nullptr) (void)cudaFree(p);
    return cuda_status(e, ("cudaMalloc of a " + std::to_string(bytes) + "-byte bucket").c_str(), device);
  }
  m.ptr_ = std::unique_ptr<void, BucketFree>(p, BucketFree{device});
  return m;
#else
  return no_cuda(device);
#endif
}

Status copy_bytes(void* dst, const void* src, size_t bytes, int device, CUstream_st* stream) {
  if (bytes == 0 || dst == src) return Status::Ok();
  if (device == kHostDevice) {
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
#if GRADSYNC_HAVE_CUDA
  return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpyAsync", device);
#else
  return no_cuda(device);
#endif
}

Status zero_bytes(void* dst, size_t bytes, int device, CUstream_st* stream) {
  if (bytes == 0) return Status::Ok();
  if (device == kHostDevice) {
    std::memset(dst, 0, bytes);
    return Status::Ok();
  }
#if GRADSYNC_HAVE_CUDA
  return cuda_status(cudaMemsetAsync(dst, 0, bytes, stream), "cudaMemsetAsync", device);
#else
  return no_cuda(device);
#endif
}

}  // namespace gradsync
