#include "gpu/plan/schedule.h"

#include <algorithm>

namespace gradsync::plan {
namespace {

using Kind = CollectiveKind;

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

// An element range [lo, hi).
struct Range {
  size_t lo = 0, hi = 0;
  size_t size() const { return hi > lo ? hi - lo : 0; }
};

// Channel c's share of [0, len): contiguous, sizes differing by at most one chunk's rounding.
Range channel_share(size_t len, int c, int channels) {
  const size_t per = ceil_div(len, size_t(channels));
  return {std::min(len, size_t(c) * per), std::min(len, size_t(c + 1) * per)};
}

// Builds one rank's steps.
class Builder {
 public:
  Builder(const JobShape& shape, const ChannelSet& channels, const PlanRequest& req, int rank)
      : shape_(shape), channels_(channels), req_(req), me_(rank), n_(shape.world_size()),
        chunk_(std::max<size_t>(1, req.chunk_bytes / std::max<size_t>(1, req.esize))) {}

  std::vector<Step> build() {
    if (req_.count == 0) return {};
    if (n_ == 1) {
      const size_t len = req_.count;
      Step s;
      s.prim = Prim::kCopy;
      s.count = len;
      steps_.push_back(s);
      return std::move(steps_);
    }
    for (int c = 0; c < channels_.size(); ++c) {
      switch (effective_algo(req_.kind, req_.algo)) {
        case Algo::kRing: ring(c); break;
        case Algo::kTree: tree(c); break;
        case Algo::kOneShot: one_shot(c); break;
        case Algo::kTwoShot: two_shot(c); break;
        case Algo::kHierarchical: hierarchical(c); break;
      }
    }
    return std::move(steps_);
  }

 private:
  void add(Prim prim, int c, std::initializer_list<int> recv, std::initializer_list<int> send,
           size_t in, size_t out, size_t count, int self_pos = 0) {
    add_v(prim, c, std::vector<int>(recv), std::vector<int>(send), in, out, count, self_pos);
  }
  void add_v(Prim prim, int c, const std::vector<int>& recv, const std::vector<int>& send,
             size_t in, size_t out, size_t count, int self_pos = 0) {
    if (count == 0) return;  // both ends compute the same empty piece and skip it
    if (recv.size() > size_t(kMaxPeers) || send.size() > size_t(kMaxPeers)) return;  // check_request refuses these
    added_ = true;
    Step s;
    s.prim = prim;
    s.channel = c;
    s.nrecv = uint8_t(recv.size());
    s.nsend = uint8_t(send.size());
    std::copy(recv.begin(), recv.end(), s.recv);
    std::copy(send.begin(), send.end(), s.send);
    s.self_pos = uint8_t(self_pos);
    s.in = in;
    s.out = out;
    s.count = count;
    s.from_output = from_output_;
    steps_.push_back(s);
  }

  // --- ring -------------------------------------------------------------------------------
  void ring(int c) {
    const auto& order = channels_[c].order;
    const int p = int(std::find(order.begin(), order.end(), me_) - order.begin());
    const int prev = order[size_t((p + n_ - 1) % n_)], next = order[size_t((p + 1) % n_)];
    auto at = [&](int pos) { return order[size_t(((pos % n_) + n_) % n_)]; };
    if (req_.kind == Kind::kAllreduce) {
      const Range share = channel_share(req_.count, c, channels_.size());
      for (size_t base = share.lo; base < share.hi;) {
        const size_t round = std::min(size_t(n_) * chunk_, share.hi - base);
        ring_allreduce(c, prev, next, p, n_, {base, base + round});
        base += round;
      }
    } else if (req_.kind == Kind::kReduceScatter || req_.kind == Kind::kAllGather) {
      // Blocks of `count` elements, block b owned by rank b; the channel moves its share of
      // every block, chunk by chunk.
      const Range share = channel_share(req_.count, c, channels_.size());
      const size_t cnt = req_.count;
      for (size_t lo = share.lo; lo < share.hi; lo += chunk_) {
        const size_t len = std::min(chunk_, share.hi - lo);
        if (req_.kind == Kind::kReduceScatter) {
          // Block of the rank at position p-s-1 at step s: its chain starts right after its
          // owner and ends there.
          add(Prim::kSend, c, {}, {next}, size_t(at(p - 1)) * cnt + lo, 0, len);
          for (int s = 1; s <= n_ - 2; ++s)
            add(Prim::kRecvReduceSend, c, {prev}, {next}, size_t(at(p - s - 1)) * cnt + lo, 0, len);
          add(Prim::kRecvReduceCopy, c, {prev}, {}, size_t(me_) * cnt + lo, lo, len);
        } else {
          add(Prim::kCopySend, c, {}, {next}, lo, size_t(me_) * cnt + lo, len);
          for (int t = 1; t <= n_ - 2; ++t)
            add(Prim::kRecvCopySend, c, {prev}, {next}, 0, size_t(at(p - t)) * cnt + lo, len);
          add(Prim::kRecv, c, {prev}, {}, 0, size_t(at(p + 1)) * cnt + lo, len);
        }
      }
    } else {  // broadcast: a pipeline from the root around the ring
      const int pr = int(std::find(order.begin(), order.end(), req_.root) - order.begin());
      const int d = (p - pr + n_) % n_;
      const Range share = channel_share(req_.count, c, channels_.size());
      for (size_t lo = share.lo; lo < share.hi; lo += chunk_) {
        const size_t len = std::min(chunk_, share.hi - lo);
        if (d == 0) add(Prim::kCopySend, c, {}, {next}, lo, lo, len);
        else if (d < n_ - 1) add(Prim::kRecvCopySend, c, {prev}, {next}, 0, lo, len);
        else add(Prim::kRecv, c, {prev}, {}, 0, lo, len);
      }
    }
  }

  // One round of ring allreduce over `r` for the rank at position p of an n-rank ring: the
  // range cut into n segments, reduce-scatter then all-gather, 2(n-1) transfers.
  void ring_allreduce(int c, int prev, int next, int p, int n, Range r) {
    const size_t seg = ceil_div(r.size(), size_t(n));
    auto emit = [&](Prim prim, std::initializer_list<int> rv, std::initializer_list<int> sd, int i) {
      const size_t k = size_t(((i % n) + n) % n);
      const size_t lo = std::min(r.lo + k * seg, r.hi), hi = std::min(r.lo + (k + 1) * seg, r.hi);
      add(prim, c, rv, sd, lo, lo, hi > lo ? hi - lo : 0);
    };
    emit(Prim::kSend, {}, {next}, p);
    for (int s = 1; s <= n - 2; ++s) emit(Prim::kRecvReduceSend, {prev}, {next}, p - s);
    emit(Prim::kRecvReduceCopySend, {prev}, {next}, p + 1);
    const bool own_from_output = from_output_;
    from_output_ = false;  // the all-gather half only copies what it receives
    for (int t = 1; t <= n - 2; ++t) emit(Prim::kRecvCopySend, {prev}, {next}, p + 1 - t);
    emit(Prim::kRecv, {prev}, {}, p + 2);
    from_output_ = own_from_output;
  }

  // --- tree -------------------------------------------------------------------------------
  void tree(int c) {
    const TreeLinks& l = channels_[c].links[size_t(me_)];
    const std::vector<int> kids(l.children, l.children + l.nchildren);
    const Range share = channel_share(req_.count, c, channels_.size());
    std::vector<Range> chunks;
    for (size_t lo = share.lo; lo < share.hi; lo += chunk_) chunks.push_back({lo, std::min(share.hi, lo + chunk_)});
    auto down = [&](const Range& r) {
      if (l.parent < 0) return;  // the root sent it down on its way up (allreduce)
      if (kids.empty()) add_v(Prim::kRecv, c, {l.parent}, {}, 0, r.lo, r.size());
      else add_v(Prim::kRecvCopySend, c, {l.parent}, kids, 0, r.lo, r.size());
    };
    if (req_.kind == Kind::kBroadcast) {
      for (const Range& r : chunks) {
        if (l.parent < 0) add_v(Prim::kCopySend, c, {}, kids, r.lo, r.lo, r.size());
        else down(r);
      }
      return;
    }
    // Allreduce: chunk k up, then chunk k-1 down, so that the way up of the next chunk
    // overlaps the way down of the last.
    for (size_t k = 0; k <= chunks.size(); ++k) {
      if (k < chunks.size()) {
        const Range& r = chunks[k];
        if (kids.empty()) add_v(Prim::kSend, c, {}, {l.parent}, r.lo, 0, r.size());
        else if (l.parent >= 0) add_v(Prim::kRecvReduceSend, c, kids, {l.parent}, r.lo, 0, r.size());
        else add_v(Prim::kRecvReduceCopySend, c, kids, kids, r.lo, r.lo, r.size());
      }
      if (k > 0) down(chunks[k - 1]);
    }
  }

  // --- one node, direct pushes ------------------------------------------------------------
  // The node's other ranks in rank order, and where this rank falls among them.
  void peers(std::vector<int>* others, int* self_pos) const {
    std::vector<int> all = shape_.nodes[0].ranks;
    std::sort(all.begin(), all.end());
    others->clear();
    *self_pos = 0;
    for (int r : all) {
      if (r == me_) continue;
      if (r < me_) ++*self_pos;
      others->push_back(r);
    }
  }

  // `share` chunk by chunk in groups, calling f(phase, lo, len) for every chunk of a group in
  // phase 0, then every chunk in phase 1, and so on (a chunk's sends come in the earlier
  // phases, its receives in the later ones). A group is as many chunks as the messages a peer's
  // slots hold (PlanRequest::window) over the messages each chunk sends to one peer: a rank
  // then runs a window ahead of a peer that is not running (processes time-sliced on one GPU:
  // a message per slice, chunk by chunk), and never more (its sends would wait for slots the
  // peer frees only in the receives that come after them).
  template <class F>
  void by_groups(Range share, size_t msgs_per_chunk, int phases, F f) const {
    const size_t span = std::max<size_t>(1, std::max<size_t>(req_.window, 1) / msgs_per_chunk) * chunk_;
    for (size_t g = share.lo; g < share.hi; g += span) {
      const size_t end = std::min(share.hi, g + span);
      for (int phase = 0; phase < phases; ++phase)
        for (size_t lo = g; lo < end; lo += chunk_) f(phase, lo, std::min(chunk_, end - lo));
    }
  }

  void one_shot(int c) {
    std::vector<int> others;
    int self = 0;
    peers(&others, &self);
    const size_t cnt = req_.count;
    const Range share = channel_share(cnt, c, channels_.size());
    by_groups(share, 1, 2, [&](int phase, size_t lo, size_t len) {  // the sends, then the receives
      switch (req_.kind) {
        case Kind::kAllreduce:
          if (phase == 0) add_v(Prim::kSend, c, {}, others, lo, 0, len);
          else add_v(Prim::kRecvReduceCopy, c, others, {}, lo, lo, len, self);
          break;
        case Kind::kReduceScatter:  // block s of every input to rank s, folded in rank order
          if (phase == 0) {
            for (int s : others) add(Prim::kSend, c, {}, {s}, size_t(s) * cnt + lo, 0, len);
          } else {
            add_v(Prim::kRecvReduceCopy, c, others, {}, size_t(me_) * cnt + lo, lo, len, self);
          }
          break;
        case Kind::kAllGather:  // the own block to every peer, every peer's into place
          if (phase == 0) {
            add_v(Prim::kCopySend, c, {}, others, lo, size_t(me_) * cnt + lo, len);
          } else {
            for (int s : others) add(Prim::kRecv, c, {s}, {}, 0, size_t(s) * cnt + lo, len);
          }
          break;
        default:  // broadcast
          if (phase == 0 && me_ == req_.root) add_v(Prim::kCopySend, c, {}, others, lo, lo, len);
          else if (phase == 1 && me_ != req_.root) add(Prim::kRecv, c, {req_.root}, {}, 0, lo, len);
          break;
      }
    });
  }

  void two_shot(int c) {
    std::vector<int> others;
    int self = 0;
    peers(&others, &self);
    if (req_.kind == Kind::kReduceScatter || req_.kind == Kind::kAllGather) {
      one_shot(c);
      return;
    }
    const size_t cnt = req_.count;
    const size_t seg = two_shot_segment(cnt, req_.esize, n_, req_.segment_align_bytes);
    // Segment s: [s*seg, min((s+1)*seg, count)); the channel's share of it, chunk by chunk.
    auto seg_range = [&](int s) { return Range{std::min(cnt, size_t(s) * seg), std::min(cnt, size_t(s + 1) * seg)}; };
    const Range share = channel_share(seg, c, channels_.size());
    const int root = req_.root;
    // A chunk sends two messages to a peer: its piece (the root's piece and own segment in
    // broadcast), then the folded (or copied) segment.
    // the pieces, the own segments, the results
    by_groups(share, 2, 3, [&](int phase, size_t lo, size_t len) {
      auto piece = [&](int s) {  // this chunk in segment s (empty past the end of the buffer)
        const Range r = seg_range(s);
        return Range{std::min(r.hi, r.lo + lo), std::min(r.hi, r.lo + lo + len)};
      };
      const Range own = piece(me_);
      if (phase == 0) {
        if (req_.kind == Kind::kAllreduce || me_ == root)
          for (int s : others) add(Prim::kSend, c, {}, {s}, piece(s).lo, 0, piece(s).size());
      } else if (phase == 1) {
        if (req_.kind == Kind::kAllreduce)
          add_v(Prim::kRecvReduceCopySend, c, others, others, own.lo, own.lo, own.size(), self);
        else if (me_ == root)
          add_v(Prim::kCopySend, c, {}, others, own.lo, own.lo, own.size());
        else
          add_v(Prim::kRecvCopySend, c, {root}, others, 0, own.lo, own.size());
      } else {
        for (int s : others) add(Prim::kRecv, c, {s}, {}, 0, piece(s).lo, piece(s).size());
      }
    });
  }

  // --- hierarchical: direct pushes inside the node, a ring per local index across nodes ---
  void hierarchical(int c) {
    int node = 0, local = 0;
    for (size_t x = 0; x < shape_.nodes.size(); ++x)
      for (size_t l = 0; l < shape_.nodes[x].ranks.size(); ++l)
        if (shape_.nodes[x].ranks[l] == me_) node = int(x), local = int(l);
    const std::vector<int>& mine = shape_.nodes[size_t(node)].ranks;
    const int g = int(mine.size()), k = shape_.node_count();
    std::vector<int> locals;  // the node's other ranks, in local order
    for (int r : mine)
      if (r != me_) locals.push_back(r);
    const int prev = shape_.nodes[size_t((node + k - 1) % k)].ranks[size_t(local)];
    const int next = shape_.nodes[size_t((node + 1) % k)].ranks[size_t(local)];
    const Range share = channel_share(req_.count, c, channels_.size());
    for (size_t lo = share.lo; lo < share.hi; lo += chunk_) {
      const size_t len = std::min(chunk_, share.hi - lo), seg = ceil_div(len, size_t(g));
      auto piece = [&](int l) {  // node segment l of this chunk
        return Range{std::min(lo + size_t(l) * seg, lo + len), std::min(lo + size_t(l + 1) * seg, lo + len)};
      };
      const Range own = piece(local);
      if (g > 1) {  // reduce-scatter inside the node: segment l to local rank l, folded in local order
        for (int l = 0; l < g; ++l)
          if (l != local) add(Prim::kSend, c, {}, {mine[size_t(l)]}, piece(l).lo, 0, piece(l).size());
        added_ = false;
        add_v(Prim::kRecvReduceCopy, c, locals, {}, own.lo, own.lo, own.size(), local);
        if (added_) steps_.back().partial = 1;
        from_output_ = true;  // the ring works on the node's partial sum, now in the output
      }
      if (own.size() > 0) ring_allreduce(c, prev, next, node, k, own);
      if (g > 1) {  // all-gather inside the node
        add_v(Prim::kSend, c, {}, locals, own.lo, 0, own.size());
        from_output_ = false;
        for (int l = 0; l < g; ++l)
          if (l != local) add(Prim::kRecv, c, {mine[size_t(l)]}, {}, 0, piece(l).lo, piece(l).size());
      }
    }
  }

  const JobShape& shape_;
  const ChannelSet& channels_;
  const PlanRequest& req_;
  const int me_;
  const int n_;
  const size_t chunk_;
  std::vector<Step> steps_;
  bool from_output_ = false;  // steps added now read their own operand from the output
  bool added_ = false;        // the last add() produced a step
};

}  // namespace

const char* to_string(Algo a) {
  switch (a) {
    case Algo::kRing: return "ring";
    case Algo::kTree: return "tree";
    case Algo::kOneShot: return "one-shot";
    case Algo::kTwoShot: return "two-shot";
    case Algo::kHierarchical: return "hierarchical";
  }
  return "?";
}

const char* to_string(Prim p) {
  switch (p) {
    case Prim::kSend: return "send";
    case Prim::kCopySend: return "copy-send";
    case Prim::kRecv: return "recv";
    case Prim::kRecvCopySend: return "recv-copy-send";
    case Prim::kRecvReduceSend: return "recv-reduce-send";
    case Prim::kRecvReduceCopySend: return "recv-reduce-copy-send";
    case Prim::kRecvReduceCopy: return "recv-reduce-copy";
    case Prim::kCopy: return "copy";
  }
  return "?";
}

Algo effective_algo(CollectiveKind kind, Algo algo) {
  if (algo == Algo::kTree && (kind == Kind::kReduceScatter || kind == Kind::kAllGather)) return Algo::kRing;
  if (algo == Algo::kHierarchical && kind != Kind::kAllreduce) return Algo::kRing;
  return algo;
}

std::string check_request(const JobShape& shape, const PlanRequest& req) {
  if (std::string why = shape.validate(); !why.empty()) return "bad shape: " + why;
  const int n = shape.world_size();
  if (req.kind == Kind::kBarrier) return "a barrier moves no data: nothing to plan";
  if (req.esize == 0) return "element size 0";
  if (req.kind == Kind::kBroadcast && (req.root < 0 || req.root >= n))
    return "root " + std::to_string(req.root) + " is not a rank of " + std::to_string(n);
  if ((req.algo == Algo::kOneShot || req.algo == Algo::kTwoShot) && shape.node_count() != 1)
    return std::string(to_string(req.algo)) + " pushes directly to every peer: one node only, the shape has " +
           std::to_string(shape.node_count());
  if ((req.algo == Algo::kOneShot || req.algo == Algo::kTwoShot) && n - 1 > kMaxPeers)
    return std::string(to_string(req.algo)) + " needs at most " + std::to_string(kMaxPeers + 1) +
           " ranks on the node, the shape has " + std::to_string(n);
  if (effective_algo(req.kind, req.algo) == Algo::kHierarchical) {
    const size_t g = shape.nodes[0].ranks.size();
    for (const auto& node : shape.nodes)
      if (node.ranks.size() != g)
        return "hierarchical needs the same number of ranks on every node (" + node.name + " has " +
               std::to_string(node.ranks.size()) + ", " + shape.nodes[0].name + " " + std::to_string(g) + ")";
    if (shape.node_count() < 2) return "hierarchical runs across nodes: the shape has one (two-shot is its one-node form)";
    if (g - 1 > size_t(kMaxPeers))
      return "hierarchical needs at most " + std::to_string(kMaxPeers + 1) + " ranks per node, the shape has " + std::to_string(g);
  }
  return {};
}

size_t two_shot_segment(size_t count, size_t esize, int n, size_t align_bytes) {
  const size_t bytes = ceil_div(count * esize, size_t(std::max(n, 1)));
  const size_t align = std::max<size_t>(align_bytes, esize);
  return ceil_div(bytes, align) * align / esize;
}

ChannelSet plan_channels(const JobShape& shape, const PlanRequest& req) {
  switch (effective_algo(req.kind, req.algo)) {
    case Algo::kRing:
      return ring_channels(shape, req.channels > 0 ? req.channels : default_ring_channels(shape));
    case Algo::kTree:
      return tree_channels(shape, req.channels > 0 ? req.channels : default_tree_channels(shape),
                           req.kind == Kind::kBroadcast ? req.root : -1);
    case Algo::kHierarchical:
      return hierarchical_channels(shape, req.channels > 0 ? req.channels : default_ring_channels(shape));
    default:
      return direct_channels(shape, req.channels > 0 ? req.channels : default_ring_channels(shape));
  }
}

std::vector<Step> rank_steps(const JobShape& shape, const ChannelSet& channels,
                             const PlanRequest& req, int rank) {
  return Builder(shape, channels, req, rank).build();
}

}  // namespace gradsync::plan
