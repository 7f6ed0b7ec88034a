// bench/gpu_timeline_text.h.
#include "bench/gpu_timeline_text.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace bench {

void print_text_timeline(const std::vector<gradsync::gpu::Timeline>& all) {
  if (all.empty() || all[0].block.empty()) return;
  struct Event {
    double start, end, wait;
    int rank;
    const char* what;
    uint32_t chunk;
  };
  std::vector<Event> rows;
  const uint64_t origin = all[0].block[0].start_ns;
  std::string offsets;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].block.empty()) continue;
    double shift = 0;  // ns, peer clock -> rank 0's clock
    if (r > 0) {
      const auto p = gradsync::gpu::overlap_with_peer(all[0], all[r]);
      if (!p.ok) continue;
      shift = (p.offset_lo_ns + p.offset_hi_ns) / 2;
      char b[96];
      std::snprintf(b, sizeof b, "; rank %zu shifted by %.2f us (+-%.2f)", r, shift / 1e3,
                    (p.offset_hi_ns - p.offset_lo_ns) / 2e3);
      offsets += b;
    }
    auto at = [&](uint64_t ns) { return (double(int64_t(ns - origin)) + shift) / 1e3; };
    const auto& b0 = all[r].block[0];
    for (uint32_t i = 0; i < b0.steps.size() && i < kTextChunks; ++i) {
      const auto& c = b0.steps[i];
      if (c.push_start != 0) {
        rows.push_back({at(c.push_start), at(c.push_end), double(c.push_start - c.credit_wait) / 1e3,
                        int(r), "push", i});
      }
      rows.push_back({at(c.fold_start), at(c.fold_end), double(c.fold_start - c.ready_wait) / 1e3,
                      int(r), "fold", i});
    }
  }
  std::sort(rows.begin(), rows.end(), [](const Event& a, const Event& b) { return a.start < b.start; });
  std::printf("#   block 0, first %u chunks of the last call, us from rank 0's block start%s:\n",
              kTextChunks, offsets.c_str());
  std::printf("#     %4s  %-4s %5s  %9s  %9s  %9s  %s\n", "rank", "step", "chunk", "start", "end",
              "length", "waited before (credit for a push, ready for a fold)");
  for (const Event& x : rows) {
    std::printf("#     %4d  %-4s %5u  %9.2f  %9.2f  %9.2f  %.2f\n", x.rank, x.what, x.chunk,
                x.start, x.end, x.end - x.start, x.wait);
  }
  const auto act = gradsync::gpu::activity(all[0], kBins);
  if (!act.pushing.empty()) {
    std::string p, f;
    for (int k = 0; k < kBins; ++k) {
      char b[16];
      std::snprintf(b, sizeof b, " %5.1f", act.pushing[size_t(k)]);
      p += b;
      std::snprintf(b, sizeof b, " %5.1f", act.folding[size_t(k)]);
      f += b;
    }
    std::printf("#   rank 0, blocks at work (mean) per 1/%d of the span, %.1f us each:\n", kBins,
                act.bin_us);
    std::printf("#     pushing%s\n#     folding%s\n", p.c_str(), f.c_str());
  }
}

}  // namespace bench
