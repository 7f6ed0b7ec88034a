// Data-parallel training of an MLP with LibTorch and gradsync::GradientReducer: each
// parameter's gradient lives in a reducer bucket (param.grad() is a view of it), an autograd
// hook on each parameter's gradient accumulator marks it ready, and the buckets' allreduces
// run while the rest of the backward pass is still computing. At the end every rank trains
// the same model in one process on the whole batch and checks that its weights match.
//
//   gradsyncrun --standalone -n 4 build/bin/train_mlp_libtorch [--steps N] [--batch N]
//       [--features N] [--hidden N] [--layers N] [--mode overlap|after-backward]
//       [--bucket-kb N] [--no-check] [--threads N]
// --mode after-backward marks every gradient after the backward pass (no hooks; no cap but the
// 1 MiB first bucket): the baseline of scripts/bench-reducer-overlap.sh. Both modes print the
// median step time.
#include <torch/torch.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/gradient_reducer.h"
#include "gradsync/gradsync.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  int steps = 20;
  int batch = 256;  // global: split evenly over the ranks
  int features = 64;
  int hidden = 128;
  int layers = 3;
  int bucket_kb = 25 << 10;  // the bucket cap; the first bucket is min(1 MiB, cap)
  bool overlap = true;
  bool check = true;
  int threads = 1;
  float lr = 0.05f;
  // Weights after training on the ranks against one process: float32 sums associate
  // differently (per-rank partial gradients, then the allreduce), relative to the largest weight.
  double tolerance = 1e-4;
};

int arg_int(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return fallback;
}
bool has_flag(int argc, char** argv, const char* name, const char* value = nullptr) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], name) != 0) continue;
    if (value == nullptr) return true;
    if (i + 1 < argc && std::strcmp(argv[i + 1], value) == 0) return true;
  }
  return false;
}

torch::nn::Sequential make_model(const Config& c) {
  torch::manual_seed(1234);  // the same initial weights on every rank and in the reference
  torch::nn::Sequential net;
  int in = c.features;
  for (int l = 0; l + 1 < c.layers; ++l) {
    net->push_back(torch::nn::Linear(in, c.hidden));
    net->push_back(torch::nn::Tanh());
    in = c.hidden;
  }
  net->push_back(torch::nn::Linear(in, 1));
  return net;
}

struct Data {
  torch::Tensor x, y;
};
Data make_data(const Config& c) {
  torch::manual_seed(99);
  Data d;
  d.x = torch::randn({c.batch, c.features});
  torch::Tensor w = torch::randn({c.features, 1}) / std::sqrt(double(c.features));
  d.y = torch::sin(d.x.matmul(w)) + 0.1 * torch::randn({c.batch, 1});
  return d;
}

// One step's forward and backward on samples [begin, end) of the batch (the loss is their mean).
torch::Tensor forward_backward(torch::nn::Sequential& net, const Data& d, int begin, int end) {
  torch::Tensor out = net->forward(d.x.slice(0, begin, end));
  torch::Tensor loss = torch::mse_loss(out, d.y.slice(0, begin, end));
  loss.backward();
  return loss;
}

// Binds a model's parameters to a GradientReducer: gradients as views of the buckets, and a
// post hook on each parameter's gradient accumulator that marks it ready.
class TorchReducer {
 public:
  gradsync::Status attach(gradsync::Communicator& comm, torch::nn::Module& model, gradsync::ReducerOptions opts,
                          bool hooks) {
    params_ = model.parameters();
    std::vector<gradsync::GradientSpec> specs;
    for (auto& p : params_) {
      gradsync::GradientSpec s;
      s.count = size_t(p.numel());
      s.type = gradsync::DataType::kFloat32;
      specs.push_back(s);
    }
    opts.on_view_moved = [this](int i, void* view) { bind(i, view); };
    auto r = gradsync::GradientReducer::create(comm, specs, opts);
    if (!r.ok()) return r.status();
    reducer_ = std::move(r).value();
    for (size_t i = 0; i < params_.size(); ++i) {
      bind(int(i), reducer_->view(int(i)));
      if (!hooks) continue;
      // The accumulator must stay alive, or autograd makes a new one without the hook.
      accumulators_.push_back(torch::autograd::impl::grad_accumulator(params_[i]));
      accumulators_.back()->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            gradsync::Status s = reducer_->mark_ready(int(i));
            if (!s.ok()) std::fprintf(stderr, "mark_ready(%zu): %s\n", i, s.to_string().c_str());
            return outputs;
          }));
    }
    return gradsync::Status::Ok();
  }
  void zero_grad() {
    for (auto& p : params_) p.mutable_grad().zero_();
  }
  // Without hooks: every gradient at once, after the backward pass.
  void mark_all() {
    for (size_t i = params_.size(); i-- > 0;) (void)reducer_->mark_ready(int(i));
  }
  gradsync::GradientReducer& reducer() { return *reducer_; }

 private:
  void bind(int i, void* view) {
    torch::Tensor& p = params_[size_t(i)];
    p.mutable_grad() = torch::from_blob(view, p.sizes(), torch::TensorOptions().dtype(torch::kFloat32));
  }
  std::vector<torch::Tensor> params_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::unique_ptr<gradsync::GradientReducer> reducer_;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

int fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Config c;
  c.steps = arg_int(argc, argv, "--steps", c.steps);
  c.batch = arg_int(argc, argv, "--batch", c.batch);
  c.features = arg_int(argc, argv, "--features", c.features);
  c.hidden = arg_int(argc, argv, "--hidden", c.hidden);
  c.layers = std::max(1, arg_int(argc, argv, "--layers", c.layers));
  c.bucket_kb = std::max(1, arg_int(argc, argv, "--bucket-kb", c.bucket_kb));
  c.overlap = !has_flag(argc, argv, "--mode", "after-backward");
  c.check = !has_flag(argc, argv, "--no-check");
  c.threads = arg_int(argc, argv, "--threads", c.threads);
  torch::set_num_threads(c.threads);

  auto session = gradsync::Session::connect();
  if (!session.ok()) return fail(session.status().to_string());
  auto comm = session->join(gradsync::JoinOptions::from_env());
  if (!comm.ok()) return fail(comm.status().to_string());
  const int rank = comm->rank(), world = comm->world_size();
  if (c.batch % world != 0) return fail("--batch must be a multiple of the world size");
  const int begin = c.batch / world * rank, end = c.batch / world * (rank + 1);

  Data data = make_data(c);
  torch::nn::Sequential net = make_model(c);
  size_t numel = 0;
  for (auto& p : net->parameters()) numel += size_t(p.numel());
  gradsync::ReducerOptions opts;
  // The baseline: no cap (beyond the first bucket's), everything reduced after the backward pass.
  opts.bucket_cap_bytes = c.overlap ? size_t(c.bucket_kb) << 10 : SIZE_MAX;
  opts.first_bucket_bytes = std::min(opts.first_bucket_bytes, opts.bucket_cap_bytes);
  TorchReducer tr;
  if (auto s = tr.attach(*comm, *net, opts, /*hooks=*/c.overlap); !s.ok()) return fail(s.to_string());
  if (rank == 0) {
    std::printf("MLP %d x %d, %d layers: %zu parameters (%.1f MiB of gradients), %zu bucket(s), mode %s, "
                "%d rank(s), batch %d\n",
                c.features, c.hidden, c.layers, numel, double(numel) * 4 / (1 << 20), tr.reducer().buckets().size(),
                c.overlap ? "overlap" : "after-backward", world, c.batch);
  }
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(c.lr).momentum(0.9));
  std::vector<double> step_ms, backward_ms, finish_ms;
  for (int s = 0; s < c.steps; ++s) {
    const auto t0 = Clock::now();
    tr.zero_grad();
    torch::Tensor loss = forward_backward(net, data, begin, end);
    const double bw = ms_since(t0);
    if (!c.overlap) tr.mark_all();
    const auto t1 = Clock::now();
    if (auto st = tr.reducer().finish(); !st.ok()) return fail("step " + std::to_string(s) + ": " + st.to_string());
    const double fin = ms_since(t1);
    opt.step();
    if (s >= 2) {  // the first steps pay for allocation and the rebuild
      step_ms.push_back(ms_since(t0));
      backward_ms.push_back(bw);
      finish_ms.push_back(fin);
    }
    if (rank == 0 && (s % 5 == 0 || s == c.steps - 1)) std::printf("step %3d  local loss %.6f\n", s, loss.item<float>());
  }
  std::printf("rank %d: median step %.2f ms (forward+backward %.2f ms, finish %.2f ms) over %zu steps; buckets %zu%s\n",
              rank, median(step_ms), median(backward_ms), median(finish_ms), step_ms.size(),
              tr.reducer().buckets().size(), tr.reducer().rebuilt() ? " (rebuilt after step 1)" : "");

  int rc = 0;
  if (c.check) {
    // The same training in one process on the whole batch.
    torch::nn::Sequential ref = make_model(c);
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(c.lr).momentum(0.9));
    for (int s = 0; s < c.steps; ++s) {
      ref_opt.zero_grad();
      forward_backward(ref, data, 0, c.batch);
      ref_opt.step();
    }
    double max_diff = 0, max_w = 0;
    auto mine = net->parameters(), theirs = ref->parameters();
    for (size_t i = 0; i < mine.size(); ++i) {
      max_diff = std::max(max_diff, (mine[i] - theirs[i]).abs().max().item<double>());
      max_w = std::max(max_w, theirs[i].abs().max().item<double>());
    }
    const double rel = max_diff / std::max(max_w, 1e-12);
    if (!(rel <= c.tolerance)) {
      std::fprintf(stderr, "FAIL: rank %d weights differ from the single-process run: max |dw| %.3g (%.3g relative, "
                           "tolerance %.1g)\n", rank, max_diff, rel, c.tolerance);
      rc = 1;
    } else {
      std::printf("OK: rank %d weights match the single-process run (max |dw| %.3g, %.3g relative, tolerance %.1g)\n",
                  rank, max_diff, rel, c.tolerance);
    }
  }
  if (auto left = comm->leave(); !left.ok()) return fail("leave: " + left.to_string());
  return rc;
}
