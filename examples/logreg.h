// The model and data of the logistic-regression examples (train_logreg,
// train_logreg_elastic): synthetic data, the summed log-loss gradient, argument parsing.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace logreg {

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
inline Dataset make_data(const Config& c) {
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
inline void accumulate(const Config& c, const Dataset& d, const std::vector<float>& w, int begin, int end,
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

inline int arg_int(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

}  // namespace logreg
