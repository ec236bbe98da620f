#pragma once
// Random hyperparameters for the differential tests (test_float64.cpp,
// test_soak.cpp): every option torch::optim has, drawn from ranges where fp32
// and fp64 runs stay comparable.

#include <torch/torch.h>

#include <cmath>
#include <random>

namespace ampfuse_test::random_options {

inline double uniform(std::mt19937_64& rng) { return std::uniform_real_distribution<double>(0, 1)(rng); }

template <class Options>
inline Options random_adam(std::mt19937_64& rng) {
  Options o(std::pow(10.0, -4 + 2 * uniform(rng)));
  o.betas({0.8 + 0.15 * uniform(rng), 0.99 + 0.0099 * uniform(rng)});
  o.eps(std::pow(10.0, -10 + 4 * uniform(rng)));
  if (uniform(rng) < 0.5) o.weight_decay(0.05 * uniform(rng));
  o.amsgrad(uniform(rng) < 0.5);
  return o;
}

inline torch::optim::SGDOptions random_sgd(std::mt19937_64& rng) {
  torch::optim::SGDOptions o(std::pow(10.0, -3 + 2 * uniform(rng)));
  const int kind = static_cast<int>(rng() % 4);  // plain, momentum, momentum + dampening, nesterov
  if (kind >= 1) o.momentum(0.5 + 0.49 * uniform(rng));
  if (kind == 2) o.dampening(0.5 * uniform(rng));
  if (kind == 3) o.nesterov(true);
  if (uniform(rng) < 0.5) o.weight_decay(0.05 * uniform(rng));
  return o;
}

inline torch::optim::AdagradOptions random_adagrad(std::mt19937_64& rng) {
  torch::optim::AdagradOptions o(std::pow(10.0, -3 + 2 * uniform(rng)));
  if (uniform(rng) < 0.5) o.lr_decay(0.01 * uniform(rng));
  if (uniform(rng) < 0.5) o.weight_decay(0.05 * uniform(rng));
  if (uniform(rng) < 0.5) o.initial_accumulator_value(0.1 * uniform(rng));
  o.eps(std::pow(10.0, -10 + 4 * uniform(rng)));
  return o;
}

inline torch::optim::RMSpropOptions random_rmsprop(std::mt19937_64& rng) {
  torch::optim::RMSpropOptions o(std::pow(10.0, -4 + 2 * uniform(rng)));
  o.alpha(0.9 + 0.099 * uniform(rng));
  if (uniform(rng) < 0.5) o.momentum(0.5 + 0.45 * uniform(rng));
  if (uniform(rng) < 0.5) o.centered(true);
  if (uniform(rng) < 0.5) o.weight_decay(0.05 * uniform(rng));
  o.eps(std::pow(10.0, -8 + 2 * uniform(rng)));
  return o;
}

}  // namespace ampfuse_test::random_options
