#include "gpu/step_runner.h"

#include <algorithm>
#include <string>

#include "gpu/plan/cost_model.h"
#include "gpu/plan/executor.h"

namespace gradsync {

Result<RdmaChannels> rdma_channels(const std::vector<int>& members, const std::vector<std::string>& hosts, int me,
                                   bool direct, bool pairs) {
  RdmaChannels ch;
  ch.members = members;
  ch.direct = direct;
  const int k = int(members.size());
  for (int i = 0; i < k; ++i) {
    const int r = members[size_t(i)];
    if (r < 0 || size_t(r) >= hosts.size()) {
      return Status(Code::kInternal, "RDMA channels: member " + std::to_string(r) + " has no host");
    }
    if (r == me) {
      if (ch.position >= 0) return Status(Code::kInternal, "RDMA channels: rank " + std::to_string(me) + " twice");
      ch.position = i;
    }
    // Nodes in order of their first member; plan ranks node by node in member order.
    auto node = std::find_if(ch.shape.nodes.begin(), ch.shape.nodes.end(),
                             [&](const plan::NodeShape& n) { return n.name == hosts[size_t(r)]; });
    if (node == ch.shape.nodes.end()) {
      ch.shape.nodes.emplace_back();
      node = ch.shape.nodes.end() - 1;
      node->name = hosts[size_t(r)];
    }
    node->gpus.push_back(int(node->ranks.size()));
    node->ranks.push_back(i);
    node->nics.push_back(0);
  }
  if (ch.position < 0) return Status(Code::kInternal, "RDMA channels: rank " + std::to_string(me) + " is no member");
  if (std::string why = ch.shape.validate(); !why.empty()) return Status(Code::kInternal, "RDMA channels: " + why);
  // Without direct peers every hop of these channels is a queue pair, those inside a node too
  // (the cost model's latency per hop; rdma_choose_algos counts the bytes so).
  if (!direct) ch.shape.links.intra_lat = ch.shape.links.nic_lat;
  const std::string& my_node = hosts[size_t(me)];
  plan::PlanRequest req;
  req.algo = plan::Algo::kRing;
  ch.ring = plan::plan_channels(ch.shape, req);
  req.algo = plan::Algo::kTree;
  ch.tree = plan::plan_channels(ch.shape, req);
  // One-shot and two-shot share the direct channels (plan_channels gives both the same); across
  // nodes the hierarchical channels hold each node's pairs.
  req.algo = plan::Algo::kOneShot;
  if (pairs && k >= 2 && plan::check_request(ch.shape, req).empty()) ch.pairs = plan::plan_channels(ch.shape, req);
  req.algo = plan::Algo::kHierarchical;
  if (pairs && plan::check_request(ch.shape, req).empty()) ch.hier = plan::plan_channels(ch.shape, req);
  for (const plan::ChannelSet* set : {&ch.ring, &ch.tree, &ch.pairs, &ch.hier}) {
    for (const plan::Channel& c : set->channels()) {
      for (const plan::Hop& h : c.hops) {
        if (h.src != ch.position && h.dst != ch.position) continue;
        const int other = members[size_t(h.src == ch.position ? h.dst : h.src)];
        auto p = std::find_if(ch.peers.begin(), ch.peers.end(), [&](const GdrPeer& q) { return q.rank == other; });
        if (p == ch.peers.end()) {
          ch.peers.push_back({other, false, false, direct && hosts[size_t(other)] == my_node});
          p = ch.peers.end() - 1;
        }
        (h.src == ch.position ? p->send : p->recv) = true;
      }
    }
  }
  if (ch.peers.size() > size_t(kMaxGdrPeers)) {
    return Status(Code::kInternal, "RDMA channels: " + std::to_string(ch.peers.size()) + " peers, at most " +
                                       std::to_string(kMaxGdrPeers));
  }
  return ch;
}

namespace {

// The largest allreduce (bytes) on which the step kernel's low-latency protocol ran faster
// than its bulk one, per plan::Algo, on the H200 at 1 node x 8 ranks sharing GPU 0
// (docs/benchmarks.md, "Low-latency steps", the caps as measured on 2026-12-04): the model
// alone (NCCL's LL figures) chose it up to 8 MiB, where it took 1.1-1.4x bulk's time at 1 MiB
// on the ring and one-shot and two-shot steps. One-shot's lines go to every peer, so it pays
// the halved bandwidth soonest.
constexpr size_t kLowLatencyMeasuredMax[plan::kNumAlgos] = {
    size_t(256) << 10,  // ring
    size_t(1) << 20,    // tree
    size_t(64) << 10,   // one-shot
    size_t(64) << 10,   // two-shot
    0,                  // hierarchical: not by the model across nodes (GRADSYNC_PROTO=ll forces it)
};

// The channels an algorithm runs over (rdma_steps').
const plan::ChannelSet& channels_of(const RdmaChannels& ch, plan::Algo algo) {
  switch (algo) {
    case plan::Algo::kTree: return ch.tree;
    case plan::Algo::kOneShot:
    case plan::Algo::kTwoShot: return ch.pairs;
    case plan::Algo::kHierarchical: return ch.hier;
    default: return ch.ring;
  }
}

}  // namespace

void rdma_choose_algos(RdmaChannels& ch) {
  ch.auto_algo.clear();
  if (ch.members.size() < 2) return;
  // The model's hop counts; as the bytes, the most any rank of its sample sends. Without direct
  // peers, inside its node and out of it together: every hop goes through the rank's NIC
  // (the model's own figures take a GPU's bytes inside its node and its NIC's as apart, which
  // is what direct peers give).
  auto predict = [&](plan::Algo algo, size_t bytes, plan::Protocol proto) {
    plan::PlanRequest r;
    r.algo = algo;
    r.count = bytes / 4;
    const plan::ChannelSet& set = channels_of(ch, algo);
    plan::ScheduleFigures fig = plan::schedule_hops(ch.shape, r, set);
    plan::LinkBytes b(ch.shape);
    for (int x : plan::sample_nodes(ch.shape, algo)) {
      for (int q : ch.shape.nodes[size_t(x)].ranks) {
        plan::count_bytes(ch.shape, set, q, plan::rank_steps(ch.shape, set, r, q), r.esize, &b);
        if (ch.direct) {
          fig.max_intra_bytes = std::max(fig.max_intra_bytes, b.intra_sent[size_t(q)]);
          fig.max_nic_bytes = std::max(fig.max_nic_bytes, b.inter_sent[size_t(q)]);
        } else {
          fig.max_nic_bytes = std::max(fig.max_nic_bytes, b.intra_sent[size_t(q)] + b.inter_sent[size_t(q)]);
        }
      }
    }
    // The ring-or-trees choice costs both with the bulk protocol: costed each with its best
    // protocol, the choice followed whichever protocol each algorithm would have taken at a
    // size, and the tables switched between ring and trees several times (4x2: tree, ring,
    // tree, ring). The protocol is chosen for the algorithm afterwards.
    return plan::predict_us(ch.shape.links, fig, algo, proto);
  };
  // 8 B .. 64 MiB: the model's terms are linear in the bytes beyond. Ties keep the earlier
  // of ring, tree, hierarchical, one-shot, two-shot (the last two where one node's pairs are).
  std::vector<plan::Algo> algos = {plan::Algo::kRing, plan::Algo::kTree};
  if (ch.hier.size() > 0) algos.push_back(plan::Algo::kHierarchical);
  if (ch.pairs.size() > 0) algos.insert(algos.end(), {plan::Algo::kOneShot, plan::Algo::kTwoShot});
  for (size_t bytes = 8; bytes <= (size_t(64) << 20); bytes *= 2) {
    plan::Algo best = algos[0];
    double best_us = predict(best, bytes, plan::Protocol::kBulk);
    for (size_t a = 1; a < algos.size(); ++a) {
      const double us = predict(algos[a], bytes, plan::Protocol::kBulk);
      if (us < best_us) best = algos[a], best_us = us;
    }
    ch.auto_algo.push_back(best);
  }
  // The low-latency protocol where every hop has its slots, i.e. on one node with direct
  // peers (a property of the shape, the same on every rank: a rank whose own peers happen to
  // be all direct, inside a chain of a node of a larger job, must not choose alone): per
  // algorithm, up to the size where the model predicts it faster than bulk, and at most the
  // size where it was measured faster (kLowLatencyMeasuredMax).
  for (size_t& m : ch.ll_max_bytes) m = 0;
  if (!ch.direct || ch.shape.node_count() != 1 || ch.members.size() < 2) return;
  algos = {plan::Algo::kRing, plan::Algo::kTree};
  if (ch.pairs.size() > 0) algos.insert(algos.end(), {plan::Algo::kOneShot, plan::Algo::kTwoShot});
  for (plan::Algo a : algos) {
    for (size_t bytes = 8; bytes <= kLowLatencyMeasuredMax[int(a)]; bytes *= 2) {
      if (predict(a, bytes, plan::Protocol::kLowLatency) >= predict(a, bytes, plan::Protocol::kBulk)) break;
      ch.ll_max_bytes[int(a)] = bytes;
    }
  }
}

bool rdma_auto_low_latency(const RdmaChannels& ch, plan::Algo algo, size_t bytes) {
  return bytes <= ch.ll_max_bytes[int(algo)];
}

std::string rdma_protocol_summary(const RdmaChannels& ch) {
  std::string out;
  for (plan::Algo a : {plan::Algo::kRing, plan::Algo::kTree, plan::Algo::kOneShot, plan::Algo::kTwoShot}) {
    if (ch.ll_max_bytes[int(a)] == 0) continue;
    out += (out.empty() ? "" : ", ") + std::string(plan::to_string(a)) + " up to " +
           std::to_string(ch.ll_max_bytes[int(a)]) + " B";
  }
  return out.empty() ? "bulk at every size" : "low-latency: " + out + "; bulk above";
}

plan::Algo rdma_auto_algo(const RdmaChannels& ch, size_t bytes) {
  if (ch.auto_algo.empty()) return plan::Algo::kRing;
  size_t i = 0;
  while (i + 1 < ch.auto_algo.size() && (size_t(8) << i) < bytes) ++i;
  return ch.auto_algo[i];
}

std::string rdma_auto_summary(const RdmaChannels& ch) {
  const auto& t = ch.auto_algo;
  std::string out;
  for (size_t i = 0; i < t.size(); ++i) {
    if (i + 1 < t.size() && t[i + 1] == t[i]) continue;  // not the end of a run of one choice
    const bool last = i + 1 == t.size();
    if (last && out.empty()) return std::string(plan::to_string(t[i])) + " at every size";
    out += (out.empty() ? "" : ", ") + std::string(plan::to_string(t[i])) +
           (last ? " above" : " up to " + std::to_string(size_t(8) << i) + " B");
  }
  return out.empty() ? "ring at every size" : out;
}

Result<std::vector<plan::Step>> rdma_steps(const RdmaChannels& ch, CollectiveKind kind, plan::Algo algo,
                                           size_t count, size_t esize, int root, size_t slot_bytes,
                                           size_t window) {
  const bool direct_pushes = algo == plan::Algo::kOneShot || algo == plan::Algo::kTwoShot;
  const bool allreduce = kind == CollectiveKind::kAllreduce;
  // The sets that exist only when asked for: one-shot and two-shot (every collective), and
  // hierarchical (allreduce; the others take the ring).
  const bool asked = direct_pushes || (algo == plan::Algo::kHierarchical && allreduce);
  plan::PlanRequest req;
  req.kind = kind;
  req.algo = asked ? algo : algo == plan::Algo::kTree && allreduce ? plan::Algo::kTree : plan::Algo::kRing;
  req.count = count;
  req.esize = esize;
  req.chunk_bytes = slot_bytes / esize * esize;
  req.window = window;
  const auto at = std::find(ch.members.begin(), ch.members.end(), root);
  req.root = kind == CollectiveKind::kBroadcast ? int(at - ch.members.begin()) : 0;
  if (kind == CollectiveKind::kBroadcast && at == ch.members.end()) {
    return Status(Code::kInternal, "broadcast root " + std::to_string(root) + " is no member of the RDMA channels");
  }
  if (req.chunk_bytes == 0) return Status(Code::kInternal, "RDMA slots smaller than one element");
  const plan::ChannelSet* set = &channels_of(ch, req.algo);
  if (asked) {
    const std::string who = "rank " + std::to_string(ch.position >= 0 ? ch.members[size_t(ch.position)] : -1) + ": ";
    const char* needs = direct_pushes ? " needs the direct pairs of one node, and "
                                      : " needs the pairs of every node and a ring per local index, and ";
    if (set->size() == 0) {
      std::string why = plan::check_request(ch.shape, req);
      if (why.empty()) why = ch.members.size() < 2 ? "one member has no pair" : "the channels were set up without them";
      return Status(Code::kInvalidArgument,
                    who + plan::to_string(algo) + needs + "these step channels have none (" + why + ")");
    }
    if (std::string why = plan::check_request(ch.shape, req); !why.empty()) {
      return Status(Code::kInvalidArgument, who + plan::to_string(algo) + ": " + why);
    }
  }
  std::vector<plan::Step> steps = plan::rank_steps(ch.shape, *set, req, ch.position);
  std::stable_sort(steps.begin(), steps.end(),
                   [](const plan::Step& a, const plan::Step& b) { return a.channel < b.channel; });
  return steps;
}

StepRunner::StepRunner(GdrLink* link, bool relative)
    : link_(*link), relative_(relative), sent_(size_t(link->peer_count()), 0),
      received_(size_t(link->peer_count()), 0) {}

namespace {

bool overlap(const void* a, const void* b, size_t bytes) {
  auto* x = static_cast<const uint8_t*>(a);
  auto* y = static_cast<const uint8_t*>(b);
  return x < y + bytes && y < x + bytes;
}

}  // namespace

// A low-latency message's flag: its number from 1, never 0 (the flag of memory never written).
uint32_t ll_flag(uint64_t msg) {
  const uint32_t f = uint32_t(msg + 1);
  return f == 0 ? 1u : f;
}

Status StepRunner::run(const std::vector<plan::Step>& steps, const std::vector<int>& members, const void* input,
                       void* output, size_t esize, StepStream& stream, bool low_latency) {
  const uint32_t slots = link_.slots();
  std::vector<GdrLink::Message> planned;
  Status s = Status::Ok();
  if (relative_) {
    // This call's counts from 0, on top of the bases.
    std::fill(sent_.begin(), sent_.end(), 0);
    std::fill(received_.begin(), received_.end(), 0);
    for (int p = 0; p < link_.peer_count() && s.ok(); ++p) {
      if (!link_.peer(p).direct) s = Status(Code::kInternal, "relative step counts need direct peers only");
    }
  }
  if (s.ok()) s = stream.begin_call(relative_);
  for (size_t i = 0; i < steps.size() && s.ok(); ++i) {
    const plan::Step& st = steps[i];
    const size_t bytes = size_t(st.count) * esize;
    auto bad = [&](const std::string& why) {
      return Status(Code::kInternal, "step " + std::to_string(i) + " (" + plan::to_string(st.prim) + ", channel " +
                                         std::to_string(st.channel) + "): " + why);
    };
    int rp[plan::kMaxPeers], sp[plan::kMaxPeers];
    StepBuf payload[plan::kMaxPeers];  // receive slots: this rank's until it signals `consumed`
    StepBuf slot_out[plan::kMaxPeers];
    for (int j = 0; j < st.nrecv + st.nsend; ++j) {
      const bool recv = j < st.nrecv;
      const int pos = recv ? st.recv[j] : st.send[j - st.nrecv];
      const int p = pos >= 0 && size_t(pos) < members.size() ? link_.peer_index(members[size_t(pos)]) : -1;
      if (p < 0 || (recv ? !link_.peer(p).recv : !link_.peer(p).send)) {
        s = bad("no RDMA link " + std::string(recv ? "from" : "to") + " plan rank " + std::to_string(pos));
        break;
      }
      (recv ? rp[j] : sp[j - st.nrecv]) = p;
    }
    if (!s.ok()) break;
    if ((st.nrecv + st.nsend > 0) && bytes > link_.slot_bytes()) {
      s = bad(std::to_string(bytes) + "-byte message over the " + std::to_string(link_.slot_bytes()) + "-byte slots");
      break;
    }
    // The worker learns of each step's messages before the stream waits for them (a stream
    // that runs at once, as the CPU tests' does, would otherwise wait for an arrival the
    // worker holds back until it is planned), and as each step is queued rather than at the
    // end of the call: a call of many steps fills the stream's launch queue, and a kernel
    // launch then blocks until the GPU has run earlier steps, whose messages the worker must
    // already know.
    // The slots: a low-latency one where asked, the message fits and the peer has them (the
    // same on both ends: the peer is direct or RDMA for both, never TCP, and the message's
    // length is the plan's). The worker learns which messages are low-latency from the plan.
    const bool ll_fits = low_latency && bytes <= link_.ll_payload_bytes();
    auto is_ll = [&](int p, bool recv) { return ll_fits && link_.ll_slot(p, recv, 0) != nullptr; };
    for (int j = 0; j < st.nsend; ++j) planned.push_back({sp[j], true, uint32_t(bytes), is_ll(sp[j], false)});
    for (int j = 0; j < st.nrecv; ++j) planned.push_back({rp[j], false, uint32_t(bytes), is_ll(rp[j], true)});
    link_.plan(planned);
    planned.clear();
    s = stream.begin_step();
    // Relative: the slot of message msg as if the base were a multiple of the slots, which
    // the stream moves on by the base (StepBuf::slot).
    auto at = [&](int p, bool recv, uint64_t msg) -> StepBuf {
      uint8_t* ll = ll_fits ? link_.ll_slot(p, recv, msg) : nullptr;
      StepBuf b = ll != nullptr ? StepBuf(ll, relative_ ? uint32_t(msg + 1) : ll_flag(msg), link_.peer(p).rank)
                                : StepBuf(link_.slot(p, recv, msg));
      if (relative_) {
        b.base = step_base(p, recv);
        b.slot = int(msg % slots);
      }
      return b;
    };
    for (int j = 0; j < st.nrecv; ++j) payload[j] = at(rp[j], true, received_[size_t(rp[j])]);
    for (int j = 0; j < st.nsend; ++j) slot_out[j] = at(sp[j], false, sent_[size_t(sp[j])]);
    // Waits: a message from each peer received from (a low-latency one is read as it lands),
    // a free slot at each peer sent to.
    for (int j = 0; j < st.nrecv && s.ok(); ++j) {
      if (payload[j].flag == 0) s = stream.wait_arrived(rp[j], int64_t(received_[size_t(rp[j])]) + 1);
    }
    for (int j = 0; j < st.nsend && s.ok(); ++j) {
      // Relative: the first slots too (the previous calls' last messages in them), unless the base is 0.
      const uint64_t m = sent_[size_t(sp[j])];
      if (relative_ || m + 1 > slots) s = stream.wait_send_free(sp[j], int64_t(m) + 1 - int64_t(slots));
    }
    if (!s.ok()) break;

    const uint8_t* own_p = static_cast<const uint8_t*>(st.from_output ? output : input) + st.in * esize;
    uint8_t* out_p = static_cast<uint8_t*>(output) + st.out * esize;
    const StepBuf own(own_p), out(out_p);
    // The fold of the payloads and the own operand into `dst` (and dst2), in one pass: the
    // stream reads every operand of an element before it writes the element, so in place
    // (dst the own operand) needs no partial folds elsewhere, wherever the own operand stands.
    auto fold = [&](StepBuf dst, StepBuf dst2, bool final) -> Status {
      const int k = st.nrecv + 1;
      if (k < 2) return bad("a fold of one operand");
      if (st.self_pos >= k) return bad("own operand at position " + std::to_string(st.self_pos));
      StepBuf x[plan::kMaxPeers + 1];
      for (int j = 0, r = 0; j < k; ++j) x[j] = j == st.self_pos ? own : payload[r++];
      if (overlap(own_p, dst.p, bytes) && own_p != dst.p) return bad("the own operand overlaps the fold's destination");
      return stream.fold(dst, dst2, x, k, st.count, final);
    };
    auto copy_to_sends = [&](StepBuf src, int from) -> Status {
      for (int j = from; j < st.nsend; ++j) GS_RETURN_IF_ERROR(stream.copy(slot_out[j], src, bytes));
      return Status::Ok();
    };
    switch (st.prim) {
      case plan::Prim::kCopy:
        s = own_p == out_p ? Status::Ok() : stream.copy(out, own, bytes);
        break;
      case plan::Prim::kSend:
        s = copy_to_sends(own, 0);
        break;
      case plan::Prim::kCopySend:
        s = own_p == out_p ? Status::Ok() : stream.copy(out, own, bytes);
        if (s.ok()) s = copy_to_sends(own, 0);
        break;
      case plan::Prim::kRecv:
        s = stream.copy(out, payload[0], bytes);
        break;
      case plan::Prim::kRecvCopySend:
        s = stream.copy(out, payload[0], bytes);
        if (s.ok()) s = copy_to_sends(payload[0], 0);
        break;
      case plan::Prim::kRecvReduceSend:
        if (st.nsend == 0) {
          s = bad("no peer to send to");
          break;
        }
        s = fold(slot_out[0], {}, false);
        // The other sends copy the fold from the first send slot, unless that one is a
        // low-latency slot in the peer's memory: then they fold again (no read across the link).
        for (int j = 1; j < st.nsend && s.ok(); ++j) {
          s = slot_out[0].flag == 0 ? stream.copy(slot_out[j], slot_out[0], bytes) : fold(slot_out[j], {}, false);
        }
        break;
      case plan::Prim::kRecvReduceCopySend:
      case plan::Prim::kRecvReduceCopy: {
        const bool sends = st.prim == plan::Prim::kRecvReduceCopySend && st.nsend > 0;
        s = fold(out, sends && !st.partial ? slot_out[0] : StepBuf{}, !st.partial);
        if (s.ok() && sends) s = copy_to_sends(out, st.partial ? 0 : 1);
        break;
      }
    }
    if (!s.ok()) break;
    // Signals: the messages written and the slots read; after the step's stores where a
    // message is in plain memory, or in an RDMA peer's low-latency send slot (the NIC reads
    // those lines once the worker sees `ready`; only a direct peer reads them by their flags).
    for (int j = 0; j < st.nsend; ++j) {
      if (slot_out[j].flag == 0 || !link_.peer(sp[j]).direct) stream.order_signals();
    }
    for (int j = 0; j < st.nsend && s.ok(); ++j) {
      const size_t p = size_t(sp[j]);
      s = stream.signal_ready(sp[j], ++sent_[p]);
    }
    for (int j = 0; j < st.nrecv && s.ok(); ++j) {
      const size_t p = size_t(rp[j]);
      s = stream.signal_consumed(rp[j], ++received_[p]);
    }
    if (s.ok()) s = stream.end_step();
  }
  Status queued = stream.end_call();
  return s.ok() ? queued : s;
}

}  // namespace gradsync
