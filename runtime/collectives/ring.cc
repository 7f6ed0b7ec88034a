#include "collectives/ring.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "kernels/host_reduce.h"

namespace gradsync {
namespace {

constexpr uint32_t kKindAllreduce = 1;

std::string describe(const CollectiveCall& call) {
  return "allreduce #" + std::to_string(call.seq) + " (count=" + std::to_string(call.count) +
         " type=" + to_string(call.type) + " op=" + to_string(call.op) + ")";
}

// Turns a failed channel wait into an error naming the peer and the likely cause.
Status peer_error(const RingPeers& p, const CollectiveCall& call, Status s, bool sending,
                  uint64_t step) {
  if (s.code() == Code::kDeadlineExceeded) {
    std::string what = sending ? "a free slot at rank " + std::to_string(p.next_rank) + " (host " +
                                     p.next_host + ")"
                               : "data from rank " + std::to_string(p.prev_rank) + " (host " +
                                     p.prev_host + ")";
    return {Code::kDeadlineExceeded,
            "job=" + p.job + " rank " + std::to_string(p.rank) + " timed out waiting for " + what +
                " at step " + std::to_string(step) + " of " + describe(call) +
                "; that rank may be stuck, not calling this collective, or dead"};
  }
  return {s.code(), "job=" + p.job + " rank " + std::to_string(p.rank) + ": " + describe(call) +
                        " failed: " + s.message()};
}

// One pipeline piece: which elements of chunk `c` the current iteration covers.
struct Piece {
  size_t begin;
  size_t len;
};

}  // namespace

size_t element_size(DataType type) {
  switch (type) {
    case DataType::kFloat32: return 4;
  }
  return 0;
}

const char* to_string(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
  }
  return "unknown";
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
  }
  return "unknown";
}

uint32_t collective_signature(const CollectiveCall& call) {
  return (kKindAllreduce << 16) | (uint32_t(call.type) << 8) | uint32_t(call.op);
}

Status validate_allreduce(const CollectiveCall& call) {
  size_t esize = element_size(call.type);
  if (esize == 0) {
    return {Code::kInvalidArgument, "unknown data type " + std::to_string(int(call.type))};
  }
  if (std::string(to_string(call.op)) == "unknown") {
    return {Code::kInvalidArgument, "unknown reduce op " + std::to_string(int(call.op))};
  }
  if (call.count > std::numeric_limits<size_t>::max() / esize) {
    return {Code::kInvalidArgument, "count " + std::to_string(call.count) + " of " +
                                        to_string(call.type) + " overflows the byte size"};
  }
  if (call.count > 0 && (call.send == nullptr || call.recv == nullptr)) {
    return {Code::kInvalidArgument, std::string(call.send == nullptr ? "send" : "recv") +
                                        " buffer is null with count " + std::to_string(call.count)};
  }
  auto misaligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % esize != 0; };
  if (call.count > 0 && (misaligned(call.send) || misaligned(call.recv))) {
    return {Code::kInvalidArgument, "buffer is not aligned to its element size (" +
                                        std::to_string(esize) + " bytes)"};
  }
  return Status::Ok();
}

Status ring_allreduce(const RingPeers& p, Channel& send, Channel& recv, const WaitContext& wait,
                      const CollectiveCall& call) {
  const int n = p.world_size;
  const size_t esize = element_size(call.type);
  const auto* in = static_cast<const float*>(call.send);
  auto* out = static_cast<float*>(call.recv);
  if (call.count == 0) return Status::Ok();
  if (n == 1) {
    if (in != out) std::memmove(out, in, call.count * esize);
    return Status::Ok();
  }
  const uint32_t sig = collective_signature(call);
  const size_t slot_elems = send.slot_bytes() / esize;
  const int pos = p.position;
  uint64_t step = 0;  // counts every slot this rank sends (and receives) in this collective

  auto chunk = [&](size_t base, size_t per_chunk, int c) -> Piece {
    int idx = ((c % n) + n) % n;
    size_t b = std::min(call.count, base + per_chunk * idx);
    size_t e = std::min(call.count, b + per_chunk);
    return {b, e - b};
  };
  auto receive = [&](Piece piece, uint64_t s) -> Result<const float*> {
    SlotMeta meta{};
    auto slot = recv.acquire_recv(wait, &meta);
    if (!slot.ok()) return peer_error(p, call, slot.status(), false, s);
    if (meta.seq != call.seq || meta.signature != sig || meta.count != call.count ||
        meta.step != s || meta.bytes != piece.len * esize) {
      return Status(Code::kMismatch,
                    "job=" + p.job + " rank " + std::to_string(p.rank) + " expected step " +
                        std::to_string(s) + " of " + describe(call) + " from rank " +
                        std::to_string(p.prev_rank) + " (host " + p.prev_host + ") but got step " +
                        std::to_string(meta.step) + " of collective #" + std::to_string(meta.seq) +
                        " (count=" + std::to_string(meta.count) +
                        "): ranks called different collectives");
    }
    return reinterpret_cast<const float*>(*slot);
  };
  auto acquire = [&](uint64_t s) -> Result<float*> {
    auto slot = send.acquire_send(wait);
    if (!slot.ok()) return peer_error(p, call, slot.status(), true, s);
    return reinterpret_cast<float*>(*slot);
  };
  auto publish = [&](Piece piece, uint64_t s) {
    send.publish(SlotMeta{uint32_t(piece.len * esize), call.seq, call.count, sig, uint32_t(s)});
  };

  for (size_t base = 0; base < call.count;) {
    size_t remaining = call.count - base;
    size_t per_chunk = std::min(slot_elems, (remaining + n - 1) / n);
    // Step 0: send my own chunk.
    {
      Piece mine = chunk(base, per_chunk, pos);
      auto dst = acquire(step);
      if (!dst.ok()) return dst.status();
      std::memcpy(*dst, in + mine.begin, mine.len * esize);
      publish(mine, step);
      ++step;
    }
    // Steps 1 .. 2n-2: receive, combine, pass on.
    for (int s = 1; s <= 2 * n - 2; ++s) {
      Piece piece = chunk(base, per_chunk, pos - s);
      auto src = receive(piece, step - 1);
      if (!src.ok()) return src.status();
      const bool last = s == 2 * n - 2;
      float* dst = nullptr;
      if (!last) {
        auto slot = acquire(step);
        if (!slot.ok()) return slot.status();
        dst = *slot;
      }
      const float* a = in + piece.begin;
      float* o = out + piece.begin;
      if (s < n - 1) {
        kernels::sum_f32(dst, a, *src, piece.len);           // partial sum, onward only
      } else if (s == n - 1) {
        kernels::sum2_f32(o, dst, a, *src, piece.len);       // final sum: keep and pass on
      } else {
        std::memcpy(o, *src, piece.len * esize);             // all-gather: keep ...
        if (dst) std::memcpy(dst, *src, piece.len * esize);  // ... and pass on
      }
      recv.release();
      if (!last) {
        publish(piece, step);
        ++step;
      }
    }
    base += per_chunk * n;
  }
  return Status::Ok();
}

}  // namespace gradsync
