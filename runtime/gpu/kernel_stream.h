// The GPU's StepStream (gpu/step_runner.h): a call's steps collected into step tables
// (kernels/cuda_step.cuh) and queued on the caller's stream as one kernel per table, so a
// call is one launch however many steps it has (up to a table's limits; more take several).
// It marks the steps that need every block of the kernel to have finished the steps before
// (the table's `barrier`): a step that touches the call's memory through another partition
// than an earlier step of the table did. (Before the tables every step was a kernel of its
// own: a ring call on one node was a chain of 2 (n-1) launches, 3-9x slower at 1x8.)
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu/gdr_link.h"
#include "gpu/step_runner.h"
#include "kernels/cuda_step.cuh"

namespace gradsync {

// What the stream's kernels read and report through, from the channels' set-up.
struct KernelStreamWords {
  const GdrLink* link = nullptr;
  // The link's words in mapped host memory: the host view [host, host + bytes) and its device view.
  const uint8_t* host = nullptr;
  uint8_t* device = nullptr;
  size_t bytes = 0;
  const uint32_t* abort = nullptr;          // device views
  kernels::NodeError* error = nullptr;
  uint32_t* counters = nullptr;             // device memory, kernels::kStepCounterWords
  // Device memory, kernels::kStepMaxBases words, zero at first: the bases of relative calls'
  // counts (step_base); null where no call is relative.
  uint64_t* bases = nullptr;
  uint64_t timeout_ns = 0;
  unsigned max_blocks = kernels::kStepMaxBlocks;
  uint32_t block_bytes = 0;  // kernels::StepTableHead::block_bytes
  std::string who;                          // "rank 3 (host a)", for errors
};

class KernelStream final : public StepStream {
 public:
  // Queues a table; kernels::launch_steps on the stream by default (tests pass their own).
  using Launch = std::function<cudaError_t(const kernels::StepTable&)>;
  KernelStream(const KernelStreamWords& w, cudaStream_t stream, DataType type, ReduceOp op, int divisor,
               Launch launch = nullptr);

  Status begin_call(bool relative) override;
  Status begin_step() override;
  void order_signals() override { step_.release = 1; }
  Status end_step() override;
  Status end_call() override;
  Status wait_arrived(int p, int64_t v) override;
  Status wait_send_free(int p, int64_t v) override;
  Status signal_ready(int p, uint64_t v) override;
  Status signal_consumed(int p, uint64_t v) override;
  Status copy(StepBuf dst, StepBuf src, size_t bytes) override;
  // A run of k - 1 operations (kernels::StepOp: the first reduces srcs[0] and srcs[1], each
  // following one is chained with the next source; the last holds dst, dst2 and the kind),
  // which the kernel folds in one pass.
  Status fold(StepBuf dst, StepBuf dst2, const StepBuf* srcs, int k, size_t count, bool final) override;

  // Launches so far (for tests of the batching).
  int launches() const { return launches_; }

 private:
  struct Range {
    const uint8_t* lo;
    const uint8_t* hi;
    bool write;
  };
  Status error(const std::string& why) const;
  Status flush(bool last);
  kernels::StepOp make_op(kernels::StepOpKind kind, StepBuf dst, StepBuf dst2, StepBuf a, StepBuf b) const;
  // Appends ops (of `count` elements each) to the step, all or none.
  Status add_ops(const kernels::StepOp* ops, int n, size_t count);
  bool needs_barrier(const std::vector<Range>& step) const;
  const uint64_t* dev(const uint64_t* w) const;
  Status signal(uint64_t* word, int base, uint64_t v);

  const KernelStreamWords& w_;
  cudaStream_t stream_;
  DataType type_;
  ReduceOp op_;
  int divisor_;
  Launch launch_;
  std::unique_ptr<kernels::StepTable> table_;
  // The step being collected; appended to the table at end_step.
  kernels::TableStep step_;
  std::vector<kernels::StepWait> waits_;
  std::vector<kernels::StepOp> ops_;
  std::vector<kernels::StepSignal> signals_;
  // The memory the table's steps touched since its last barrier.
  std::vector<Range> touched_;
  int launches_ = 0;
  // A relative call: per base, its last signal so far (what end_call moves the base on by).
  bool relative_ = false;
  uint64_t last_signal_[kernels::kStepMaxBases] = {};
  // A relative call: the link's slots and their strides (kernels::StepTableHead::slots); 0 otherwise.
  struct Slots {
    uint32_t slots = 0, stride = 0, ll_stride = 0;
  };
  Slots slots_;
};

}  // namespace gradsync
