#include "collectives/collective.h"

#include <cstring>

#include <limits>

#include "collectives/link.h"
#include "kernels/host_reduce.h"

namespace gradsync {

Status run_ring(RunContext& rc);  // ring.cc
Status run_tree(RunContext& rc);  // tree.cc

size_t element_size(DataType type) {
  switch (type) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt8: return 1;
    case DataType::kUInt8: return 1;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
  }
  return 0;
}

const char* to_string(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
  }
  return "unknown";
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kAvg: return "avg";
  }
  return "unknown";
}

const char* to_string(Algorithm algo) {
  switch (algo) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
  }
  return "unknown";
}

const char* to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllreduce: return "allreduce";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "unknown";
}

uint32_t collective_signature(const CollectiveCall& call) {
  // kind | type | op | root, one byte each (root modulo 256 is enough to catch disagreement
  // in practice; the full root is also in the error text).
  return (uint32_t(call.kind) << 24) | (uint32_t(call.type) << 16) | (uint32_t(call.op) << 8) |
         (uint32_t(call.root) & 0xFF);
}

std::string describe(const CollectiveCall& call) {
  std::string s = std::string(to_string(call.kind)) + " #" + std::to_string(call.seq) +
                  " (count=" + std::to_string(call.count) + " type=" + to_string(call.type);
  if (call.kind == CollectiveKind::kAllreduce || call.kind == CollectiveKind::kReduceScatter) {
    s += std::string(" op=") + to_string(call.op);
  }
  if (call.kind == CollectiveKind::kBroadcast) s += " root=" + std::to_string(call.root);
  return s + " algo=" + to_string(call.algorithm) + ")";
}

std::string RankLinks::name(int r) const {
  std::string host = (r >= 0 && size_t(r) < hosts.size()) ? hosts[r] : "?";
  return "rank " + std::to_string(r) + " (host " + host + ")";
}

Status validate(const CollectiveCall& call, int world_size, int rank) {
  size_t esize = element_size(call.type);
  if (esize == 0) return {Code::kInvalidArgument, "unknown data type " + std::to_string(int(call.type))};
  if (std::string(to_string(call.op)) == "unknown") {
    return {Code::kInvalidArgument, "unknown reduce op " + std::to_string(int(call.op))};
  }
  if (std::string(to_string(call.kind)) == "unknown") {
    return {Code::kInvalidArgument, "unknown collective " + std::to_string(int(call.kind))};
  }
  if (std::string(to_string(call.algorithm)) == "unknown") {
    return {Code::kInvalidArgument, "unknown algorithm " + std::to_string(int(call.algorithm))};
  }
  if (call.algorithm == Algorithm::kTree && call.kind != CollectiveKind::kAllreduce &&
      call.kind != CollectiveKind::kBarrier) {
    return {Code::kInvalidArgument, std::string("the tree algorithm is defined for allreduce and "
                                                "barrier only, not ") + to_string(call.kind) +
                                        "; use ring or auto"};
  }
  // Elements of the larger of the two buffers.
  size_t scale = (call.kind == CollectiveKind::kReduceScatter || call.kind == CollectiveKind::kAllGather)
                     ? size_t(world_size) : 1;
  if (call.count > std::numeric_limits<size_t>::max() / esize / scale) {
    return {Code::kInvalidArgument, "count " + std::to_string(call.count) + " of " +
                                        to_string(call.type) + " overflows the byte size"};
  }
  if (call.kind == CollectiveKind::kBroadcast && (call.root < 0 || call.root >= world_size)) {
    return {Code::kInvalidArgument, "root " + std::to_string(call.root) + " outside [0, " +
                                        std::to_string(world_size) + ")"};
  }
  if (call.count > 0 && call.kind != CollectiveKind::kBarrier) {
    bool needs_send = call.kind != CollectiveKind::kBroadcast;
    if ((needs_send && call.send == nullptr) || call.recv == nullptr) {
      return {Code::kInvalidArgument, std::string(call.recv == nullptr ? "recv" : "send") +
                                          " buffer is null with count " + std::to_string(call.count)};
    }
    auto misaligned = [&](const void* p) { return p && reinterpret_cast<uintptr_t>(p) % esize != 0; };
    if (misaligned(call.send) || misaligned(call.recv)) {
      return {Code::kInvalidArgument, "buffer is not aligned to its element size (" +
                                          std::to_string(esize) + " bytes)"};
    }
    // In-place reduce-scatter/all-gather follow NCCL: the rank's block of the large buffer is
    // the small one. Any other overlap would overwrite input that is still to be sent.
    if (call.kind == CollectiveKind::kReduceScatter || call.kind == CollectiveKind::kAllGather) {
      bool rs = call.kind == CollectiveKind::kReduceScatter;
      auto* big = static_cast<const uint8_t*>(rs ? call.send : call.recv);
      auto* small = static_cast<const uint8_t*>(rs ? call.recv : call.send);
      size_t block = call.count * esize;
      bool overlap = small < big + block * world_size && big < small + block;
      if (overlap && small != big + block * size_t(rank)) {
        return {Code::kInvalidArgument,
                std::string(to_string(call.kind)) + " buffers overlap; in place means the " +
                    (rs ? "recv buffer is send + rank * recv_count" : "send buffer is recv + rank * send_count")};
      }
    }
  }
  return Status::Ok();
}

Status link_error(const RunContext& rc, const Status& s, bool sending, int peer, uint32_t step) {
  const RankLinks& l = rc.links;
  std::string who = "job=" + l.job + " rank " + std::to_string(l.rank);
  if (s.code() == Code::kDeadlineExceeded) {
    std::string what = sending ? "a free slot at " + l.name(peer) : "data from " + l.name(peer);
    // The rank waited for may itself be waiting for the one that stopped: name it as the one
    // waited for, never as the culprit.
    return {Code::kDeadlineExceeded,
            who + " timed out waiting for " + what + " at step " + std::to_string(step) + " of " +
                describe(rc.call) + "; that rank, or one it waits for in turn, is stuck, not calling "
                                    "this collective, or dead (which one is not known here)"};
  }
  if (s.code() == Code::kMismatch && s.message() == kPeerLeftMessage) {
    return {Code::kMismatch, who + " is in " + describe(rc.call) + " but " + l.name(peer) +
                                 " left the job after its last collective: the ranks made different numbers "
                                 "of collective calls (this rank one or more than " + l.name(peer) + ")"};
  }
  return {s.code(), who + ": " + describe(rc.call) + " failed: " + s.message()};
}

int failed_peer(const RankLinks& links, const Status& s) {
  if (s.code() != Code::kUnavailable || !links.driver) return -1;
  return links.driver->failed_peer();
}

Result<uint8_t*> SendLink::acquire() {
  auto slot = ch_.acquire_send(rc_.wait);
  if (!slot.ok()) return link_error(rc_, slot.status(), true, peer_, step_);
  return *slot;
}

void SendLink::publish(size_t elems) {
  ch_.publish(SlotMeta{uint32_t(elems * rc_.esize), rc_.call.seq, rc_.call.count, rc_.signature, step_});
  ++step_;
}

void SendLink::publish_from(uint8_t* slot, const uint8_t* data, size_t elems) {
  SlotMeta meta{uint32_t(elems * rc_.esize), rc_.call.seq, rc_.call.count, rc_.signature, step_};
  if (ch_.driven()) {
    ch_.publish_external(meta, data);
  } else {
    if (slot != data) std::memcpy(slot, data, meta.bytes);
    ch_.publish(meta);
  }
  ++step_;
}

Result<const uint8_t*> RecvLink::acquire(size_t elems) { return acquire_into(elems, nullptr); }

Result<const uint8_t*> RecvLink::acquire_into(size_t elems, uint8_t* dst) {
  SlotMeta meta{};
  const SlotMeta expect{uint32_t(elems * rc_.esize), rc_.call.seq, rc_.call.count, rc_.signature, step_};
  auto slot = dst ? ch_.acquire_recv_into(rc_.wait, &meta, expect, dst) : ch_.acquire_recv(rc_.wait, &meta);
  if (!slot.ok()) return link_error(rc_, slot.status(), false, peer_, step_);
  const CollectiveCall& c = rc_.call;
  if (meta.seq != c.seq || meta.signature != rc_.signature || meta.count != c.count ||
      meta.step != step_ || meta.bytes != elems * rc_.esize) {
    CollectiveCall theirs = c;
    theirs.seq = meta.seq;
    theirs.count = meta.count;
    theirs.kind = CollectiveKind(meta.signature >> 24);
    theirs.type = DataType((meta.signature >> 16) & 0xFF);
    theirs.op = ReduceOp((meta.signature >> 8) & 0xFF);
    return Status(Code::kMismatch,
                  "job=" + rc_.links.job + " rank " + std::to_string(rc_.links.rank) + " is in " +
                      describe(c) + " but " + rc_.links.name(peer_) + " sent step " +
                      std::to_string(meta.step) + " of " + describe(theirs) +
                      ": ranks called different collectives or arguments");
  }
  ++step_;
  return *slot;
}

Status run_collective(const RankLinks& links, const WaitContext& wait, const CollectiveCall& call) {
  size_t esize = element_size(call.type);
  size_t slot_bytes = links.world_size > 1 ? links.ring_send[0].slot_bytes() : 4096;
  // The call's own stop flag, raised by whichever of its threads fails first (ring lanes).
  std::atomic<bool> call_stop{false};
  WaitContext call_wait = wait;
  call_wait.call_stop = &call_stop;
  RunContext rc{links, call_wait, call, collective_signature(call), esize, slot_bytes / esize, &call_stop};
  Status s = call.algorithm == Algorithm::kTree && links.world_size > 1 ? run_tree(rc) : run_ring(rc);
  // Slots this rank published on its own sockets leave before it returns: a peer may be
  // waiting for them while this rank computes.
  if (s.ok() && links.driver) {
    s = links.driver->flush(wait);
    if (!s.ok()) s = link_error(rc, s, true, links.next_rank(), 0);
  }
  // Slots that did not leave may point into the caller's buffers, which are the caller's
  // again once this returns: nothing more is sent on this rank's sockets.
  if (!s.ok() && links.driver) links.driver->abandon(s);
  return s;
}

}  // namespace gradsync
