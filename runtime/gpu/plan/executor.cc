#include "gpu/plan/executor.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <numeric>
#include <string>
#include <unordered_map>

#include "kernels/host_reduce.h"

namespace gradsync::plan {
namespace {

uint64_t queue_key(int c, int src, int dst) {
  return (uint64_t(uint32_t(c)) << 42) | (uint64_t(uint32_t(src)) << 21) | uint64_t(uint32_t(dst));
}

std::string where(int rank, const Step& s, size_t index) {
  return "rank " + std::to_string(rank) + " channel " + std::to_string(s.channel) + " step " +
         std::to_string(index) + " (" + to_string(s.prim) + ", " + std::to_string(s.count) + " elements)";
}

bool reduces(Prim p) {
  return p == Prim::kRecvReduceSend || p == Prim::kRecvReduceCopySend || p == Prim::kRecvReduceCopy;
}
bool final_fold(Prim p) { return p == Prim::kRecvReduceCopySend || p == Prim::kRecvReduceCopy; }
bool reads_input(Prim p) {
  return p == Prim::kSend || p == Prim::kCopySend || p == Prim::kCopy || reduces(p);
}
bool writes_output(Prim p) {
  return p == Prim::kCopySend || p == Prim::kRecv || p == Prim::kRecvCopySend || p == Prim::kCopy ||
         final_fold(p);
}

struct Message {
  uint64_t count = 0;
  std::vector<unsigned char> data;
};

class Runner {
 public:
  Runner(const JobShape& shape, const ChannelSet& channels, const std::vector<std::vector<Step>>& steps,
         DataType type, ReduceOp op, const ExecOptions& opts, std::vector<RankBuffers>* bufs)
      : channels_(channels), steps_(steps), type_(type), op_(op), opts_(opts),
        bufs_(*bufs), esize_(element_size(type)), world_(shape.world_size()) {
    for (int r = 0; r < int(steps.size()); ++r) {
      std::vector<Stream> per(size_t(std::max(channels.size(), 1)));
      for (size_t i = 0; i < steps[size_t(r)].size(); ++i) {
        const int c = steps[size_t(r)][i].channel;
        if (c < 0 || c >= int(per.size())) {
          bad_ = where(r, steps[size_t(r)][i], i) + " names channel " + std::to_string(c) + " of " +
                 std::to_string(channels.size());
          return;
        }
        per[size_t(c)].rank = r;
        per[size_t(c)].steps.push_back(uint32_t(i));
      }
      for (auto& s : per)
        if (!s.steps.empty()) streams_.push_back(std::move(s));
    }
  }

  Status run(uint64_t* moved) {
    if (!bad_.empty()) return {Code::kInternal, bad_};
    for (;;) {
      bool progress = false, left = false;
      for (Stream& s : streams_) {
        while (s.next < s.steps.size()) {
          int ran = 0;
          Status st = try_step(s, &ran);
          if (!st.ok()) return st;
          if (!ran) break;
          progress = true;
          ++s.next;
        }
        left |= s.next < s.steps.size();
      }
      if (!left) break;
      if (!progress) return deadlock();
    }
    for (const auto& [k, q] : queues_) {
      if (!q.empty()) {
        return {Code::kInternal, "schedule ended with " + std::to_string(q.size()) + " message(s) of rank " +
                                     std::to_string((k >> 21) & 0x1fffff) + " to rank " + std::to_string(k & 0x1fffff) +
                                     " on channel " + std::to_string(k >> 42) + " never received"};
      }
    }
    *moved = moved_;
    return Status::Ok();
  }

 private:
  struct Stream {
    int rank = 0;
    std::vector<uint32_t> steps;
    size_t next = 0;
    std::string waiting;  // why it stopped, for the deadlock report
  };

  Status try_step(Stream& st, int* ran) {
    const int me = st.rank;
    const size_t index = st.steps[st.next];
    const Step& s = steps_[size_t(me)][index];
    RankBuffers& b = bufs_[size_t(me)];
    if (s.count == 0) return {Code::kInternal, where(me, s, index) + " has no elements"};
    const std::vector<unsigned char>& src = s.from_output ? b.out : b.in;
    if (reads_input(s.prim) && (s.in + s.count) * esize_ > src.size())
      return {Code::kInternal, where(me, s, index) + " reads past the " + (s.from_output ? "output" : "input") +
                                   " (offset " + std::to_string(s.in) + ")"};
    if (writes_output(s.prim) && (s.out + s.count) * esize_ > b.out.size())
      return {Code::kInternal, where(me, s, index) + " writes past the output (offset " + std::to_string(s.out) + ")"};
    std::vector<std::deque<Message>*> in_q, out_q;
    for (int i = 0; i < s.nrecv; ++i) {
      const int peer = s.recv[i];
      if (!channels_.hop(s.channel, peer, me))
        return {Code::kInternal, where(me, s, index) + " receives from rank " + std::to_string(peer) + ": no such hop"};
      auto& q = queues_[queue_key(s.channel, peer, me)];
      if (q.empty()) {
        st.waiting = where(me, s, index) + " waits for rank " + std::to_string(peer);
        return Status::Ok();
      }
      if (q.front().count != s.count)
        return {Code::kMismatch, where(me, s, index) + " got " + std::to_string(q.front().count) +
                                     " elements from rank " + std::to_string(peer)};
      in_q.push_back(&q);
    }
    for (int i = 0; i < s.nsend; ++i) {
      const int peer = s.send[i];
      if (!channels_.hop(s.channel, me, peer))
        return {Code::kInternal, where(me, s, index) + " sends to rank " + std::to_string(peer) + ": no such hop"};
      auto& q = queues_[queue_key(s.channel, me, peer)];
      if (q.size() >= opts_.slots) {
        st.waiting = where(me, s, index) + " has no slot toward rank " + std::to_string(peer);
        return Status::Ok();
      }
      out_q.push_back(&q);
    }
    const size_t bytes = s.count * esize_;
    const unsigned char* input = src.data() + s.in * esize_;
    unsigned char* output = b.out.data() + s.out * esize_;
    std::vector<unsigned char> val;
    switch (s.prim) {
      case Prim::kSend: val.assign(input, input + bytes); break;
      case Prim::kCopySend:
      case Prim::kCopy:
        val.assign(input, input + bytes);
        std::memmove(output, input, bytes);
        break;
      case Prim::kRecv:
      case Prim::kRecvCopySend:
        val = std::move(in_q[0]->front().data);
        std::memcpy(output, val.data(), bytes);
        break;
      default: {  // the folds
        std::vector<const unsigned char*> items;
        for (auto* q : in_q) items.push_back(q->front().data.data());
        items.insert(items.begin() + std::min<size_t>(s.self_pos, items.size()), input);
        val.assign(items[0], items[0] + bytes);
        const bool fin = final_fold(s.prim) && !s.partial;
        for (size_t j = 1; j < items.size(); ++j) {
          if (fin && j + 1 == items.size())
            kernels::reduce_final(type_, op_, val.data(), nullptr, val.data(), items[j], s.count, world_);
          else
            kernels::reduce(type_, op_, val.data(), val.data(), items[j], s.count);
        }
        if (fin && items.size() == 1) kernels::finish_avg(type_, val.data(), s.count, world_);
        if (writes_output(s.prim)) std::memcpy(output, val.data(), bytes);
      }
    }
    for (auto* q : in_q) q->pop_front();
    for (auto* q : out_q) q->push_back({s.count, val});
    moved_ += uint64_t(bytes) * uint64_t(s.nsend);
    *ran = 1;
    return Status::Ok();
  }

  Status deadlock() const {
    std::string msg = "the schedule deadlocked with " + std::to_string(opts_.slots) + " slot(s) per hop:";
    int shown = 0;
    for (const Stream& s : streams_) {
      if (s.next >= s.steps.size()) continue;
      if (shown++ == 4) {
        msg += " ...";
        break;
      }
      msg += " " + s.waiting + ";";
    }
    return {Code::kInternal, msg};
  }

  const ChannelSet& channels_;
  const std::vector<std::vector<Step>>& steps_;
  const DataType type_;
  const ReduceOp op_;
  const ExecOptions opts_;
  std::vector<RankBuffers>& bufs_;
  const size_t esize_;
  const int world_;
  std::vector<Stream> streams_;
  std::unordered_map<uint64_t, std::deque<Message>> queues_;
  std::string bad_;
  uint64_t moved_ = 0;
};

}  // namespace

LinkBytes::LinkBytes(const JobShape& shape)
    : intra_sent(size_t(shape.world_size())), intra_recv(size_t(shape.world_size())),
      inter_sent(size_t(shape.world_size())) {
  for (const auto& node : shape.nodes) {
    nic_sent.emplace_back(size_t(node.nic_count));
    nic_recv.emplace_back(size_t(node.nic_count));
  }
}

uint64_t LinkBytes::max_intra_sent() const {
  return intra_sent.empty() ? 0 : *std::max_element(intra_sent.begin(), intra_sent.end());
}
uint64_t LinkBytes::total_intra_sent() const {
  return std::accumulate(intra_sent.begin(), intra_sent.end(), uint64_t{0});
}
uint64_t LinkBytes::node_nic_sent(int node) const {
  const auto& v = nic_sent[size_t(node)];
  return std::accumulate(v.begin(), v.end(), uint64_t{0});
}
uint64_t LinkBytes::node_nic_recv(int node) const {
  const auto& v = nic_recv[size_t(node)];
  return std::accumulate(v.begin(), v.end(), uint64_t{0});
}
uint64_t LinkBytes::max_nic() const {
  uint64_t m = 0;
  for (const auto& v : nic_sent)
    for (uint64_t b : v) m = std::max(m, b);
  for (const auto& v : nic_recv)
    for (uint64_t b : v) m = std::max(m, b);
  return m;
}

void count_bytes(const JobShape& shape, const ChannelSet& channels, int rank,
                 const std::vector<Step>& steps, size_t esize, LinkBytes* bytes) {
  const int node = shape.node_of(rank);
  for (const Step& s : steps) {
    const uint64_t b = uint64_t(s.count) * esize;
    for (int i = 0; i < s.nsend; ++i) {
      const Hop* h = channels.hop(s.channel, rank, s.send[i]);
      if (!h) continue;  // execute() reports it
      if (h->inter_node) {
        bytes->inter_sent[size_t(rank)] += b;
        bytes->nic_sent[size_t(node)][size_t(h->nic)] += b;
      } else {
        bytes->intra_sent[size_t(rank)] += b;
      }
    }
    for (int i = 0; i < s.nrecv; ++i) {
      const Hop* h = channels.hop(s.channel, s.recv[i], rank);
      if (!h) continue;
      if (h->inter_node) bytes->nic_recv[size_t(node)][size_t(h->recv_nic)] += b;
      else bytes->intra_recv[size_t(rank)] += b;
    }
  }
}

Status execute(const JobShape& shape, const ChannelSet& channels,
               const std::vector<std::vector<Step>>& steps, DataType type, ReduceOp op,
               const ExecOptions& opts, std::vector<RankBuffers>* bufs, LinkBytes* bytes) {
  const int n = shape.world_size();
  if (int(steps.size()) != n || int(bufs->size()) != n)
    return {Code::kInvalidArgument, "execute needs one step list and one buffer pair per rank of " + std::to_string(n)};
  if (element_size(type) == 0) return {Code::kInvalidArgument, "unknown data type"};
  if (opts.slots == 0) return {Code::kInvalidArgument, "execute needs at least one slot per hop"};
  uint64_t moved = 0;
  Status st = Runner(shape, channels, steps, type, op, opts, bufs).run(&moved);
  if (!st.ok()) return st;
  LinkBytes counted(shape);
  for (int r = 0; r < n; ++r) count_bytes(shape, channels, r, steps[size_t(r)], element_size(type), &counted);
  uint64_t counted_sent = 0;
  for (int r = 0; r < n; ++r) counted_sent += counted.intra_sent[size_t(r)] + counted.inter_sent[size_t(r)];
  if (counted_sent != moved)
    return {Code::kInternal, "byte count " + std::to_string(counted_sent) + " differs from the " +
                                 std::to_string(moved) + " bytes the run moved"};
  if (bytes) *bytes = std::move(counted);
  return Status::Ok();
}

}  // namespace gradsync::plan
