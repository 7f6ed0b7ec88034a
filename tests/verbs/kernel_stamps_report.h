// The launch stamps of kernels/kernel_stamps.cuh for a bench (node_gpu_test's OneNodeBench with
// NODE_BENCH_STAMPS=1): a log in device memory set while the bench's calls run, then one line
// per kernel kind of the mean time of each part of a launch, in microseconds.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/kernel_stamps.cuh"

namespace gradsync::testing {

class KernelStampRecorder {
 public:
  // Sets a log of `capacity` records for every later launch (nothing is queued then).
  explicit KernelStampRecorder(uint32_t capacity) {
    kernels::KernelStampLog log;
    log.capacity = capacity;
    if (cudaMalloc(reinterpret_cast<void**>(&log.records), sizeof(kernels::KernelStamp) * capacity) != cudaSuccess ||
        cudaMalloc(reinterpret_cast<void**>(&log.next), sizeof(uint32_t)) != cudaSuccess ||
        cudaMemset(log.records, 0, sizeof(kernels::KernelStamp) * capacity) != cudaSuccess ||
        cudaMemset(log.next, 0, sizeof(uint32_t)) != cudaSuccess || kernels::set_kernel_stamps(log) != cudaSuccess) {
      error_ = cudaGetErrorString(cudaGetLastError());
    }
    log_ = log;
  }
  ~KernelStampRecorder() {
    kernels::set_kernel_stamps(kernels::KernelStampLog{});
    cudaFree(log_.records);
    cudaFree(log_.next);
  }
  KernelStampRecorder(const KernelStampRecorder&) = delete;
  KernelStampRecorder& operator=(const KernelStampRecorder&) = delete;

  // Stops recording, and summarises the records after each stream's first `skip` (the
  // warm-up): per kind and step count (the most frequent of each kind), the mean duration
  // (entry to exit, %globaltimer), the gap from the same stream's previous exit, and the
  // parts between the marks (clock64, converted by the launches' mean ns per cycle).
  std::string summary(int skip) {
    if (!error_.empty()) return "stamps: " + error_;
    kernels::set_kernel_stamps(kernels::KernelStampLog{});
    cudaDeviceSynchronize();
    uint32_t n = 0;
    cudaMemcpy(&n, log_.next, sizeof(n), cudaMemcpyDeviceToHost);
    n = std::min(n, log_.capacity);
    std::vector<kernels::KernelStamp> rec(n);
    cudaMemcpy(rec.data(), log_.records, sizeof(kernels::KernelStamp) * n, cudaMemcpyDeviceToHost);
    std::map<uint64_t, std::vector<const kernels::KernelStamp*>> by_owner;
    for (const auto& r : rec)
      if (r.nmarks >= 2) by_owner[r.owner].push_back(&r);
    struct Sum {
      int launches = 0;
      double ns = 0, cycles = 0, gap_ns = 0;
      int gaps = 0;
      uint32_t blocks = 0;
      std::vector<double> parts;  // cycles per part
    };
    std::map<std::pair<uint32_t, uint32_t>, Sum> sums;  // (kind, nsteps)
    for (auto& [owner, v] : by_owner) {
      std::sort(v.begin(), v.end(), [](auto* a, auto* b) { return a->entry_ns < b->entry_ns; });
      for (size_t i = size_t(skip); i < v.size(); ++i) {
        const kernels::KernelStamp& r = *v[i];
        Sum& s = sums[{r.kind, r.nsteps}];
        if (s.parts.empty()) s.parts.assign(r.nmarks - 1, 0);
        if (s.parts.size() != r.nmarks - 1) continue;
        ++s.launches;
        s.blocks = std::max(s.blocks, r.blocks);
        s.ns += double(r.exit_ns - r.entry_ns);
        s.cycles += double(r.marks[r.nmarks - 1] - r.marks[0]);
        for (uint32_t m = 1; m < r.nmarks; ++m) s.parts[m - 1] += double(r.marks[m] - r.marks[m - 1]);
        if (i > 0) {
          s.gap_ns += double(r.entry_ns - v[i - 1]->exit_ns);
          ++s.gaps;
        }
      }
    }
    // The most frequent step count of each kind.
    std::map<uint32_t, std::pair<uint32_t, const Sum*>> best;
    for (const auto& [key, s] : sums) {
      auto& b = best[key.first];
      if (b.second == nullptr || s.launches > b.second->launches) b = {key.second, &s};
    }
    std::string out;
    char buf[160];
    for (const auto& [kind, b] : best) {
      const Sum& s = *b.second;
      if (s.launches == 0 || s.cycles <= 0) continue;
      const double us_per_cycle = s.ns / s.cycles / 1000.0, l = s.launches;
      std::snprintf(buf, sizeof buf, "%s %d launches, %u blocks, %u steps: duration %.2f gap %.2f |",
                    kind == kernels::kStampStepKernel ? "steps" : "node-ll", s.launches, s.blocks, b.first,
                    s.ns / l / 1000.0, s.gaps ? s.gap_ns / s.gaps / 1000.0 : 0.0);
      out += buf;
      auto part = [&](size_t m) { return s.parts[m] * us_per_cycle / l; };
      if (kind == kernels::kStampStepKernel) {
        std::snprintf(buf, sizeof buf, " prologue %.2f |", part(0));
        out += buf;
        const size_t marked = (s.parts.size() - 2) / 3;
        for (size_t k = 0; k < marked; ++k) {
          std::snprintf(buf, sizeof buf, " s%zu %.2f/%.2f/%.2f", k, part(1 + 3 * k), part(2 + 3 * k), part(3 + 3 * k));
          out += buf;
        }
        std::snprintf(buf, sizeof buf, " | end %.2f (us; per step: waits/ops/signals)", part(s.parts.size() - 1));
      } else {
        std::snprintf(buf, sizeof buf, " push %.2f consume %.2f end %.2f (us)", part(0), part(1), part(2));
      }
      out += buf;
      out += "; ";
    }
    return out.empty() ? "no launch recorded" : out;
  }

 private:
  kernels::KernelStampLog log_;
  std::string error_;
};

}  // namespace gradsync::testing
