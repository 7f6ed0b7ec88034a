#include <algorithm>
#include "bench/collective.h"

#include <chrono>

#include "bench/data.h"

namespace bench {

using gradsync::Status;

Geometry geometry(Collective c, size_t bytes, size_t esize, int n) {
  const double ring = double(n - 1) / n;
  switch (c) {
    case Collective::kAllreduce: {
      size_t count = bytes / esize;
      return {count * esize, count, count, count, 2 * ring};
    }
    case Collective::kReduceScatter: {  // count = elements each rank receives
      size_t count = bytes / esize / n;
      return {count * n * esize, count, count * n, count, ring};
    }
    case Collective::kAllGather: {  // count = elements each rank sends
      size_t count = bytes / esize / n;
      return {count * n * esize, count, count, count * n, ring};
    }
    case Collective::kBroadcast: {
      size_t count = bytes / esize;
      return {count * esize, count, count, count, 1};
    }
    case Collective::kBarrier:
      break;
  }
  return {0, 0, 0, 0, 0};
}

size_t esize_of(gradsync::DataType t) {
  static constexpr size_t kSizes[] = {4, 8, 2, 2, 1, 1, 4, 8};  // DataType order
  return kSizes[static_cast<int>(t)];
}

Buffers::Buffers(const Geometry& g, size_t esize)
    : send((g.send_elems * esize + 7) / 8), recv((g.recv_elems * esize + 7) / 8) {}

namespace {

struct Layout {
  void* send;
  void* recv;
};

// Where the call's send and recv point; in-place like nccl-tests: reduce_scatter's recv is
// the rank's block of send, all_gather's send is the rank's block of recv.
Layout layout(const Case& c, bool in_place, int rank, size_t esize, Buffers& b) {
  auto* s = reinterpret_cast<std::byte*>(b.send.data());
  auto* r = reinterpret_cast<std::byte*>(b.recv.data());
  if (!in_place) return {s, r};
  switch (c.collective) {
    case Collective::kReduceScatter:
      return {s, s + rank * c.g.count * esize};
    case Collective::kAllGather:
      return {r + rank * c.g.count * esize, r};
    default:
      return {r, r};
  }
}

Status call(gradsync::Communicator& comm, const Case& c, const Layout& l) {
  switch (c.collective) {
    case Collective::kAllreduce:
      return comm.allreduce(l.send, l.recv, c.g.count, c.type, c.op, c.call_options);
    case Collective::kReduceScatter:
      return comm.reduce_scatter(l.send, l.recv, c.g.count, c.type, c.op, c.call_options);
    case Collective::kAllGather:
      return comm.all_gather(l.send, l.recv, c.g.count, c.type, c.call_options);
    case Collective::kBroadcast:
      return comm.broadcast(l.recv, c.g.count, c.type, c.root, c.call_options);
    case Collective::kBarrier:
      return comm.barrier();
  }
  return {gradsync::Code::kInvalidArgument, "unknown collective"};
}

// Fills inputs (and poisons outputs), runs one call, counts wrong elements on this rank.
Outcome checked_call(gradsync::Communicator& comm, const Case& c, bool in_place, Buffers& b) {
  const int rank = comm.rank(), n = comm.world_size();
  const size_t es = esize_of(c.type), count = c.g.count;
  const DataSpec d{c.type, c.op, c.seed, n};
  Layout l = layout(c, in_place, rank, es, b);
  auto* recv = static_cast<std::byte*>(l.recv);
  fill_constant(c.type, 0, c.g.recv_elems, b.recv.data());
  switch (c.collective) {
    case Collective::kAllreduce:
    case Collective::kReduceScatter:
      fill_input(d, rank, 0, c.g.send_elems, l.send);
      break;
    case Collective::kAllGather:
      fill_input(d, rank, 0, count, l.send);
      break;
    case Collective::kBroadcast:
      if (rank == c.root) fill_input(d, rank, 0, count, l.recv);
      break;
    case Collective::kBarrier:
      break;
  }
  Outcome out;
  out.status = call(comm, c, l);
  if (!out.status.ok()) return out;
  switch (c.collective) {
    case Collective::kAllreduce:
      out.wrong = count_wrong_reduced(d, 0, count, recv);
      break;
    case Collective::kReduceScatter:
      out.wrong = count_wrong_reduced(d, rank * count, count, recv);
      break;
    case Collective::kAllGather:
      for (int r = 0; r < n; ++r)
        out.wrong += count_wrong_copy(d, r, 0, count, recv + r * count * es);
      break;
    case Collective::kBroadcast:
      out.wrong = count_wrong_copy(d, c.root, 0, count, recv);
      break;
    case Collective::kBarrier:
      break;
  }
  // Out of place, the input must come back untouched.
  if (!in_place && c.collective != Collective::kBroadcast) {
    out.wrong += count_wrong_copy(d, rank, 0, c.g.send_elems, l.send);
  }
  return out;
}

}  // namespace

Outcome run_group(gradsync::Communicator& comm, const Case& c, bool in_place, bool check,
                  int warmup, int iters, Buffers& b, bool median) {
  const size_t es = esize_of(c.type);
  Outcome out;
  if (check && c.collective != Collective::kBarrier) {
    out = checked_call(comm, c, in_place, b);
    if (!out.status.ok()) return out;
  }
  // Timed data: out of place the inputs stay as they are (random if checked). In place the
  // result feeds the next iteration, so use a fixed point of the op (0 for sum, 1 otherwise):
  // growing sums and shrinking products would end in inf or slow denormals on a CPU.
  if (in_place) {
    fill_constant(c.type, c.op == gradsync::ReduceOp::kSum ? 0 : 1, c.g.send_elems, b.send.data());
    fill_constant(c.type, c.op == gradsync::ReduceOp::kSum ? 0 : 1, c.g.recv_elems, b.recv.data());
  } else if (!check) {
    fill_input({c.type, c.op, c.seed, comm.world_size()}, comm.rank(), 0, c.g.send_elems,
               b.send.data());
  }
  Layout l = layout(c, in_place, comm.rank(), es, b);
  for (int i = 0; i < warmup; ++i) {
    if (out.status = call(comm, c, l); !out.status.ok()) return out;
  }
  if (median) {
    // The CPU anchors' method (../shared/anchors/cpu): every call after a barrier, timed on
    // its own; the median call.
    std::vector<double> us(size_t(std::max(iters, 1)));
    for (double& t : us) {
      if (out.status = sync(comm); !out.status.ok()) return out;
      auto t0 = std::chrono::steady_clock::now();
      if (out.status = call(comm, c, l); !out.status.ok()) return out;
      t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    std::sort(us.begin(), us.end());
    out.time_us = us[us.size() / 2];
    return out;
  }
  // Start together, so that the slowest rank's mean is the collective's time.
  if (out.status = sync(comm); !out.status.ok()) return out;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    if (out.status = call(comm, c, l); !out.status.ok()) return out;
  }
  out.time_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
      iters;
  return out;
}

Status sync(gradsync::Communicator& comm) {
  float one = 1;
  return comm.allreduce(&one, &one, 1, gradsync::DataType::kFloat32, gradsync::ReduceOp::kSum);
}

gradsync::Result<std::vector<double>> gather(gradsync::Communicator& comm,
                                             const std::vector<double>& mine) {
  const size_t k = mine.size();
  std::vector<float> all(k * comm.world_size(), 0.0f);
  for (size_t i = 0; i < k; ++i) all[comm.rank() * k + i] = static_cast<float>(mine[i]);
  Status s = comm.allreduce(all.data(), all.data(), all.size(), gradsync::DataType::kFloat32,
                            gradsync::ReduceOp::kSum);
  if (!s.ok()) return s;
  return std::vector<double>(all.begin(), all.end());
}

}  // namespace bench
