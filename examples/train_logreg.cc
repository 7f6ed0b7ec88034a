// Data-parallel logistic regression on synthetic data, the smallest real training loop:
// every rank computes the gradient on its shard, gradsync sums the gradients, every rank
// takes the same step. At the end each rank trains the same model in one process on all of
// the data and checks that its weights match; it fails loudly otherwise.
//
//   gradsyncrun --standalone -n 4 build/bin/train_logreg [--steps N] [--samples N] [--features N]
//                                                        [--device host]
// With a CUDA build and a visible GPU the gradients are reduced on the GPU (device LOCAL_RANK
// modulo the GPUs), else on the host.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradsync/gradsync.h"
#include "logreg.h"
#if GRADSYNC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

using logreg::Config;
using logreg::Dataset;
using logreg::accumulate;
using logreg::arg_int;
using logreg::make_data;

void step(const Config& c, std::vector<float>& w, const std::vector<float>& grad) {
  for (int j = 0; j < c.features; ++j) w[j] -= c.lr * grad[j] / float(c.samples);
}

}  // namespace

// True when argv has `name value` with that value.
[[maybe_unused]] static bool arg_flag(int argc, char** argv, const char* name, const char* value) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0 && std::strcmp(argv[i + 1], value) == 0) return true;
  }
  return false;
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Config c;
  c.steps = arg_int(argc, argv, "--steps", c.steps);
  c.samples = arg_int(argc, argv, "--samples", c.samples);
  c.features = arg_int(argc, argv, "--features", c.features);

  auto session = gradsync::Session::connect();
  if (!session.ok()) {
    std::fprintf(stderr, "FAIL: %s\n", session.status().to_string().c_str());
    return 1;
  }
  // On GPU where there is one (and gradsync was built with CUDA): the gradients are reduced
  // in device memory on a CUDA stream; --device host keeps them on the host.
  gradsync::JoinOptions opts = gradsync::JoinOptions::from_env();
  bool gpu = false;
#if GRADSYNC_HAVE_CUDA
  int devices = 0;
  const bool host_only = arg_flag(argc, argv, "--device", "host");
  if (!host_only && cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    gpu = true;
    if (opts.device == gradsync::JoinOptions::kNoDevice) opts.device = gradsync::JoinOptions::kDeviceLocalRank;
  }
  (void)cudaGetLastError();
#endif
  auto comm = session->join(opts);
  if (!comm.ok()) {
    std::fprintf(stderr, "FAIL: %s\n", comm.status().to_string().c_str());
    return 1;
  }
  const int rank = comm->rank();
  const int world = comm->world_size();
  const int begin = int(int64_t(c.samples) * rank / world);
  const int end = int(int64_t(c.samples) * (rank + 1) / world);
  Dataset data = make_data(c);
  std::printf("rank %d of %d: samples [%d, %d) of %d, %d features\n", rank, world, begin, end, c.samples,
              c.features);

  std::vector<float> w(c.features, 0.0f);
  std::vector<float> grad(c.features + 1);
#if GRADSYNC_HAVE_CUDA
  float* d_grad = nullptr;
  cudaStream_t stream = nullptr;
  if (gpu) {
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaMalloc(reinterpret_cast<void**>(&d_grad), grad.size() * sizeof(float)) != cudaSuccess) {
      std::fprintf(stderr, "FAIL: CUDA set-up on device %d\n", comm->device());
      return 1;
    }
    std::printf("rank %d: gradients reduced on GPU %d (%s)\n", rank, comm->device(), comm->gpu_path().c_str());
  }
  // One step's gradient allreduce on the GPU: upload, allreduce on the stream, download.
  auto gpu_allreduce = [&]() -> gradsync::Status {
    const size_t bytes = grad.size() * sizeof(float);
    if (cudaMemcpyAsync(d_grad, grad.data(), bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess) {
      return {gradsync::Code::kInternal, "cudaMemcpyAsync"};
    }
    gradsync::Status st = comm->allreduce(d_grad, d_grad, grad.size(), gradsync::DataType::kFloat32,
                                          gradsync::ReduceOp::kSum, stream);
    if (!st.ok()) return st;
    if (cudaMemcpyAsync(grad.data(), d_grad, bytes, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      return {gradsync::Code::kInternal, "cudaMemcpyAsync/cudaStreamSynchronize"};
    }
    return comm->async_error();
  };
#endif
  for (int s = 0; s < c.steps; ++s) {
    accumulate(c, data, w, begin, end, grad);
    gradsync::Status st;
#if GRADSYNC_HAVE_CUDA
    if (gpu) st = gpu_allreduce();
#endif
    if (!gpu) st = comm->allreduce(grad.data(), grad.size(), gradsync::DataType::kFloat32,
                                   gradsync::ReduceOp::kSum);
    if (!st.ok()) {
      std::fprintf(stderr, "FAIL: step %d: %s\n", s, st.to_string().c_str());
      return 1;
    }
    step(c, w, grad);
    if (rank == 0 && (s % 10 == 0 || s == c.steps - 1)) {
      std::printf("step %3d  loss %.6f\n", s, grad[c.features] / float(c.samples));
    }
  }

  // The same training in one process on all of the data.
  std::vector<float> ref(c.features, 0.0f);
  for (int s = 0; s < c.steps; ++s) {
    accumulate(c, data, ref, 0, c.samples, grad);
    step(c, ref, grad);
  }
  double max_diff = 0, max_w = 0;
  for (int j = 0; j < c.features; ++j) {
    max_diff = std::max(max_diff, double(std::fabs(w[j] - ref[j])));
    max_w = std::max(max_w, double(std::fabs(ref[j])));
  }
  double rel = max_diff / std::max(max_w, 1e-12);
#if GRADSYNC_HAVE_CUDA
  if (gpu) {
    cudaFree(d_grad);
    cudaStreamDestroy(stream);
  }
#endif
  gradsync::Status left = comm->leave();
  if (!left.ok()) {
    std::fprintf(stderr, "FAIL: leave: %s\n", left.to_string().c_str());
    return 1;
  }
  if (!(rel <= c.tolerance)) {
    std::fprintf(stderr, "FAIL: rank %d weights differ from the single-process run: max |dw| %.3g "
                         "(%.3g relative, tolerance %.1g)\n", rank, max_diff, rel, c.tolerance);
    return 1;
  }
  std::printf("OK: rank %d weights match the single-process run (max |dw| %.3g, %.3g relative, "
              "tolerance %.1g)\n", rank, max_diff, rel, c.tolerance);
  return 0;
}
