// CUDA reduction and copy kernels: the GPU side of kernels/host_reduce.h.
//
// Host-callable launchers; each queues one kernel on `stream` (none when there is nothing to
// do) and returns the launch's error, never blocking. Plain C++ may include this header: the
// only CUDA types in it are cudaError_t and cudaStream_t (cuda_runtime_api.h).
//
// Numeric rules: the same as the host loops (host_reduce.h, and the contract above DataType
// in gradsync/gradsync.h), and for the same inputs and the same operation order the results
// are the same bytes:
// - float32/float64 native; float16/bfloat16 converted to float32, combined in float32,
//   rounded to nearest even when stored (__float2half_rn / __float2bfloat16_rn);
// - integers: sum/prod wrap (unsigned arithmetic), min/max compare as the type, avg divides
//   the wrapped sum by world truncating toward zero;
// - min/max: (a < b || a != a) ? a : b (max with >), like the host: a NaN on either side
//   wins (the first one if both), float32/float64 NaNs keep their bits, float16/bfloat16
//   NaNs come out with the quiet bit set and their payload kept, as the host's conversions do;
// - kAvg sums in launch_reduce; launch_reduce_final and launch_finish_avg divide once, in
//   float32 (float32, float16, bfloat16) or float64.
// One documented difference: a NaN *produced or propagated by arithmetic* (sum, prod, avg:
// inf - inf, 0 * inf, NaN + x) is a NaN on both paths but not the same NaN bits: x86 gives
// its default NaN or the first operand's payload, CUDA its canonical NaN (0x7fffffff, 0x7fff).
// Finite inputs never produce one, so gradients that are finite match bit for bit.
//
// Buffers: device memory, or memory the device can address (mapped pinned host memory,
// peer memory through CUDA IPC or peer access). Pointers must be aligned to the element
// size (cudaErrorInvalidValue otherwise, nothing launched). Kernels use 16-byte accesses for
// the bulk when all pointers of a call share the same offset modulo 16, with scalar head and
// tail; otherwise they run the scalar loop throughout. n == 0 launches nothing.
//
// Preconditions as on the host: valid type and op (cudaErrorInvalidValue otherwise), world >= 1
// (cudaErrorInvalidValue otherwise).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "gradsync/gradsync.h"

namespace gradsync::kernels {

// out[i] = op(a[i], b[i]) for i < n; kAvg sums. out may be a or b exactly (not a partial
// overlap).
cudaError_t launch_reduce(DataType type, ReduceOp op, void* out, const void* a, const void* b,
                          size_t n, cudaStream_t stream);

// The last reduction step: v = op(a[i], b[i]), for kAvg (a[i] + b[i]) / world; v goes to
// out1[i] and, when out2 is not null, to out2[i]. out1 may alias a or b exactly; out2 must not
// alias anything.
cudaError_t launch_reduce_final(DataType type, ReduceOp op, void* out1, void* out2,
                                const void* a, const void* b, size_t n, int world,
                                cudaStream_t stream);

// buf[i] /= world (kAvg results with no final reduction step). world == 1 launches nothing.
cudaError_t launch_finish_avg(DataType type, void* buf, size_t n, int world,
                              cudaStream_t stream);

// dst[0, bytes) = src[0, bytes) by a kernel (for peer or mapped memory, where a copy engine
// transfer is not wanted). 16-byte accesses when dst and src share their offset modulo 16,
// else the widest width both allow. dst and src must not overlap.
cudaError_t launch_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream);

// Loads every kernel above into the current device's context now (cudaFuncGetAttributes on
// each). With CUDA's lazy loading (the default since 12.2) a kernel is loaded at its first
// launch, and loading may wait for the kernels already running in the context: if one of
// those waits for work this thread has yet to queue (a wait kernel of a GPUDirect or
// host-staged call; another rank of this process sharing the GPU), that first launch hangs
// until the wait times out. Paths that queue wait kernels call this at set-up.
cudaError_t load_reduce_kernels();

}  // namespace gradsync::kernels
