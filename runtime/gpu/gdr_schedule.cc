#include "gpu/gdr_schedule.h"

#include <algorithm>

namespace gradsync::gdr {
namespace {

// Segment i of a buffer cut into n: allreduce splits `count` (the first count % n segments one
// element longer); the strided collectives have n segments of `count`.
struct Segments {
  size_t count = 0;
  size_t n = 1;
  bool strided = false;
  size_t start(size_t i) const {
    if (strided) return i * count;
    return i * (count / n) + std::min(i, count % n);
  }
  size_t len(size_t i) const {
    if (strided) return count;
    return count / n + (i < count % n ? 1 : 0);
  }
};

}  // namespace

std::vector<Step> plan(CollectiveKind kind, size_t count, int n, int rank, int root, size_t per) {
  std::vector<Step> steps;
  if (count == 0 || n <= 1 || per == 0) return steps;
  auto mod = [n](int x) { return size_t(((x % n) + n) % n); };
  auto add = [&](bool recv, bool send, Body body, size_t in, size_t out, size_t len) {
    steps.push_back(Step{recv, send, body, in, out, len});
  };

  if (kind == CollectiveKind::kBroadcast) {
    // Position d along the ring from the root: 0 sends, the last only receives.
    const size_t d = mod(rank - root);
    for (size_t off = 0; off < count; off += per) {
      const size_t len = std::min(per, count - off);
      if (d == 0) add(false, true, Body::kCopyIn, off, off, len);
      else add(true, d + 1 < size_t(n), Body::kCopyOut, off, off, len);
    }
    return steps;
  }

  const bool reduce = kind != CollectiveKind::kAllGather;      // has the reduce-scatter half
  const bool gather = kind != CollectiveKind::kReduceScatter;  // has the all-gather half
  const Segments seg{count, size_t(n), kind != CollectiveKind::kAllreduce};
  size_t longest = 0;
  for (size_t i = 0; i < size_t(n); ++i) longest = std::max(longest, seg.len(i));
  // Piece p of segment i: its length (0 when the segment is shorter), input and output offsets.
  auto plen = [&](size_t i, size_t p) {
    return seg.len(i) > p * per ? std::min(per, seg.len(i) - p * per) : size_t(0);
  };
  auto in_at = [&](size_t i, size_t p) {
    // all_gather's input is this rank's segment alone.
    return kind == CollectiveKind::kAllGather ? p * per : seg.start(i) + p * per;
  };
  auto out_at = [&](size_t i, size_t p) {
    // reduce_scatter's output is this rank's segment alone.
    return kind == CollectiveKind::kReduceScatter ? p * per : seg.start(i) + p * per;
  };
  const size_t me = size_t(rank);
  for (size_t p = 0; p * per < longest; ++p) {
    if (reduce) {
      size_t sg = mod(rank - 1);
      if (size_t len = plen(sg, p)) add(false, true, Body::kCopyIn, in_at(sg, p), out_at(sg, p), len);
      for (int s = 1; s <= n - 2; ++s) {
        sg = mod(rank - s - 1);
        if (size_t len = plen(sg, p)) add(true, true, Body::kReduce, in_at(sg, p), out_at(sg, p), len);
      }
      if (size_t len = plen(me, p)) add(true, gather, Body::kReduceFinal, in_at(me, p), out_at(me, p), len);
    } else if (size_t len = plen(me, p)) {
      add(false, true, Body::kGatherFirst, in_at(me, p), out_at(me, p), len);
    }
    if (!gather) continue;
    for (int t = 1; t <= n - 1; ++t) {
      const size_t sg = mod(rank - t);
      if (size_t len = plen(sg, p)) add(true, t < n - 1, Body::kCopyOut, in_at(sg, p), out_at(sg, p), len);
    }
  }
  return steps;
}

}  // namespace gradsync::gdr
