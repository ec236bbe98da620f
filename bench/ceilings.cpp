#include "ceilings.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>

namespace ampfuse_bench {

template <class F>
static void for_chunks(const ampfuse::Plan& plan, F&& f) {
  at::parallel_for(0, plan.num_chunks(), 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t c = b; c < e; ++c) {
      const ampfuse::Chunk ch = plan.chunk(c);
      f(ch);
    }
  });
}

// The twins write into the benchmark's shared parameters and buffers, which
// every contender then steps: their arithmetic keeps the values where they
// are (moments settle at ~2g and ~2g^2 or ~2p^2, always finite, the squared
// one never negative; parameters move by ~1e-32, below their rounding), so
// no contender runs on values a twin drove to inf or NaN.
constexpr float kNudge = 1e-30f;

std::uint32_t read_only_twin(const std::vector<float*>& data, const ampfuse::Plan& plan) {
  std::atomic<std::uint32_t> result{0};
  for_chunks(plan, [&](const ampfuse::Chunk& ch) {
    // Four interleaved streams, each prefetched 1 KiB ahead: one core keeps
    // more cache-line misses in flight than with one stream (which reads
    // about a third slower), as the check pass does.
    using Line = std::uint32_t __attribute__((vector_size(64)));  // one cache line
    const auto* p = reinterpret_cast<const std::uint32_t*>(data[ch.tensor] + ch.begin);
    const std::int64_t q = ch.size / 64 * 16;  // whole cache lines per stream
    Line acc[4] = {};
    for (std::int64_t line = 0; line < q; line += 16)
      for (std::int64_t s = 0; s < 4; ++s) {
        if (line + 256 < q) __builtin_prefetch(p + s * q + line + 256);
        Line x;
        std::memcpy(&x, p + s * q + line, sizeof x);
        acc[s] |= x;
      }
    const Line all = acc[0] | acc[1] | acc[2] | acc[3];
    std::uint32_t acc_all = 0;
    for (int j = 0; j < 16; ++j) acc_all |= all[j];
    for (std::int64_t i = 4 * q; i < ch.size; ++i) acc_all |= p[i];
    result.fetch_or(acc_all, std::memory_order_relaxed);
  });
  return result.load();
}

void read_write_twin(const std::vector<float*>& data, const ampfuse::Plan& plan, float s) {
  for_chunks(plan, [&](const ampfuse::Chunk& ch) {
    float* p = data[ch.tensor] + ch.begin;
    for (std::int64_t i = 0; i < ch.size; ++i) p[i] = p[i] * s;
  });
}

void adam_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& m,
               const std::vector<float*>& v, const ampfuse::Plan& plan) {
  for_chunks(plan, [&](const ampfuse::Chunk& ch) {
    float* pp = p[ch.tensor] + ch.begin;
    const float* gg = g[ch.tensor] + ch.begin;
    float* mm = m[ch.tensor] + ch.begin;
    float* vv = v[ch.tensor] + ch.begin;
    for (std::int64_t i = 0; i < ch.size; ++i) {
      mm[i] = mm[i] * 0.5f + gg[i];
      vv[i] = vv[i] * 0.5f + gg[i] * gg[i];
      pp[i] = pp[i] - (mm[i] + vv[i]) * kNudge;
    }
  });
}

void sgd_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& buf,
              const ampfuse::Plan& plan) {
  for_chunks(plan, [&](const ampfuse::Chunk& ch) {
    float* pp = p[ch.tensor] + ch.begin;
    const float* gg = g[ch.tensor] + ch.begin;
    float* bb = buf[ch.tensor] + ch.begin;
    for (std::int64_t i = 0; i < ch.size; ++i) {
      bb[i] = bb[i] * 0.5f + gg[i];
      pp[i] = pp[i] - bb[i] * kNudge;
    }
  });
}

void lamb_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& m,
               const std::vector<float*>& v, const ampfuse::Plan& plan) {
  for_chunks(plan, [&](const ampfuse::Chunk& ch) {
    const float* pp = p[ch.tensor] + ch.begin;
    const float* gg = g[ch.tensor] + ch.begin;
    float* mm = m[ch.tensor] + ch.begin;
    float* vv = v[ch.tensor] + ch.begin;
    for (std::int64_t i = 0; i < ch.size; ++i) {
      mm[i] = mm[i] * 0.5f + gg[i];
      vv[i] = vv[i] * 0.5f + pp[i] * pp[i];
    }
  });
  for_chunks(plan, [&](const ampfuse::Chunk& ch) {
    float* pp = p[ch.tensor] + ch.begin;
    const float* mm = m[ch.tensor] + ch.begin;
    const float* vv = v[ch.tensor] + ch.begin;
    for (std::int64_t i = 0; i < ch.size; ++i) pp[i] = pp[i] - mm[i] * vv[i] * kNudge;
  });
}

}  // namespace ampfuse_bench
