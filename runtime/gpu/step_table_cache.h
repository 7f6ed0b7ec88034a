// The step tables (kernels/cuda_step.cuh) of a communicator's recent one-node calls, kept so
// that a call that repeats one of them relaunches its tables instead of planning it again.
//
// Why it is exact: on one node every hop is direct and every call's message counts are
// relative to bases in device memory (gpu/step_runner.h), so the tables a call builds depend
// only on the call (kind, algorithm, protocol, count, type, op, root, divisor, buffers) and on
// the channels, which do not change: the same call builds the same tables whichever call it
// is (the property that lets a CUDA graph replay them). The bases move on in device memory as
// each launch ends, not in the tables. A training loop's buckets repeat the same calls on the
// same buffers every step; planning one (the schedule, the runner's translation, the table)
// cost 18-27 us of host time per small call at 1x8, against the tables' launch.
//
// What a replay also does: the link's byte counters move on by the call's bytes per peer, as
// the planned call's messages move them (GdrLink::plan).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/plan/schedule.h"
#include "gradsync/gradsync.h"
#include "kernels/cuda_step.cuh"

namespace gradsync {

// Everything a one-node call's tables depend on besides the channels.
struct StepCallKey {
  CollectiveKind kind = CollectiveKind::kAllreduce;
  plan::Algo algo = plan::Algo::kRing;
  bool low_latency = false;
  size_t count = 0;
  DataType type = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  int divisor = 1;
  const void* input = nullptr;
  const void* output = nullptr;
  bool operator==(const StepCallKey&) const = default;
};

class StepTableCache {
 public:
  // At most this many calls are kept (the least recently used goes), and only calls of at
  // most kMaxTables tables (a table is about 15 KiB; larger calls plan in a small share of
  // their time).
  static constexpr size_t kEntries = 32;
  static constexpr size_t kMaxTables = 4;

  struct Entry {
    StepCallKey key;
    std::vector<std::unique_ptr<kernels::StepTable>> tables;  // in launch order
    std::vector<uint64_t> bytes_sent;                         // per link peer index
    uint64_t used = 0;
  };

  // The entry of `key`, marked used; null when there is none.
  const Entry* find(const StepCallKey& key);
  // Keeps a planned call's tables and bytes (over kMaxTables tables: not kept). Replaces an
  // entry of the same key.
  void put(const StepCallKey& key, std::vector<std::unique_ptr<kernels::StepTable>> tables,
           std::vector<uint64_t> bytes_sent);
  size_t size() const { return entries_.size(); }
  uint64_t hits() const { return hits_; }

 private:
  std::vector<Entry> entries_;
  uint64_t clock_ = 0, hits_ = 0;
};

}  // namespace gradsync
