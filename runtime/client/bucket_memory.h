// Memory of the GradientReducer's buckets: one contiguous buffer per bucket, in host memory or
// on a CUDA device, and the copies and fills the reducer does on it. The only place where the
// reducer touches CUDA.
#pragma once

#include <cstddef>
#include <memory>

#include "gradsync/gradient_reducer.h"

namespace gradsync {

// Frees host (aligned) or device memory of a bucket.
struct BucketFree {
  int device = kHostDevice;
  void operator()(void* p) const;
};

class BucketMemory {
 public:
  BucketMemory() = default;
  // `bytes` of zeroed memory on `device` (kHostDevice: host memory aligned to 64 bytes).
  static Result<BucketMemory> allocate(size_t bytes, int device);

  void* data() const { return ptr_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  std::unique_ptr<void, BucketFree> ptr_;
  size_t bytes_ = 0;
};

// dst <- src (`bytes`); on a device: queued on `stream`, host memory: at once.
Status copy_bytes(void* dst, const void* src, size_t bytes, int device, CUstream_st* stream);
// dst <- zeros.
Status zero_bytes(void* dst, size_t bytes, int device, CUstream_st* stream);

}  // namespace gradsync
