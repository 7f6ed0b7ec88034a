// A GPU trainer process for the gpu tests: joins with the launcher's environment and a device
// (GRADSYNC_DEVICE, else LOCAL_RANK modulo the visible GPUs), then
//   matrix COUNTS   every type x op x count x {in-place, out-of-place} of the stream
//                   allreduce on device buffers against a host fold of the same inputs
//                   (exact: small integers, so every order gives the same bytes); first the
//                   refusals (host buffer, null, unknown type); prints "path P" and "PASS"
//   collectives COUNTS
//                   the stream reduce_scatter (every type x op, in and out of place, against
//                   the host loops' rank-order fold, exact), all_gather (every type, in and
//                   out of place) and broadcast (every type, every root) on device buffers,
//                   with arbitrary bit patterns for the copies (NaNs included: bits must move
//                   unchanged), an allreduce before and after each type's calls (calls of
//                   different collectives interleave), out-of-place inputs checked untouched;
//                   first the refusals; prints "path P" and "PASS"
//   graph COUNT [all]
//                   captures one allreduce (all: allreduce, reduce_scatter, all_gather and a
//                   broadcast from the last rank) in a CUDA graph and replays it 4 times with
//                   new inputs, checking each result (all: with uncaptured allreduces
//                   between the replays, checked too); prints "PASS"
//   absent          rank 1 joins but never calls; rank 0's allreduce must fail by its
//                   deadline: prints "async_error: STATUS" and "PASS" when it did; rank 1's
//                   barrier afterwards must fail with rank 0's reason (the job aborted),
//                   while rank 0 makes no call (its timeout is told when it happens)
//   timeline COUNT  (GRADSYNC_GPU_TIMELINE=1, cuda-ipc) two float32 sum allreduces of COUNT
//                   elements (chunked protocol), checked; each one's in-kernel timeline
//                   (gpu/timeline.h) must be well-formed: the expected blocks and chunks per
//                   block, nothing dropped, every stamp there and non-decreasing in each
//                   block's program order; the second call's must come after the first's
//                   (stamps and sequence numbers); a low-latency call must record nothing.
//                   Prints the figures (and the peers' overlap) without judging them; "PASS"
// Exit code 0 on success, 1 on any failure; stderr says which collective, type, op, count,
// rank, the first differing element with expected and received bits, and how many differ.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpu/timeline.h"
#include "gradsync/gradsync.h"
#include "kernels/half.h"
#include "kernels/host_reduce.h"
#include "gpu_worker_data.h"

namespace {

using namespace gpu_worker;

#define CUDA_OK(expr)                                                                      \
  do {                                                                                     \
    if (cudaError_t e_ = (expr); e_ != cudaSuccess) {                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

int matrix(gradsync::Communicator& comm, const std::vector<size_t>& counts) {
  const int r = comm.rank(), n = comm.world_size();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  size_t max_count = 1;
  for (size_t c : counts) max_count = std::max(max_count, c);
  void *d_in = nullptr, *d_out = nullptr;
  CUDA_OK(cudaMalloc(&d_in, max_count * 8 + 16));
  CUDA_OK(cudaMalloc(&d_out, max_count * 8 + 16));

  // Refusals: nothing is queued, the communicator stays healthy.
  std::vector<float> host(16, 1.0f);
  int bad = 0;
  bad |= expect_refused("host buffer", comm.allreduce(host.data(), host.data(), 16, DataType::kFloat32, ReduceOp::kSum, stream));
  bad |= expect_refused("null buffer", comm.allreduce(nullptr, d_out, 16, DataType::kFloat32, ReduceOp::kSum, stream));
  bad |= expect_refused("unknown type", comm.allreduce(d_in, d_out, 16, DataType(42), ReduceOp::kSum, stream));
  bad |= expect_refused("unknown op", comm.allreduce(d_in, d_out, 16, DataType::kFloat32, ReduceOp(42), stream));
  bad |= expect_refused("misaligned", comm.allreduce(static_cast<char*>(d_in) + 1, d_out, 16, DataType::kFloat32, ReduceOp::kSum, stream));
  if (bad) return 1;

  std::printf("path %s device %d\n", comm.gpu_path().c_str(), comm.device());
  size_t checked = 0;
  for (DataType t : kTypes) {
    const size_t es = gradsync::element_size(t);
    for (ReduceOp op : kOps) {
      for (size_t count : counts) {
        const std::vector<uint8_t> want = expected(t, op, n, count);
        std::vector<uint8_t> in(count * es + 16), got(count * es + 16);
        fill(t, op, r, count, &in);
        for (bool inplace : {false, true}) {
          void* out = inplace ? d_in : d_out;
          CUDA_OK(cudaMemcpyAsync(d_in, in.data(), count * es, cudaMemcpyHostToDevice, stream));
          CUDA_OK(cudaMemsetAsync(d_out, 0xA5, count * es, stream));
          gradsync::Status s = comm.allreduce(d_in, out, count, t, op, stream);
          if (!s.ok()) {
            std::fprintf(stderr, "allreduce %s %s count=%zu inplace=%d: %s\n", gradsync::to_string(t),
                         gradsync::to_string(op), count, inplace, s.to_string().c_str());
            return 1;
          }
          CUDA_OK(cudaMemcpyAsync(got.data(), out, count * es, cudaMemcpyDeviceToHost, stream));
          CUDA_OK(cudaStreamSynchronize(stream));
          if (gradsync::Status e = comm.async_error(); !e.ok()) {
            std::fprintf(stderr, "async error: %s\n", e.to_string().c_str());
            return 1;
          }
          const std::string what =
              label(comm, "allreduce", t, std::string("op=") + gradsync::to_string(op), count,
                    inplace ? "in-place" : "out-of-place");
          if (compare(what, "recv", t, got.data(), want.data(), count)) return 1;
          ++checked;
        }
      }
    }
  }
  std::printf("checked %zu calls\nPASS\n", checked);
  CUDA_OK(cudaFree(d_in));
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaStreamDestroy(stream));
  return 0;
}

int graph(gradsync::Communicator& comm, size_t count) {
  const int r = comm.rank(), n = comm.world_size();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float *d_in = nullptr, *d_out = nullptr;
  CUDA_OK(cudaMalloc(&d_in, count * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_out, count * sizeof(float)));
  cudaGraph_t g;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  gradsync::Status s = comm.allreduce(d_in, d_out, count, DataType::kFloat32, ReduceOp::kSum, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &g));
  if (!s.ok()) {
    std::fprintf(stderr, "allreduce under capture: %s\n", s.to_string().c_str());
    return 1;
  }
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  std::vector<float> in(count), got(count);
  for (int replay = 0; replay < 4; ++replay) {
    for (size_t i = 0; i < count; ++i) in[i] = float((r + 1) * (replay + 1) + int(i % 5));
    CUDA_OK(cudaMemcpyAsync(d_in, in.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaMemcpyAsync(got.data(), d_out, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    if (gradsync::Status e = comm.async_error(); !e.ok()) {
      std::fprintf(stderr, "async error: %s\n", e.to_string().c_str());
      return 1;
    }
    for (size_t i = 0; i < count; ++i) {
      const float want = float((replay + 1) * n * (n + 1) / 2 + n * int(i % 5));
      if (got[i] != want) {
        std::fprintf(stderr, "replay %d element %zu: %g, expected %g\n", replay, i, got[i], want);
        return 1;
      }
    }
    std::printf("replay %d ok\n", replay);
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(g));
  std::printf("PASS\n");
  return 0;
}

// Queued call `s` of `what`, then `bytes` of device buffer `d` copied to *got once the stream
// ran; 1 (printed) when the call was refused, the stream failed or an asynchronous error came.
int finish(gradsync::Communicator& comm, cudaStream_t stream, const std::string& what,
           const gradsync::Status& s, const void* d, size_t bytes, std::vector<uint8_t>* got) {
  if (!s.ok()) {
    std::fprintf(stderr, "FAIL %s: the call returned %s\n", what.c_str(), s.to_string().c_str());
    return 1;
  }
  got->resize(bytes + 16);
  CUDA_OK(cudaMemcpyAsync(got->data(), d, bytes, cudaMemcpyDeviceToHost, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  if (gradsync::Status e = comm.async_error(); !e.ok()) {
    std::fprintf(stderr, "FAIL %s: asynchronous error %s\n", what.c_str(), e.to_string().c_str());
    return 1;
  }
  return 0;
}

// The device buffers and stream of one worker.
struct Bench {
  gradsync::Communicator& comm;
  cudaStream_t stream;
  uint8_t* a;  // send side
  uint8_t* b;  // recv side
  int r, n;
};

int upload(Bench& x, void* d, const std::vector<uint8_t>& h, size_t bytes) {
  CUDA_OK(cudaMemcpyAsync(d, h.data(), bytes, cudaMemcpyHostToDevice, x.stream));
  return 0;
}

// allreduce sum, out of place: a plain call between the others.
int check_allreduce(Bench& x, DataType t, size_t count) {
  const size_t es = gradsync::element_size(t);
  std::vector<uint8_t> in(count * es + 16), got;
  fill(t, ReduceOp::kSum, x.r, count, &in);
  const std::vector<uint8_t> want = expected(t, ReduceOp::kSum, x.n, count);
  const std::string what = label(x.comm, "allreduce", t, "op=sum", count, "out-of-place");
  if (upload(x, x.a, in, count * es)) return 1;
  CUDA_OK(cudaMemsetAsync(x.b, 0xA5, count * es, x.stream));
  gradsync::Status s = x.comm.allreduce(x.a, x.b, count, t, ReduceOp::kSum, x.stream);
  if (finish(x.comm, x.stream, what, s, x.b, count * es, &got)) return 1;
  return compare(what, "recv", t, got.data(), want.data(), count);
}

// reduce_scatter of every op, out of place and in place (recv = send + rank * count).
int check_reduce_scatter(Bench& x, DataType t, size_t count, size_t* calls) {
  const size_t es = gradsync::element_size(t), seg = count * es, total = size_t(x.n) * count;
  std::vector<uint8_t> in(total * es + 16), got, back;
  for (ReduceOp op : kOps) {
    fill(t, op, x.r, total, &in);
    // Every rank's full input folded in rank order; this rank's block of it.
    const std::vector<uint8_t> full = expected(t, op, x.n, total);
    const uint8_t* want = full.data() + size_t(x.r) * seg;
    for (bool inplace : {false, true}) {
      const std::string what =
          label(x.comm, "reduce_scatter", t, std::string("op=") + gradsync::to_string(op), count,
                inplace ? "in-place" : "out-of-place");
      uint8_t* recv = inplace ? x.a + size_t(x.r) * seg : x.b;
      if (upload(x, x.a, in, total * es)) return 1;
      if (!inplace) CUDA_OK(cudaMemsetAsync(x.b, 0xA5, seg, x.stream));
      gradsync::Status s = x.comm.reduce_scatter(x.a, recv, count, t, op, x.stream);
      if (finish(x.comm, x.stream, what, s, recv, seg, &got)) return 1;
      if (compare(what, "recv", t, got.data(), want, count)) return 1;
      if (!inplace) {  // the input comes back untouched
        if (finish(x.comm, x.stream, what, gradsync::Status::Ok(), x.a, total * es, &back))
          return 1;
        if (compare(what, "send (must be unchanged)", t, back.data(), in.data(), total)) return 1;
      }
      ++*calls;
    }
  }
  return 0;
}

// all_gather, out of place and in place (send = recv + rank * count).
int check_all_gather(Bench& x, DataType t, size_t count, size_t* calls) {
  const size_t es = gradsync::element_size(t), seg = count * es, total = size_t(x.n) * count;
  std::vector<uint8_t> in(seg + 16), want(total * es + 16), got, back;
  for (int q = 0; q < x.n; ++q) fill_bits(t, q, count, want.data() + size_t(q) * seg);
  fill_bits(t, x.r, count, in.data());
  for (bool inplace : {false, true}) {
    const std::string what =
        label(x.comm, "all_gather", t, "", count, inplace ? "in-place" : "out-of-place");
    uint8_t* send = inplace ? x.b + size_t(x.r) * seg : x.a;
    CUDA_OK(cudaMemsetAsync(x.b, 0xA5, total * es, x.stream));
    if (upload(x, send, in, seg)) return 1;
    gradsync::Status s = x.comm.all_gather(send, x.b, count, t, x.stream);
    if (finish(x.comm, x.stream, what, s, x.b, total * es, &got)) return 1;
    if (compare(what, "recv", t, got.data(), want.data(), total)) return 1;
    if (!inplace) {
      if (finish(x.comm, x.stream, what, gradsync::Status::Ok(), x.a, seg, &back)) return 1;
      if (compare(what, "send (must be unchanged)", t, back.data(), in.data(), count)) return 1;
    }
    ++*calls;
  }
  return 0;
}

// broadcast from every root.
int check_broadcast(Bench& x, DataType t, size_t count, size_t* calls) {
  const size_t es = gradsync::element_size(t), bytes = count * es;
  std::vector<uint8_t> data(bytes + 16), got;
  for (int root = 0; root < x.n; ++root) {
    const std::string what =
        label(x.comm, "broadcast", t, "root=" + std::to_string(root), count, "");
    fill_bits(t, root, count, data.data());
    if (x.r == root) {
      if (upload(x, x.a, data, bytes)) return 1;
    } else {
      CUDA_OK(cudaMemsetAsync(x.a, 0xA5, bytes, x.stream));
    }
    gradsync::Status s = x.comm.broadcast(x.a, count, t, root, x.stream);
    if (finish(x.comm, x.stream, what, s, x.a, bytes, &got)) return 1;
    if (compare(what, "buffer", t, got.data(), data.data(), count)) return 1;
    ++*calls;
  }
  return 0;
}

int collectives(gradsync::Communicator& comm, const std::vector<size_t>& counts) {
  const int r = comm.rank(), n = comm.world_size();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  size_t max_count = 16;
  for (size_t c : counts) max_count = std::max(max_count, c);
  void *d_a = nullptr, *d_b = nullptr;
  CUDA_OK(cudaMalloc(&d_a, size_t(n) * max_count * 8 + 16));
  CUDA_OK(cudaMalloc(&d_b, size_t(n) * max_count * 8 + 16));
  Bench x{comm, stream, static_cast<uint8_t*>(d_a), static_cast<uint8_t*>(d_b), r, n};

  // Refusals: nothing is queued, the communicator stays healthy (the calls below run on it).
  std::vector<float> host(16 * size_t(n), 1.0f);
  const auto f32 = DataType::kFloat32;
  const auto sum = ReduceOp::kSum;
  const size_t huge = std::numeric_limits<size_t>::max() / 2;
  int bad = 0;
  bad |= expect_refused("reduce_scatter host buffer",
                        comm.reduce_scatter(host.data(), x.b, 16, f32, sum, stream));
  bad |= expect_refused("reduce_scatter null recv",
                        comm.reduce_scatter(x.a, nullptr, 16, f32, sum, stream));
  bad |= expect_refused("reduce_scatter unknown op",
                        comm.reduce_scatter(x.a, x.b, 16, f32, ReduceOp(42), stream));
  bad |= expect_refused("reduce_scatter misaligned",
                        comm.reduce_scatter(x.a + 2, x.b, 16, f32, sum, stream));
  bad |= expect_refused("reduce_scatter overlap",
                        comm.reduce_scatter(x.a, x.a + 4, 16, f32, sum, stream));
  bad |= expect_refused("reduce_scatter count overflow",
                        comm.reduce_scatter(x.a, x.b, huge, f32, sum, stream));
  bad |=
      expect_refused("all_gather host buffer", comm.all_gather(x.a, host.data(), 16, f32, stream));
  bad |= expect_refused("all_gather null send", comm.all_gather(nullptr, x.b, 16, f32, stream));
  bad |= expect_refused("all_gather unknown type",
                        comm.all_gather(x.a, x.b, 16, DataType(42), stream));
  bad |= expect_refused("all_gather overlap", comm.all_gather(x.b + 4, x.b, 16, f32, stream));
  bad |= expect_refused("all_gather count overflow", comm.all_gather(x.a, x.b, huge, f32, stream));
  bad |= expect_refused("broadcast root out of range", comm.broadcast(x.a, 16, f32, n, stream));
  bad |= expect_refused("broadcast negative root", comm.broadcast(x.a, 16, f32, -1, stream));
  bad |= expect_refused("broadcast null buffer", comm.broadcast(nullptr, 16, f32, 0, stream));
  bad |= expect_refused("broadcast host buffer", comm.broadcast(host.data(), 16, f32, 0, stream));
  bad |= expect_refused("broadcast count overflow",
                        comm.broadcast(x.a, huge, DataType::kFloat64, 0, stream));
  if (bad) return 1;

  std::printf("path %s device %d\n", comm.gpu_path().c_str(), comm.device());
  size_t calls = 0;
  for (size_t count : counts) {
    for (DataType t : kTypes) {
      if (check_allreduce(x, t, count) || check_reduce_scatter(x, t, count, &calls) ||
          check_all_gather(x, t, count, &calls) || check_broadcast(x, t, count, &calls) ||
          check_allreduce(x, t, count)) {
        return 1;
      }
      calls += 2;
    }
    std::printf("count %zu ok\n", count);
    std::fflush(stdout);
  }
  std::printf("checked %zu calls\nPASS\n", calls);
  CUDA_OK(cudaFree(d_a));
  CUDA_OK(cudaFree(d_b));
  CUDA_OK(cudaStreamDestroy(stream));
  return 0;
}

// graph COUNT all: allreduce, reduce_scatter, all_gather and a broadcast from the last rank,
// captured in one graph and replayed with new inputs (float32, exact small integers).
int graph_all(gradsync::Communicator& comm, size_t count) {
  const int r = comm.rank(), n = comm.world_size(), root = n - 1;
  const size_t total = size_t(n) * count;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float *ar_in, *ar_out, *rs_in, *rs_out, *ag_in, *ag_out, *bc;
  for (float** p : {&ar_in, &ar_out, &rs_out, &ag_in, &bc})
    CUDA_OK(cudaMalloc(p, count * sizeof(float)));
  for (float** p : {&rs_in, &ag_out}) CUDA_OK(cudaMalloc(p, total * sizeof(float)));
  cudaGraph_t g;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const gradsync::Status s[] = {
      comm.allreduce(ar_in, ar_out, count, DataType::kFloat32, ReduceOp::kSum, stream),
      comm.reduce_scatter(rs_in, rs_out, count, DataType::kFloat32, ReduceOp::kSum, stream),
      comm.all_gather(ag_in, ag_out, count, DataType::kFloat32, stream),
      comm.broadcast(bc, count, DataType::kFloat32, root, stream),
  };
  CUDA_OK(cudaStreamEndCapture(stream, &g));
  for (const gradsync::Status& e : s) {
    if (!e.ok()) {
      std::fprintf(stderr, "FAIL a call under capture: %s\n", e.to_string().c_str());
      return 1;
    }
  }
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  std::vector<float> ar(count), rs(total), ag(count), b(count);
  std::vector<uint8_t> got_ar, got_rs, got_ag, got_bc;
  for (int replay = 0; replay < 4; ++replay) {
    const int f = replay + 1;
    for (size_t i = 0; i < count; ++i) {
      ar[i] = float((r + 1) * f + int(i % 5));
      ag[i] = float(r * 1000 + replay * 100 + int(i % 13));
      b[i] = r == root ? float(f * 10 + int(i % 11)) : -1.0f;
    }
    for (size_t j = 0; j < total; ++j) rs[j] = float((r + 1) * f + int(j % 7));
    CUDA_OK(
        cudaMemcpyAsync(ar_in, ar.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_OK(
        cudaMemcpyAsync(rs_in, rs.data(), total * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_OK(
        cudaMemcpyAsync(ag_in, ag.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(bc, b.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    const std::string what =
        "graph replay " + std::to_string(replay) + ", rank " + std::to_string(r);
    if (finish(comm, stream, what, gradsync::Status::Ok(), ar_out, count * 4, &got_ar) ||
        finish(comm, stream, what, gradsync::Status::Ok(), rs_out, count * 4, &got_rs) ||
        finish(comm, stream, what, gradsync::Status::Ok(), ag_out, total * 4, &got_ag) ||
        finish(comm, stream, what, gradsync::Status::Ok(), bc, count * 4, &got_bc)) {
      return 1;
    }
    std::vector<float> w_ar(count), w_rs(count), w_ag(total), w_bc(count);
    const int tri = n * (n + 1) / 2;
    for (size_t i = 0; i < count; ++i) {
      w_ar[i] = float(f * tri + n * int(i % 5));
      w_rs[i] = float(f * tri + n * int((size_t(r) * count + i) % 7));
      w_bc[i] = float(f * 10 + int(i % 11));
    }
    for (int q = 0; q < n; ++q) {
      for (size_t i = 0; i < count; ++i)
        w_ag[size_t(q) * count + i] = float(q * 1000 + replay * 100 + int(i % 13));
    }
    auto bytes = [](const std::vector<float>& v) {
      return reinterpret_cast<const uint8_t*>(v.data());
    };
    const auto f32 = DataType::kFloat32;
    if (compare("allreduce sum in a " + what, "recv", f32, got_ar.data(), bytes(w_ar), count) ||
        compare("reduce_scatter sum in a " + what, "recv", f32, got_rs.data(), bytes(w_rs),
                count) ||
        compare("all_gather in a " + what, "recv", f32, got_ag.data(), bytes(w_ag), total) ||
        compare("broadcast root=" + std::to_string(root) + " in a " + what, "buffer", f32,
                got_bc.data(), bytes(w_bc), count)) {
      return 1;
    }
    // A call outside the graph between replays (of another length, so that the channels'
    // message counts move on by other amounts than a replay's), then the graph's allreduce
    // once more outside it: both exact.
    const size_t odd = count / 3 + 1;
    if (finish(comm, stream, "an uncaptured allreduce after " + what,
               comm.allreduce(ar_in, ar_out, odd, DataType::kFloat32, ReduceOp::kSum, stream),
               ar_out, odd * 4, &got_ar) ||
        compare("uncaptured allreduce after " + what, "recv", f32, got_ar.data(), bytes(w_ar), odd) ||
        finish(comm, stream, "an uncaptured allreduce after " + what,
               comm.allreduce(ar_in, ar_out, count, DataType::kFloat32, ReduceOp::kSum, stream),
               ar_out, count * 4, &got_ar) ||
        compare("uncaptured allreduce after " + what, "recv", f32, got_ar.data(), bytes(w_ar), count)) {
      return 1;
    }
    std::printf("replay %d ok\n", replay);
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(g));
  for (float* p : {ar_in, ar_out, rs_in, rs_out, ag_in, ag_out, bc}) CUDA_OK(cudaFree(p));
  std::printf("PASS\n");
  return 0;
}

int absent(gradsync::Communicator& comm) {
  if (comm.rank() != 0) {
    // Joined, alive, never calls: rank 0 must give up by its own deadline, and its failure
    // fails the job, so that this rank's next call names it instead of waiting.
    std::this_thread::sleep_for(std::chrono::seconds(6));
    gradsync::Status b = comm.barrier();
    std::printf("rank 1 barrier: %s\n", b.to_string().c_str());
    if (b.ok() || b.message().find("did not finish") == std::string::npos) return 1;
    std::printf("PASS\n");
    return 0;
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float* d = nullptr;
  CUDA_OK(cudaMalloc(&d, 1 << 20));
  const auto t0 = std::chrono::steady_clock::now();
  gradsync::Status s = comm.allreduce(d, d, 1 << 18, DataType::kFloat32, ReduceOp::kSum, stream);
  if (!s.ok()) {
    std::fprintf(stderr, "allreduce refused: %s\n", s.to_string().c_str());
    return 1;
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // No call until rank 1's barrier (at 6 s) has failed: the job must be aborted by this
  // rank's timeout alone, not by its next call.
  std::this_thread::sleep_until(t0 + std::chrono::seconds(10));
  gradsync::Status e = comm.async_error();
  std::printf("async_error after %.0f ms: %s\n", ms, e.to_string().c_str());
  gradsync::Status next = comm.allreduce(d, d, 16, DataType::kFloat32, ReduceOp::kSum, stream);
  std::printf("next call: %s\n", next.to_string().c_str());
  if (e.ok() || next.ok()) return 1;
  std::printf("PASS\n");
  return 0;
}

int timeline(gradsync::Communicator& comm, size_t count) {
  namespace gt = gradsync::gpu;
  const int r = comm.rank(), n = comm.world_size();
  if (comm.gpu_path() != "cuda-ipc") {
    std::fprintf(stderr, "FAIL timeline: path %s, not cuda-ipc\n", comm.gpu_path().c_str());
    return 1;
  }
  if (auto none = gt::last_timeline(comm); none.ok()) {
    std::fprintf(stderr, "FAIL timeline: a timeline before any call\n");
    return 1;
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float *d_in = nullptr, *d_out = nullptr;
  CUDA_OK(cudaMalloc(&d_in, count * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_out, count * sizeof(float)));
  std::vector<float> in(count), got(count);
  std::vector<gt::Timeline> runs;
  for (int call = 0; call < 2; ++call) {
    for (size_t i = 0; i < count; ++i) in[i] = float((r + 1) * (call + 1) + int(i % 7));
    CUDA_OK(cudaMemcpyAsync(d_in, in.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream));
    gradsync::Status s = comm.allreduce(d_in, d_out, count, DataType::kFloat32, ReduceOp::kSum, stream);
    if (!s.ok()) {
      std::fprintf(stderr, "FAIL timeline: allreduce: %s\n", s.to_string().c_str());
      return 1;
    }
    // Before anything else waits for the stream: last_timeline synchronises by itself.
    auto tl = gt::last_timeline(comm);
    if (!tl.ok()) {
      std::fprintf(stderr, "FAIL timeline: call %d: %s\n", call, tl.status().to_string().c_str());
      return 1;
    }
    CUDA_OK(cudaMemcpyAsync(got.data(), d_out, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    if (gradsync::Status e = comm.async_error(); !e.ok()) {
      std::fprintf(stderr, "FAIL timeline: async error %s\n", e.to_string().c_str());
      return 1;
    }
    for (size_t i = 0; i < count; ++i) {
      const float want = float((call + 1) * n * (n + 1) / 2 + n * int(i % 7));
      if (got[i] != want) {
        std::fprintf(stderr, "FAIL timeline: call %d element %zu: %g, expected %g\n", call, i,
                     got[i], want);
        return 1;
      }
    }
    const gt::Timeline& t = *tl;
    const auto& m = t.summary;
    std::printf(
        "timeline call %d: %s %llu B, chunk %llu B, %llu chunks on %u blocks (%u a block at most), "
        "%llu recorded, %llu dropped; wall %.1f us, push(U) %.1f us, fold(U) %.1f us, both %.1f "
        "us, hidden %.3f (fold side %.3f), same-block %.3f us, block push %.1f fold %.1f credit "
        "wait %.1f ready wait %.1f us, tick %llu ns\n",
        call, t.collective.c_str(), static_cast<unsigned long long>(t.bytes),
        static_cast<unsigned long long>(t.chunk_bytes), static_cast<unsigned long long>(t.nchunks),
        t.blocks_used, m.max_chunks_per_block, static_cast<unsigned long long>(m.recorded_chunks),
        static_cast<unsigned long long>(m.dropped_chunks), m.wall_us, m.push_us, m.fold_us,
        m.overlap_us, m.hidden, m.fold_hidden, m.same_block_overlap_us, m.block_push_us, m.block_fold_us,
        m.block_credit_wait_us, m.block_ready_wait_us,
        static_cast<unsigned long long>(m.granularity_ns));
    if (std::string why = gt::check_well_formed(t); !why.empty()) {
      std::fprintf(stderr, "FAIL timeline: call %d is malformed: %s\n", call, why.c_str());
      return 1;
    }
    if (t.collective != "allreduce" || t.bytes != count * sizeof(float) || t.world != n ||
        t.rank != r || m.dropped_chunks != 0 || m.recorded_chunks != t.nchunks) {
      std::fprintf(stderr, "FAIL timeline: call %d: not this call's record\n", call);
      return 1;
    }
    runs.push_back(std::move(tl).value());
  }
  // The second call's records: later stamps, and every block's sequence numbers advanced by
  // the chunks it had in the first.
  uint64_t first_end = 0, second_start = ~uint64_t(0);
  for (const auto& b : runs[0].block) first_end = std::max(first_end, b.end_ns);
  for (const auto& b : runs[1].block) second_start = std::min(second_start, b.start_ns);
  if (second_start < first_end) {
    std::fprintf(stderr, "FAIL timeline: the second call starts (%llu) before the first ends (%llu)\n",
                 static_cast<unsigned long long>(second_start),
                 static_cast<unsigned long long>(first_end));
    return 1;
  }
  for (size_t b = 0; b < runs[1].block.size(); ++b) {
    const auto &x = runs[0].block[b], &y = runs[1].block[b];
    if (y.first_seq != x.first_seq + x.chunks) {
      std::fprintf(stderr, "FAIL timeline: block %zu: sequence %llu, then %llu after %u chunks\n",
                   b, static_cast<unsigned long long>(x.first_seq),
                   static_cast<unsigned long long>(y.first_seq), x.chunks);
      return 1;
    }
  }
  // Every rank's last timeline on every rank: the peers' pushes against this rank's folds,
  // printed only (a figure, not a check).
  auto all = gt::all_timelines(comm, &runs[1]);
  if (!all.ok()) {
    std::fprintf(stderr, "FAIL timeline: exchange: %s\n", all.status().to_string().c_str());
    return 1;
  }
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    const auto o = gt::overlap_with_peer(runs[1], (*all)[size_t(p)]);
    std::printf("peer %d: %s: offset [%.0f, %.0f] ns from %d hand-offs, peer push(U) %.1f us, "
                "hidden under my folds [%.3f, %.3f]\n",
                p, o.ok ? "ok" : o.why.c_str(), o.offset_lo_ns, o.offset_hi_ns, o.constraints,
                o.peer_push_us, o.hidden_lo, o.hidden_hi);
  }
  // A low-latency call records nothing, and says so.
  gradsync::Status s = comm.allreduce(d_in, d_out, 16, DataType::kFloat32, ReduceOp::kSum, stream);
  if (!s.ok()) {
    std::fprintf(stderr, "FAIL timeline: small allreduce: %s\n", s.to_string().c_str());
    return 1;
  }
  auto ll = gt::last_timeline(comm);
  CUDA_OK(cudaStreamSynchronize(stream));
  if (ll.ok() || ll.status().code() != gradsync::Code::kFailedPrecondition ||
      ll.status().message().find("low-latency") == std::string::npos) {
    std::fprintf(stderr, "FAIL timeline: a low-latency call: %s\n",
                 ll.ok() ? "recorded a timeline" : ll.status().to_string().c_str());
    return 1;
  }
  std::printf("low-latency call: %s\n", ll.status().message().c_str());
  CUDA_OK(cudaFree(d_in));
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaStreamDestroy(stream));
  std::printf("PASS\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(
        stderr,
        "usage: gpu_worker matrix COUNTS | collectives COUNTS | graph COUNT [all] | absent | "
        "timeline COUNT\n");
    return 2;
  }
  const std::string mode = argv[1];
  auto opts = gradsync::JoinOptions::from_env();
  if (opts.device == gradsync::JoinOptions::kNoDevice) opts.device = gradsync::JoinOptions::kDeviceLocalRank;
  auto session = gradsync::Session::connect();
  if (!session.ok()) {
    std::fprintf(stderr, "connect: %s\n", session.status().to_string().c_str());
    return 1;
  }
  auto comm = session->join(opts);
  if (!comm.ok()) {
    std::fprintf(stderr, "join: %s\n", comm.status().to_string().c_str());
    return 1;
  }
  int rc = 2;
  if (mode == "matrix" && argc >= 3) rc = matrix(*comm, parse_counts(argv[2]));
  else if (mode == "collectives" && argc >= 3)
    rc = collectives(*comm, parse_counts(argv[2]));
  else if (mode == "graph" && argc >= 4 && std::string(argv[3]) == "all")
    rc = graph_all(*comm, std::stoull(argv[2]));
  else if (mode == "graph" && argc >= 3) rc = graph(*comm, std::stoull(argv[2]));
  else if (mode == "absent") rc = absent(*comm);
  else if (mode == "timeline" && argc >= 3) rc = timeline(*comm, std::stoull(argv[2]));
  else std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  (void)comm->leave();
  return rc;
}
