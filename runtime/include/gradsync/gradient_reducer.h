// gradsync::GradientReducer: data-parallel gradient synchronization that overlaps the
// allreduce with the backward pass.
//
//   std::vector<gradsync::GradientSpec> specs = ...;      // one per parameter, same on every rank
//   auto reducer = gradsync::GradientReducer::create(comm, specs);
//   // backward: the framework's hook for parameter i, once its gradient is complete:
//   reducer->mark_ready(i);          // any thread; a bucket whose gradients are all ready starts
//   gradsync::Status s = reducer->finish();   // every gradient now holds the average over ranks
//
// Gradients are grouped into buckets (one contiguous buffer each, one type and one device per
// bucket; a 25 MiB cap, a smaller first bucket, reverse registration order) and each bucket
// is reduced by one asynchronous allreduce as soon as it and every bucket before it in the
// plan are ready. Buckets start in the plan's order on every rank, whatever order the hooks
// fire in, so the ranks' collectives always match. A gradient registered without a buffer
// lives in its bucket (view(i)): nothing is copied. One with a buffer is copied into the
// bucket when it is marked ready and back in finish().
//
// After the first step the buckets are planned again, once, from the order in which rank 0's
// gradients became ready (broadcast to every rank); views then move (on_view_moved).
//
// Threads: mark_ready may be called from any thread, concurrently. create, finish, view and
// the accessors are for the training loop's thread, between steps. The Communicator must
// outlive the reducer and must not run other collectives between the first mark_ready of a
// step and its finish().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/gradsync.h"

namespace gradsync {

// GradientSpec::device of a gradient in host memory.
constexpr int kHostDevice = -1;

struct GradientSpec {
  // The framework's gradient buffer, or nullptr: the gradient then lives in its bucket, at
  // GradientReducer::view(i), and nothing is copied.
  void* data = nullptr;
  size_t count = 0;  // elements
  DataType type = DataType::kFloat32;
  int device = kHostDevice;  // a CUDA ordinal (the communicator's device), or kHostDevice
  // May stay unmarked in a step (a branch of the model not taken): it is then reduced as
  // zeros. An unmarked gradient not declared so makes finish() fail on every rank.
  bool maybe_unused = false;
};

// Lossy compression of float32 buckets on the wire: each rank rounds its (pre-divided, for
// kAvg) values to 16 bits, the allreduce adds 16-bit values in float32 (rounding once per
// reduction step, the library's rule for 16-bit types), and the result is widened back to
// float32 in place. Host buckets only.
enum class Compression : uint8_t { kNone = 0, kFloat16 = 1, kBFloat16 = 2 };
const char* to_string(Compression c);

// One bucket as a hook sees it: its buffer (host memory, or device memory of `device`, where
// work goes on `stream`), always the full-precision float32/... values.
struct BucketView {
  int index = 0;
  void* data = nullptr;
  size_t count = 0;
  DataType type = DataType::kFloat32;
  int device = kHostDevice;
  CUstream_st* stream = nullptr;
};
using BucketHook = std::function<Status(const BucketView&)>;

struct ReducerOptions {
  size_t bucket_cap_bytes = size_t(25) << 20;   // PyTorch DDP's bucket_cap_mb default
  size_t first_bucket_bytes = size_t(1) << 20;  // the first bucket starts early: small
  ReduceOp op = ReduceOp::kAvg;                 // kAvg or kSum
  Compression compression = Compression::kNone;
  // Runs on a bucket's values before it is sent (e.g. scaling), on the thread whose
  // mark_ready starts it; and after its reduction, in finish(), before the copy back.
  BucketHook pre_hook;
  BucketHook post_hook;
  bool rebuild_after_first_step = true;
  // The stream of GPU buckets' allreduce, copies and fills (a cudaStream_t). The framework
  // must have finished writing a gradient, in this stream's order, when it marks it ready.
  CUstream_st* stream = nullptr;
  // Called in finish() for every gradient without a buffer of its own whose view moved (the
  // rebuild after the first step); the new view holds the reduced values already.
  std::function<void(int gradient, void* view)> on_view_moved;
};

// A bucket of the current plan.
struct BucketInfo {
  std::vector<int> gradients;  // in the order they sit in the bucket's buffer
  std::vector<size_t> offsets; // element offset of each of them
  size_t count = 0;            // elements in the buffer
  DataType type = DataType::kFloat32;
  int device = kHostDevice;
};

class GradientReducer {
 public:
  // Checks the registrations (counts, types, devices, options) against every other rank's,
  // collectively: a mismatch is a kMismatch error naming both ranks and the first gradient
  // that differs. Then plans the buckets and allocates them.
  static Result<std::unique_ptr<GradientReducer>> create(Communicator& comm,
                                                         std::vector<GradientSpec> gradients,
                                                         ReducerOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Where gradient i lives in its bucket (host or device memory); valid until the next
  // rebuild (on_view_moved).
  void* view(int i) const;

  // Gradient i of this step is complete. Starts every bucket that became startable, in plan
  // order. Errors (an index out of range, a gradient marked twice, a failed hook) are also
  // reported by finish(); the bucket still starts, so the other ranks are never left waiting.
  Status mark_ready(int i);

  // Starts what did not start yet (unmarked gradients as zeros), waits for every bucket
  // (host) or queues the rest on the stream (GPU), runs post hooks, copies back, and agrees
  // with every rank on the step's outcome: a rank that saw an error makes every rank fail
  // the step, naming it. The first call also rebuilds the buckets.
  Status finish();

  std::vector<BucketInfo> buckets() const;
  int buckets_started() const;  // in the current step
  int64_t steps() const;        // finish() calls that returned Ok
  bool rebuilt() const;

  class Impl;

 private:
  explicit GradientReducer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync
