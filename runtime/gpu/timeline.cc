// The GPU timeline's analysis (gpu/timeline.h): plain C++, no CUDA; the recording is in
// kernels/cuda_node.cu and gpu/device_comm.cc.
#include "gpu/timeline.h"

#include "gradsync/gradsync.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace gradsync::gpu {
namespace {

// Sorted, disjoint, non-empty intervals covering the same time as `v`.
std::vector<Interval> merged(std::vector<Interval> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](const Interval& x) { return x.end <= x.begin; }),
          v.end());
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<Interval> out;
  for (const Interval& x : v) {
    if (!out.empty() && x.begin <= out.back().end) {
      out.back().end = std::max(out.back().end, x.end);
    } else {
      out.push_back(x);
    }
  }
  return out;
}

uint64_t measure(const std::vector<Interval>& m) {
  uint64_t s = 0;
  for (const Interval& x : m) s += x.end - x.begin;
  return s;
}

// |a ∩ b| (ns) of two merged lists, b shifted by `shift` ns (a's clock = b's clock + shift).
// Integers throughout: a double holds a %globaltimer value (~1.7e18 ns) to 256 ns only.
double intersection(const std::vector<Interval>& a, const std::vector<Interval>& b,
                    int64_t shift = 0) {
  uint64_t s = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const uint64_t a0 = a[i].begin, a1 = a[i].end;
    const uint64_t b0 = b[j].begin + uint64_t(shift), b1 = b[j].end + uint64_t(shift);
    const uint64_t lo = std::max(a0, b0), hi = std::min(a1, b1);
    if (hi > lo) s += hi - lo;
    if (a1 < b1) ++i; else ++j;
  }
  return double(s);
}

// Intervals of one kind of every recorded chunk of the blocks.
enum class Kind { kPush, kFold };
std::vector<Interval> intervals(const std::vector<BlockTimeline>& blocks, Kind k) {
  std::vector<Interval> v;
  for (const BlockTimeline& b : blocks) {
    for (const ChunkSteps& c : b.steps) {
      if (k == Kind::kPush && c.push_start != 0 && c.push_end != 0) v.push_back({c.push_start, c.push_end});
      if (k == Kind::kFold && c.fold_start != 0 && c.fold_end != 0) v.push_back({c.fold_start, c.fold_end});
    }
  }
  return v;
}

std::vector<Interval> intervals_of(const BlockTimeline& b, Kind k) {
  std::vector<BlockTimeline> one;
  one.push_back(b);
  return intervals(one, k);
}

uint64_t span(uint64_t a, uint64_t b) { return a != 0 && b > a ? b - a : 0; }

const char* const kCollectives[] = {"allreduce", "reduce_scatter", "all_gather", "broadcast"};

}  // namespace

TimelineSummary summarize(const Timeline& t) {
  TimelineSummary s;
  if (t.block.empty()) return s;
  const auto up = merged(intervals(t.block, Kind::kPush));
  const auto uf = merged(intervals(t.block, Kind::kFold));
  s.push_us = double(measure(up)) / 1e3;
  s.fold_us = double(measure(uf)) / 1e3;
  s.overlap_us = intersection(up, uf) / 1e3;
  s.hidden = s.push_us > 0 ? s.overlap_us / s.push_us : 0;
  s.exposed_push_us = s.push_us - s.overlap_us;
  s.fold_hidden = s.fold_us > 0 ? s.overlap_us / s.fold_us : 0;
  uint64_t first = std::numeric_limits<uint64_t>::max(), last = 0;
  double push = 0, fold = 0, credit = 0, ready = 0, spans = 0, same = 0;
  uint64_t gran = 0;
  for (const BlockTimeline& b : t.block) {
    if (b.start_ns != 0) first = std::min(first, b.start_ns);
    last = std::max(last, b.end_ns);
    spans += double(span(b.start_ns, b.end_ns));
    s.max_chunks_per_block = std::max(s.max_chunks_per_block, b.chunks);
    s.recorded_chunks += b.steps.size();
    s.dropped_chunks += b.dropped();
    same += intersection(merged(intervals_of(b, Kind::kPush)), merged(intervals_of(b, Kind::kFold)));
    std::vector<uint64_t> all = {b.start_ns, b.end_ns};
    for (const ChunkSteps& c : b.steps) {
      push += double(span(c.push_start, c.push_end));
      fold += double(span(c.fold_start, c.fold_end));
      credit += double(span(c.credit_wait, c.push_start));
      ready += double(span(c.ready_wait, c.fold_start));
      all.insert(all.end(), {c.credit_wait, c.push_start, c.push_end, c.ready_wait, c.fold_start, c.fold_end});
    }
    all.erase(std::remove(all.begin(), all.end(), uint64_t(0)), all.end());
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    for (size_t i = 1; i < all.size(); ++i) {
      const uint64_t d = all[i] - all[i - 1];
      if (gran == 0 || d < gran) gran = d;
    }
  }
  const double nb = double(t.block.size());
  s.wall_us = last > first ? double(last - first) / 1e3 : 0;
  s.same_block_overlap_us = same / 1e3;
  s.block_push_us = push / nb / 1e3;
  s.block_fold_us = fold / nb / 1e3;
  s.block_credit_wait_us = credit / nb / 1e3;
  s.block_ready_wait_us = ready / nb / 1e3;
  s.block_span_us = spans / nb / 1e3;
  s.granularity_ns = gran;
  return s;
}

const char* step_name(Step::Kind k) {
  switch (k) {
    case Step::kBlockStart: return "block start";
    case Step::kCreditWait: return "credit wait";
    case Step::kPushStart: return "push start";
    case Step::kPushEnd: return "push end";
    case Step::kReadyWait: return "ready wait";
    case Step::kFoldStart: return "fold start";
    case Step::kFoldEnd: return "fold end";
    case Step::kBlockEnd: return "block end";
  }
  return "?";
}

std::vector<Step> program_order(const BlockTimeline& b) {
  std::vector<Step> out;
  out.push_back({Step::kBlockStart, 0, b.start_ns});
  const size_t m = b.chunks, r = b.steps.size();
  auto add = [&](Step::Kind k, size_t i, uint64_t ns) {
    if (ns != 0) out.push_back({k, uint32_t(i), ns});
  };
  auto push = [&](size_t i) {
    if (i >= r) return;
    add(Step::kCreditWait, i, b.steps[i].credit_wait);
    add(Step::kPushStart, i, b.steps[i].push_start);
    add(Step::kPushEnd, i, b.steps[i].push_end);
  };
  auto consume = [&](size_t i) {
    if (i >= r) return;
    add(Step::kReadyWait, i, b.steps[i].ready_wait);
    add(Step::kFoldStart, i, b.steps[i].fold_start);
    add(Step::kFoldEnd, i, b.steps[i].fold_end);
  };
  if (m > 0) push(0);
  for (size_t i = 0; i < m && i < r; ++i) {
    if (i + 1 < m) push(i + 1);
    consume(i);
  }
  out.push_back({Step::kBlockEnd, 0, b.end_ns});
  return out;
}

std::string check_well_formed(const Timeline& t) {
  auto bad = [](const std::string& s) { return s; };
  if (t.chunk_bytes == 0) return bad("chunk_bytes is 0");
  if (t.nchunks != (t.bytes + t.chunk_bytes - 1) / t.chunk_bytes) {
    return bad("nchunks " + std::to_string(t.nchunks) + " is not ceil(" + std::to_string(t.bytes) +
               " / " + std::to_string(t.chunk_bytes) + ")");
  }
  const uint64_t used = std::min<uint64_t>(t.blocks, t.nchunks);
  if (t.blocks_used != used || t.block.size() != used) {
    return bad("blocks_used " + std::to_string(t.blocks_used) + ", " +
               std::to_string(t.block.size()) + " records; expected " + std::to_string(used));
  }
  const bool must_push = t.collective != "broadcast";
  uint64_t total = 0;
  for (uint32_t bi = 0; bi < t.block.size(); ++bi) {
    const BlockTimeline& b = t.block[bi];
    const std::string at = "block " + std::to_string(bi) + ": ";
    if (b.block != bi) return bad(at + "record of block " + std::to_string(b.block));
    const uint32_t want = chunks_of_block(t.nchunks, t.blocks_used, bi);
    if (b.chunks != want) {
      return bad(at + std::to_string(b.chunks) + " chunks, expected " + std::to_string(want));
    }
    total += b.chunks;
    if (b.steps.size() != std::min(b.chunks, kMaxChunksPerBlock)) {
      return bad(at + std::to_string(b.steps.size()) + " chunks recorded of " +
                 std::to_string(b.chunks) + " (at most " + std::to_string(kMaxChunksPerBlock) + ")");
    }
    if (b.start_ns == 0 || b.end_ns == 0) return bad(at + "no start or end stamp");
    const bool pushed = !b.steps.empty() && b.steps[0].push_start != 0;
    for (size_t i = 0; i < b.steps.size(); ++i) {
      const ChunkSteps& c = b.steps[i];
      const std::string ci = at + "chunk " + std::to_string(i) + ": ";
      if (c.ready_wait == 0 || c.fold_start == 0 || c.fold_end == 0) return bad(ci + "a consume stamp is missing");
      const int pushes = (c.credit_wait != 0) + (c.push_start != 0) + (c.push_end != 0);
      if (pushes != 0 && pushes != 3) return bad(ci + "some push stamps are missing");
      if ((pushes == 3) != pushed) return bad(ci + "pushes where another chunk of the block does not");
      if (must_push && pushes == 0) return bad(ci + "no push stamps in a " + t.collective);
    }
    const std::vector<Step> order = program_order(b);
    for (size_t i = 1; i < order.size(); ++i) {
      if (order[i].ns < order[i - 1].ns) {
        return bad(at + step_name(order[i].kind) + " of chunk " + std::to_string(order[i].chunk) +
                   " (" + std::to_string(order[i].ns) + ") before " + step_name(order[i - 1].kind) +
                   " of chunk " + std::to_string(order[i - 1].chunk) + " (" +
                   std::to_string(order[i - 1].ns) + ") in program order");
      }
    }
  }
  if (total != t.nchunks) {
    return bad(std::to_string(total) + " chunks over the blocks, the call has " + std::to_string(t.nchunks));
  }
  return "";
}

Activity activity(const Timeline& t, int bins) {
  Activity a;
  if (bins <= 0 || t.block.empty()) return a;
  uint64_t first = std::numeric_limits<uint64_t>::max(), last = 0;
  for (const BlockTimeline& b : t.block) {
    if (b.start_ns != 0) first = std::min(first, b.start_ns);
    last = std::max(last, b.end_ns);
  }
  if (last <= first) return a;
  const double len = double(last - first) / bins;
  a.bin_us = len / 1e3;
  a.pushing.assign(size_t(bins), 0);
  a.folding.assign(size_t(bins), 0);
  auto spread = [&](const Interval& x, std::vector<double>& into) {
    const double x0 = double(x.begin - first), x1 = double(x.end - first);
    for (int k = std::max(0, int(x0 / len)); k < bins && k * len < x1; ++k) {
      const double lo = std::max(x0, k * len), hi = std::min(x1, (k + 1) * len);
      if (hi > lo) into[size_t(k)] += (hi - lo) / len;
    }
  };
  for (const Interval& x : intervals(t.block, Kind::kPush)) spread(x, a.pushing);
  for (const Interval& x : intervals(t.block, Kind::kFold)) spread(x, a.folding);
  return a;
}

PeerOverlap overlap_with_peer(const Timeline& mine, const Timeline& peer) {
  PeerOverlap o;
  if (mine.collective != peer.collective || mine.bytes != peer.bytes ||
      mine.nchunks != peer.nchunks || mine.blocks_used != peer.blocks_used ||
      mine.slots != peer.slots || mine.block.size() != peer.block.size()) {
    o.why = "the two timelines are not of the same call";
    return o;
  }
  // my clock = peer clock + d; every causal pair x -> y bounds d.
  double lo = -std::numeric_limits<double>::infinity(), hi = std::numeric_limits<double>::infinity();
  auto diff = [](uint64_t a, uint64_t b) { return double(int64_t(a - b)); };
  const size_t slots = mine.slots;
  for (size_t b = 0; b < mine.block.size(); ++b) {
    const auto& ms = mine.block[b].steps;
    const auto& ps = peer.block[b].steps;
    const size_t r = std::min(ms.size(), ps.size());
    for (size_t i = 0; i < r; ++i) {
      // The peer released ready after its push_end; I saw it before my fold_start.
      if (ps[i].push_end != 0 && ms[i].fold_start != 0) {
        hi = std::min(hi, diff(ms[i].fold_start, ps[i].push_end));
        ++o.constraints;
      }
      if (ms[i].push_end != 0 && ps[i].fold_start != 0) {
        lo = std::max(lo, diff(ms[i].push_end, ps[i].fold_start));
        ++o.constraints;
      }
      // Freed of chunk i - slots (released after fold_end) before the push of chunk i starts.
      if (i >= slots) {
        if (ms[i].push_start != 0 && ps[i - slots].fold_end != 0) {
          hi = std::min(hi, diff(ms[i].push_start, ps[i - slots].fold_end));
          ++o.constraints;
        }
        if (ps[i].push_start != 0 && ms[i - slots].fold_end != 0) {
          lo = std::max(lo, diff(ms[i - slots].fold_end, ps[i].push_start));
          ++o.constraints;
        }
      }
    }
  }
  const auto ppush = merged(intervals(peer.block, Kind::kPush));
  o.peer_push_us = double(measure(ppush)) / 1e3;
  if (!std::isfinite(lo) || !std::isfinite(hi)) {
    o.why = "no causal pair in both directions bounds the clock offset";
    return o;
  }
  // Stamps are quantised by the timer: a contradiction within two ticks is that, not a bug.
  const double tol =
      2.0 * double(std::max(summarize(mine).granularity_ns, summarize(peer).granularity_ns));
  if (lo > hi) {
    if (lo - hi > tol) {
      o.why = "the causal bounds on the clock offset contradict each other by " +
              std::to_string(int64_t(lo - hi)) + " ns (more than two timer ticks)";
      o.offset_lo_ns = lo;
      o.offset_hi_ns = hi;
      return o;
    }
    o.why = "the causal bounds cross by " + std::to_string(int64_t(lo - hi)) +
            " ns, within two timer ticks: the range between them is used";
    std::swap(lo, hi);
  }
  o.offset_lo_ns = lo;
  o.offset_hi_ns = hi;
  if (o.peer_push_us <= 0) {
    o.why = "the peer pushed nothing";
    return o;
  }
  const auto myfold = merged(intervals(mine.block, Kind::kFold));
  o.hidden_lo = 1;
  o.hidden_hi = 0;
  constexpr int kSteps = 32;
  for (int k = 0; k <= kSteps; ++k) {
    const auto d = int64_t(std::llround(lo + (hi - lo) * k / kSteps));
    const double h = intersection(myfold, ppush, d) / 1e3 / o.peer_push_us;
    o.hidden_lo = std::min(o.hidden_lo, h);
    o.hidden_hi = std::max(o.hidden_hi, h);
  }
  o.ok = true;
  return o;
}

namespace {
constexpr int64_t kMagic = 0x6753544c;  // "gSTL"
constexpr int64_t kHeaderWords = 11;
constexpr int64_t kBlockWords = 6;
}  // namespace

std::vector<int64_t> pack(const Timeline& t) {
  int64_t kind = -1;
  for (int k = 0; k < 4; ++k) {
    if (t.collective == kCollectives[k]) kind = k;
  }
  std::vector<int64_t> w = {kMagic,
                            t.rank,
                            t.world,
                            kind,
                            int64_t(t.bytes),
                            int64_t(t.chunk_bytes),
                            int64_t(t.slots),
                            int64_t(t.nchunks),
                            int64_t(t.blocks),
                            int64_t(t.blocks_used),
                            int64_t(t.block.size())};
  for (const BlockTimeline& b : t.block) {
    w.insert(w.end(), {int64_t(b.block), int64_t(b.start_ns), int64_t(b.end_ns),
                       int64_t(b.first_seq), int64_t(b.chunks), int64_t(b.steps.size())});
    for (const ChunkSteps& c : b.steps) {
      w.insert(w.end(), {int64_t(c.credit_wait), int64_t(c.push_start), int64_t(c.push_end),
                         int64_t(c.ready_wait), int64_t(c.fold_start), int64_t(c.fold_end)});
    }
  }
  return w;
}

Result<Timeline> unpack(const int64_t* w, size_t n) {
  auto bad = [] { return Status(Code::kInvalidArgument, "not a packed GPU timeline"); };
  if (n < size_t(kHeaderWords) || w[0] != kMagic) return bad();
  Timeline t;
  t.rank = int(w[1]);
  t.world = int(w[2]);
  t.collective = w[3] >= 0 && w[3] < 4 ? kCollectives[w[3]] : "?";
  t.bytes = uint64_t(w[4]);
  t.chunk_bytes = uint64_t(w[5]);
  t.slots = uint32_t(w[6]);
  t.nchunks = uint64_t(w[7]);
  t.blocks = uint32_t(w[8]);
  t.blocks_used = uint32_t(w[9]);
  const int64_t nb = w[10];
  size_t at = size_t(kHeaderWords);
  for (int64_t i = 0; i < nb; ++i) {
    if (at + size_t(kBlockWords) > n) return bad();
    BlockTimeline b;
    b.block = uint32_t(w[at]);
    b.start_ns = uint64_t(w[at + 1]);
    b.end_ns = uint64_t(w[at + 2]);
    b.first_seq = uint64_t(w[at + 3]);
    b.chunks = uint32_t(w[at + 4]);
    const int64_t ns = w[at + 5];
    at += size_t(kBlockWords);
    if (ns < 0 || at + size_t(ns) * 6 > n) return bad();
    for (int64_t j = 0; j < ns; ++j, at += 6) {
      b.steps.push_back({uint64_t(w[at]), uint64_t(w[at + 1]), uint64_t(w[at + 2]),
                         uint64_t(w[at + 3]), uint64_t(w[at + 4]), uint64_t(w[at + 5])});
    }
    t.block.push_back(std::move(b));
  }
  t.summary = summarize(t);
  return t;
}

Result<std::vector<Timeline>> all_timelines(Communicator& comm, const Timeline* mine) {
  const int n = comm.world_size(), me = comm.rank();
  const std::vector<int64_t> words = mine != nullptr ? pack(*mine) : std::vector<int64_t>{};
  std::vector<int64_t> sizes(size_t(n), 0);
  sizes[size_t(me)] = int64_t(words.size());
  GS_RETURN_IF_ERROR(comm.allreduce(sizes.data(), sizes.size(), DataType::kInt64, ReduceOp::kSum));
  std::vector<size_t> at(size_t(n) + 1, 0);
  for (int r = 0; r < n; ++r) at[size_t(r) + 1] = at[size_t(r)] + size_t(sizes[size_t(r)]);
  std::vector<int64_t> all(std::max<size_t>(at[size_t(n)], 1), 0);
  std::copy(words.begin(), words.end(), all.begin() + ptrdiff_t(at[size_t(me)]));
  GS_RETURN_IF_ERROR(comm.allreduce(all.data(), all.size(), DataType::kInt64, ReduceOp::kSum));
  std::vector<Timeline> out(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (sizes[size_t(r)] == 0) continue;
    auto t = unpack(all.data() + at[size_t(r)], size_t(sizes[size_t(r)]));
    if (t.ok()) out[size_t(r)] = std::move(t).value();
  }
  return out;
}

}  // namespace gradsync::gpu
