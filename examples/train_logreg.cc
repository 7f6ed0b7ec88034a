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
#if GRADSYNC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

struct Config {
  int steps = 50;
  int samples = 8192;
  int features = 256;
  float lr = 0.5f;
  // Sums over ranks associate differently from one sum over all samples: allow float32
  // rounding of that reordering, relative to the weights' size.
  double tolerance = 1e-4;
};

struct Dataset {
  std::vector<float> x;  // samples x features, row major
  std::vector<float> y;  // 0 or 1
};

// Same data on every rank: a fixed seed, labels from a hidden linear model plus noise.
Dataset make_data(const Config& c) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> truth(c.features);
  for (auto& t : truth) t = normal(rng);
  Dataset d;
  d.x.resize(size_t(c.samples) * c.features);
  d.y.resize(c.samples);
  for (int i = 0; i < c.samples; ++i) {
    float dot = 0;
    for (int j = 0; j < c.features; ++j) {
      float v = normal(rng);
      d.x[size_t(i) * c.features + j] = v;
      dot += v * truth[j];
    }
    d.y[i] = (dot + 0.5f * normal(rng)) > 0 ? 1.0f : 0.0f;
  }
  return d;
}

// Adds the gradient of the summed log-loss over samples [begin, end) into grad[0..F), and
// the summed loss into grad[F].
void accumulate(const Config& c, const Dataset& d, const std::vector<float>& w, int begin, int end,
                std::vector<float>& grad) {
  std::fill(grad.begin(), grad.end(), 0.0f);
  for (int i = begin; i < end; ++i) {
    const float* xi = &d.x[size_t(i) * c.features];
    float z = 0;
    for (int j = 0; j < c.features; ++j) z += w[j] * xi[j];
    float p = 1.0f / (1.0f + std::exp(-z));
    float err = p - d.y[i];
    for (int j = 0; j < c.features; ++j) grad[j] += err * xi[j];
    float eps = 1e-7f;
    grad[c.features] += -(d.y[i] * std::log(p + eps) + (1 - d.y[i]) * std::log(1 - p + eps));
  }
}

void step(const Config& c, std::vector<float>& w, const std::vector<float>& grad) {
  for (int j = 0; j < c.features; ++j) w[j] -= c.lr * grad[j] / float(c.samples);
}

int arg_int(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return fallback;
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
