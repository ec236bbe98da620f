#include "ceilings.h"

#include <ATen/Parallel.h>

#include <array>
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
    // Four interleaved streams, each prefetched 2 KiB ahead: one core keeps
    // more cache-line misses in flight than with one stream (which reads
    // about a third slower), as the check pass does.
    using Line = std::uint32_t __attribute__((vector_size(64)));  // one cache line
    const auto* p = reinterpret_cast<const std::uint32_t*>(data[ch.tensor] + ch.begin);
    const std::int64_t q = ch.size / 64 * 16;  // whole cache lines per stream
    Line acc[4] = {};
    for (std::int64_t line = 0; line < q; line += 16)
      for (std::int64_t s = 0; s < 4; ++s) {
        if (line + 512 < q) __builtin_prefetch(p + s * q + line + 512);
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

using Line16 = float __attribute__((vector_size(64)));  // one cache line of fp32

// The optimizer twins walk the lists as ampfuse's CPU executor does, without
// its arithmetic: each thread's range of chunks in order, one cache line of
// every list at a time, every list prefetched 1 KiB (256 fp32) ahead and, near
// a chunk's end, on into the next chunk of the range. update(x) changes the
// values x[l] of the lists (a std::array of Line16, or of float for a
// chunk's tail); only the lists in kWritten are stored back.
template <std::size_t N, unsigned kWritten, class Update>
static void twin_walk(const ampfuse::Plan& plan, const std::array<const std::vector<float*>*, N>& lists,
                      Update&& update) {
  at::parallel_for(0, plan.num_chunks(), 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t c = b; c < e; ++c) {
      const ampfuse::Chunk ch = plan.chunk(c);
      const ampfuse::Chunk nx = c + 1 < e ? plan.chunk(c + 1) : ampfuse::Chunk{};  // size 0: none
      const std::int64_t n = ch.size, next_n = nx.size;
      std::array<float*, N> base, next{};
      for (std::size_t l = 0; l < N; ++l) {
        base[l] = (*lists[l])[ch.tensor] + ch.begin;
        if (next_n > 0) next[l] = (*lists[l])[nx.tensor] + nx.begin;
      }
      // Loads x from element i of every list, updates it, stores the written lists back.
      const auto step = [&](auto& x, std::int64_t i) {
        for (std::size_t l = 0; l < N; ++l) std::memcpy(&x[l], base[l] + i, sizeof x[l]);
        update(x);
        for (std::size_t l = 0; l < N; ++l)
          if ((kWritten >> l) & 1u) std::memcpy(base[l] + i, &x[l], sizeof x[l]);
      };
      std::int64_t i = 0;
      for (; i + 16 <= n; i += 16) {
        const std::int64_t ahead = i + 256;
        for (std::size_t l = 0; l < N; ++l) {
          if (ahead < n) __builtin_prefetch(base[l] + ahead);
          else if (ahead - n < next_n) __builtin_prefetch(next[l] + (ahead - n));
        }
        std::array<Line16, N> x;
        step(x, i);
      }
      for (; i < n; ++i) {
        std::array<float, N> x;
        step(x, i);
      }
    }
  });
}

void adam_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& m,
               const std::vector<float*>& v, const ampfuse::Plan& plan) {
  // Lists p, g, m, v; writes p, m, v.
  twin_walk<4, 0b1101u>(plan, {&p, &g, &m, &v}, [](auto& x) {
    x[2] = x[2] * 0.5f + x[1];
    x[3] = x[3] * 0.5f + x[1] * x[1];
    x[0] = x[0] - (x[2] + x[3]) * kNudge;
  });
}

void sgd_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& buf,
              const ampfuse::Plan& plan) {
  // Lists p, g, buf; writes p, buf.
  twin_walk<3, 0b101u>(plan, {&p, &g, &buf}, [](auto& x) {
    x[2] = x[2] * 0.5f + x[1];
    x[0] = x[0] - x[2] * kNudge;
  });
}

void lamb_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& m,
               const std::vector<float*>& v, const ampfuse::Plan& plan) {
  // Pass 1: lists p, g, m, v; writes m, v. Pass 2: lists p, m, v; writes p.
  twin_walk<4, 0b1100u>(plan, {&p, &g, &m, &v}, [](auto& x) {
    x[2] = x[2] * 0.5f + x[1];
    x[3] = x[3] * 0.5f + x[0] * x[0];
  });
  twin_walk<3, 0b001u>(plan, {&p, &m, &v}, [](auto& x) { x[0] = x[0] - x[1] * x[2] * kNudge; });
}

void adam8_twin(const Twin8Pointers& t, const ampfuse::Plan& plan) {
  using Bytes64 = std::uint8_t __attribute__((vector_size(64)));  // one cache line of bytes
  at::parallel_for(0, plan.num_chunks(), 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t c = b; c < e; ++c) {
      const ampfuse::Chunk ch = plan.chunk(c);
      float* p = t.p[ch.tensor] + ch.begin;
      const float* g = t.g[ch.tensor] + ch.begin;
      std::uint8_t* m = t.m[ch.tensor] + ch.begin;
      std::uint8_t* v = t.v[ch.tensor] + ch.begin;
      std::int64_t i = 0;
      // 64 elements at a time: four cache lines of p and of g, one of each
      // moment, every one of them prefetched 256 elements ahead, as the
      // other twins and the 8-bit kernel prefetch: a ceiling that left most
      // lines to the hardware prefetchers would wait on memory where the
      // kernel does not.
      for (; i + 64 <= ch.size; i += 64) {
        if (i + 256 < ch.size) {
          for (int k = 0; k < 4; ++k) {
            __builtin_prefetch(p + i + 256 + 16 * k);
            __builtin_prefetch(g + i + 256 + 16 * k);
          }
          __builtin_prefetch(m + i + 256);
          __builtin_prefetch(v + i + 256);
        }
        Bytes64 mb, vb;
        std::memcpy(&mb, m + i, 64);
        std::memcpy(&vb, v + i, 64);
        for (int k = 0; k < 4; ++k) {
          Line16 pl, gl;
          std::memcpy(&pl, p + i + 16 * k, 64);
          std::memcpy(&gl, g + i + 16 * k, 64);
          pl = pl - gl * kNudge;
          std::memcpy(p + i + 16 * k, &pl, 64);
        }
        mb = mb + vb;
        vb = vb ^ mb;
        std::memcpy(m + i, &mb, 64);
        std::memcpy(v + i, &vb, 64);
      }
      for (; i < ch.size; ++i) {
        p[i] = p[i] - g[i] * kNudge;
        m[i] = static_cast<std::uint8_t>(m[i] + v[i]);
        v[i] = static_cast<std::uint8_t>(v[i] ^ m[i]);
      }
    }
  });
}

}  // namespace ampfuse_bench
