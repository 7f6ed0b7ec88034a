// A GPU trainer process for the gpu tests: joins with the launcher's environment and a device
// (GRADSYNC_DEVICE, else LOCAL_RANK modulo the visible GPUs), then
//   matrix COUNTS   every type x op x count x {in-place, out-of-place} of the stream
//                   allreduce on device buffers against a host fold of the same inputs
//                   (exact: small integers, so every order gives the same bytes); first the
//                   refusals (host buffer, null, unknown type); prints "path P" and "PASS"
//   graph COUNT     captures one allreduce in a CUDA graph and replays it 4 times with new
//                   inputs, checking each result; prints "PASS"
//   absent          rank 1 joins but never calls; rank 0's allreduce must fail by its
//                   deadline: prints "async_error: STATUS" and "PASS" when it did
// Exit code 0 on success, 1 on any failure (stderr says what).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/gradsync.h"
#include "kernels/half.h"
#include "kernels/host_reduce.h"

namespace {

using gradsync::DataType;
using gradsync::ReduceOp;

#define CUDA_OK(expr)                                                                      \
  do {                                                                                     \
    if (cudaError_t e_ = (expr); e_ != cudaSuccess) {                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

std::vector<size_t> parse_counts(const std::string& s) {
  std::vector<size_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoull(item));
  return out;
}

// Small integers per (rank, index, op), chosen so that every reduction is exact in every type.
double value(int rank, size_t i, ReduceOp op, bool is_unsigned) {
  switch (op) {
    case ReduceOp::kProd: {
      const double v = (rank + i) % 3 == 0 ? 2 : 1;
      return (!is_unsigned && i % 5 == 0 && rank == 0) ? -v : v;
    }
    case ReduceOp::kMin:
    case ReduceOp::kMax: {
      const long v = long((rank * 13 + i * 7) % 41) - 20;
      return is_unsigned ? double(v + 20) : double(v);
    }
    default: {
      const long v = long((rank * 7 + i * 3) % 7) - 3;
      return is_unsigned ? double(v + 3) : double(v);
    }
  }
}

void store(DataType t, void* base, size_t i, double v) {
  switch (t) {
    case DataType::kFloat32: static_cast<float*>(base)[i] = float(v); break;
    case DataType::kFloat64: static_cast<double*>(base)[i] = v; break;
    case DataType::kFloat16: static_cast<uint16_t*>(base)[i] = gradsync::kernels::float_to_half_rne(float(v)); break;
    case DataType::kBFloat16: static_cast<uint16_t*>(base)[i] = gradsync::kernels::float_to_bf16_rne(float(v)); break;
    case DataType::kInt8: static_cast<int8_t*>(base)[i] = int8_t(v); break;
    case DataType::kUInt8: static_cast<uint8_t*>(base)[i] = uint8_t(v); break;
    case DataType::kInt32: static_cast<int32_t*>(base)[i] = int32_t(v); break;
    case DataType::kInt64: static_cast<int64_t*>(base)[i] = int64_t(v); break;
  }
}

void fill(DataType t, ReduceOp op, int rank, size_t count, std::vector<uint8_t>* buf) {
  const bool u = t == DataType::kUInt8;
  for (size_t i = 0; i < count; ++i) store(t, buf->data(), i, value(rank, i, op, u));
}

// The expected result: rank 0's input folded with every other rank's in rank order, the last
// step dividing for avg (host loops; exact inputs make the order irrelevant anyway).
std::vector<uint8_t> expected(DataType t, ReduceOp op, int world, size_t count) {
  const size_t es = gradsync::element_size(t);
  std::vector<uint8_t> acc(count * es + 16), x(count * es + 16);
  fill(t, op, 0, count, &acc);
  if (world == 1) {
    if (op == ReduceOp::kAvg) gradsync::kernels::finish_avg(t, acc.data(), count, 1);
    return acc;
  }
  for (int r = 1; r < world; ++r) {
    fill(t, op, r, count, &x);
    if (r + 1 < world) gradsync::kernels::reduce(t, op, acc.data(), acc.data(), x.data(), count);
    else gradsync::kernels::reduce_final(t, op, acc.data(), nullptr, acc.data(), x.data(), count, world);
  }
  return acc;
}

const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                           DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};

int expect_refused(const char* what, const gradsync::Status& s) {
  std::printf("refused %s: %s\n", what, s.to_string().c_str());
  if (s.code() != gradsync::Code::kInvalidArgument) {
    std::fprintf(stderr, "%s was not refused with INVALID_ARGUMENT: %s\n", what, s.to_string().c_str());
    return 1;
  }
  return 0;
}

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
          for (size_t i = 0; i < count; ++i) {
            if (std::memcmp(&got[i * es], &want[i * es], es) != 0) {
              std::fprintf(stderr, "%s %s count=%zu inplace=%d: element %zu differs from the host fold\n",
                           gradsync::to_string(t), gradsync::to_string(op), count, inplace, i);
              return 1;
            }
          }
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

int absent(gradsync::Communicator& comm) {
  if (comm.rank() != 0) {
    // Joined, alive, never calls: rank 0 must give up by its own deadline.
    std::this_thread::sleep_for(std::chrono::seconds(6));
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
  gradsync::Status e = comm.async_error();
  std::printf("async_error after %.0f ms: %s\n", ms, e.to_string().c_str());
  gradsync::Status next = comm.allreduce(d, d, 16, DataType::kFloat32, ReduceOp::kSum, stream);
  std::printf("next call: %s\n", next.to_string().c_str());
  if (e.ok() || next.ok()) return 1;
  std::printf("PASS\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: gpu_worker matrix COUNTS | graph COUNT | absent\n");
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
  else if (mode == "graph" && argc >= 3) rc = graph(*comm, std::stoull(argv[2]));
  else if (mode == "absent") rc = absent(*comm);
  else std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  (void)comm->leave();
  return rc;
}
