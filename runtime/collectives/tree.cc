// Double binary tree allreduce: tree t reduces half t of the data up to its root and
// broadcasts the result back down, pipelined in slot-sized pieces; both trees run
// interleaved in one thread (piece k of tree 0, piece k of tree 1, ...), and each piece goes
// up then down before the next, so up and down traffic overlap across the tree.
//
// Deadlock freedom: positions (piece, phase, tree) are the same sequence on every rank; a
// receive waits on a neighbour at the same position (up: a child, down: the parent, both
// acyclic chains ending at a leaf or the root) and a send waits for credits returned at
// earlier positions (slots >= 2).
#include <cstring>

#include "collectives/link.h"
#include "kernels/host_reduce.h"

namespace gradsync {
namespace {

class TreeRunner {
 public:
  explicit TreeRunner(RunContext& rc) : rc_(rc), l_(rc.links) {
    for (uint32_t t = 0; t < kNumTrees; ++t) {
      const TreeLinks& tl = l_.trees[t];
      up_send_.emplace_back(rc, l_.up_send[t], tl.parent);
      down_recv_.emplace_back(rc, l_.down_recv[t], tl.parent);
      for (int c = 0; c < 2; ++c) {
        up_recv_.emplace_back(rc, l_.up_recv[t][c], tl.children[c]);
        down_send_.emplace_back(rc, l_.down_send[t][c], tl.children[c]);
      }
    }
  }

  Status run() {
    const CollectiveCall& c = rc_.call;
    // Tree 0 takes the first half, tree 1 the second.
    size_t half = c.count / 2;
    size_t lo[2] = {0, half}, hi[2] = {half, c.count};
    size_t pieces[2];
    for (int t = 0; t < 2; ++t) pieces[t] = (hi[t] - lo[t] + rc_.slot_elems - 1) / rc_.slot_elems;
    size_t total = std::max(pieces[0], pieces[1]);
    for (size_t k = 0; k < total; ++k) {
      for (int t = 0; t < 2; ++t) {
        if (k < pieces[t]) GS_RETURN_IF_ERROR(up(t, span(lo[t], hi[t], k)));
      }
      for (int t = 0; t < 2; ++t) {
        if (k < pieces[t]) GS_RETURN_IF_ERROR(down(t, span(lo[t], hi[t], k)));
      }
    }
    return Status::Ok();
  }

 private:
  struct Span {
    size_t begin, len;
  };
  Span span(size_t lo, size_t hi, size_t k) const {
    size_t b = lo + k * rc_.slot_elems;
    return {b, std::min(hi, b + rc_.slot_elems) - b};
  }
  const uint8_t* in(size_t e) const { return static_cast<const uint8_t*>(rc_.call.send) + e * rc_.esize; }
  uint8_t* out(size_t e) const { return static_cast<uint8_t*>(rc_.call.recv) + e * rc_.esize; }
  ReduceOp op() const { return rc_.call.kind == CollectiveKind::kBarrier ? ReduceOp::kSum : rc_.call.op; }

  // Children's partial sums plus mine: to the parent's slot, or (root) the final value to out.
  Status up(int t, Span s) {
    const TreeLinks& tl = l_.trees[t];
    const DataType type = rc_.call.type;
    const int nchildren = (tl.children[0] >= 0) + (tl.children[1] >= 0);
    const bool root = tl.parent < 0;
    uint8_t* acc = nullptr;
    if (!root) {
      auto slot = up_send_[t].acquire();
      if (!slot.ok()) return slot.status();
      acc = *slot;
    } else {
      acc = out(s.begin);
    }
    const uint8_t* mine = in(s.begin);
    if (nchildren == 0 && !root) {  // a leaf passes its own data up (from the buffer where it can)
      up_send_[t].publish_from(acc, mine, s.len);
      return Status::Ok();
    }
    if (nchildren == 0) std::memcpy(acc, mine, s.len * rc_.esize);
    for (int c = 0; c < nchildren; ++c) {
      RecvLink& link = up_recv_[2 * t + c];
      auto slot = link.acquire(s.len);
      if (!slot.ok()) return slot.status();
      const uint8_t* first = c == 0 ? mine : acc;
      if (root && c == nchildren - 1) {
        kernels::reduce_final(type, op(), acc, nullptr, first, *slot, s.len, l_.world_size);
      } else {
        kernels::reduce(type, op(), acc, first, *slot, s.len);
      }
      link.release();
    }
    if (!root) up_send_[t].publish(s.len);
    return Status::Ok();
  }

  // The result from the parent (or, at the root, already in out) to out and to the children.
  Status down(int t, Span s) {
    const TreeLinks& tl = l_.trees[t];
    const bool root = tl.parent < 0;
    const uint8_t* src = out(s.begin);
    if (!root) {
      auto slot = down_recv_[t].acquire_into(s.len, out(s.begin));
      if (!slot.ok()) return slot.status();
      src = *slot;
      if (src != out(s.begin)) std::memcpy(out(s.begin), src, s.len * rc_.esize);
    }
    for (int c = 0; c < 2; ++c) {
      if (tl.children[c] < 0) continue;
      SendLink& link = down_send_[2 * t + c];
      auto slot = link.acquire();
      if (!slot.ok()) return slot.status();
      link.publish_from(*slot, out(s.begin), s.len);  // out holds src's bytes now
    }
    if (!root) down_recv_[t].release();
    return Status::Ok();
  }

  RunContext& rc_;
  const RankLinks& l_;
  std::vector<SendLink> up_send_;
  std::vector<RecvLink> down_recv_;
  std::vector<RecvLink> up_recv_;     // [2t + c]
  std::vector<SendLink> down_send_;   // [2t + c]
};

}  // namespace

Status run_tree(RunContext& rc) {
  if (rc.call.count == 0 && rc.call.kind != CollectiveKind::kBarrier) return Status::Ok();
  return TreeRunner(rc).run();
}

}  // namespace gradsync
