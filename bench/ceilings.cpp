#include "ceilings.h"

#include <ATen/Parallel.h>
#include <ampfuse/sdk/cpu.h>

#include <array>
#include <atomic>
#include <cstring>

namespace ampfuse_bench {

template <class F>
static void for_chunks(const ampfuse::Plan& plan, F&& f) {
  at::parallel_for(0, plan.num_chunks(), 1, [&](std::int64_t b, std::int64_t e) {
    const ampfuse::sdk::cpu::FlushSubnormals flush;  // as every kernel's worker runs (the fp64 twin's floats need it)
    for (std::int64_t c = b; c < e; ++c) {
      const ampfuse::Chunk ch = plan.chunk(c);
      f(ch);
    }
  });
}

// Every twin's workers flush subnormals, as the kernels' do
// (sdk::cpu::FlushSubnormals): the fp64 twin reads doubles as floats, whose
// low halves are subnormals, infinities and NaNs as often as not, and
// without the flush it ran at half its speed on them (its "ceiling" was
// then 1.8x below the step it bounds).
//
// The twins write into the benchmark's shared parameters and buffers, which
// every contender then steps: their arithmetic keeps the values where they
// are (moments settle at ~2g and ~2g^2 or ~2p^2, always finite, the squared
// one never negative; parameters move by ~1e-32, below their rounding), so
// no contender runs on values a twin drove to inf or NaN.
constexpr float kNudge = 1e-30f;

// The twins' vectors are as wide as the target's registers (a cache line
// is kPieces of them): GCC keeps a vector wider than any register in memory
// and copies it through general registers at every operation, which made
// the twins of a 64-byte vector run at a third of the kernels' speed on an
// AVX2 machine.
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
constexpr int kPieces = 64 / kVecBytes;  // per cache line
constexpr int kVecFloats = kVecBytes / 4;
using VecBits = std::uint32_t __attribute__((vector_size(kVecBytes)));
using VecFloat = float __attribute__((vector_size(kVecBytes)));
using VecBytes = std::uint8_t __attribute__((vector_size(kVecBytes)));

std::uint32_t read_only_twin(const std::vector<float*>& data, const ampfuse::Plan& plan) {
  std::atomic<std::uint32_t> result{0};
  for_chunks(plan, [&](const ampfuse::Chunk& ch) {
    // Four interleaved streams, each prefetched 2 KiB ahead: one core keeps
    // more cache-line misses in flight than with one stream (which reads
    // about a third slower), as the check pass does.
    const auto* p = reinterpret_cast<const std::uint32_t*>(data[ch.tensor] + ch.begin);
    const std::int64_t q = ch.size / 64 * 16;  // whole cache lines per stream
    VecBits acc[4] = {};
    for (std::int64_t line = 0; line < q; line += 16)
      for (std::int64_t s = 0; s < 4; ++s) {
        if (line + 512 < q) __builtin_prefetch(p + s * q + line + 512);
        for (int h = 0; h < kPieces; ++h) {
          VecBits x;
          std::memcpy(&x, p + s * q + line + h * kVecFloats, sizeof x);
          acc[s] |= x;
        }
      }
    const VecBits all = acc[0] | acc[1] | acc[2] | acc[3];
    std::uint32_t acc_all = 0;
    for (int j = 0; j < kVecFloats; ++j) acc_all |= all[j];
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

// The optimizer twins walk the lists as ampfuse's CPU executor does, without
// its arithmetic: each thread's range of chunks in order, one cache line of
// every list at a time, every list prefetched 1 KiB (256 fp32) ahead and, near
// a chunk's end, on into the next chunk of the range. update(x) changes the
// values x[l] of the lists (a std::array of VecFloat, or of float for a
// chunk's tail); only the lists in kWritten are stored back.
template <std::size_t N, unsigned kWritten, class Update>
static void twin_walk(const ampfuse::Plan& plan, const std::array<const std::vector<float*>*, N>& lists,
                      Update&& update) {
  at::parallel_for(0, plan.num_chunks(), 1, [&](std::int64_t b, std::int64_t e) {
    const ampfuse::sdk::cpu::FlushSubnormals flush;  // as every kernel's worker runs (the fp64 twin's floats need it)
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
      // Unrolled, so that x stays in registers: copied element by element
      // in a loop, a vector went to the stack in 16-byte halves and was read
      // back whole, which the store buffer cannot forward (AMD Zen 3).
      const auto step = [&](auto& x, std::int64_t i) {
#pragma GCC unroll 8
        for (std::size_t l = 0; l < N; ++l) std::memcpy(&x[l], base[l] + i, sizeof x[l]);
        update(x);
#pragma GCC unroll 8
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
        for (int h = 0; h < kPieces; ++h) {
          std::array<VecFloat, N> x;
          step(x, i + h * kVecFloats);
        }
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
  at::parallel_for(0, plan.num_chunks(), 1, [&](std::int64_t b, std::int64_t e) {
    const ampfuse::sdk::cpu::FlushSubnormals flush;  // as every kernel's worker runs (the fp64 twin's floats need it)
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
        for (int k = 0; k < 64; k += kVecFloats) {
          VecFloat pl, gl;
          std::memcpy(&pl, p + i + k, kVecBytes);
          std::memcpy(&gl, g + i + k, kVecBytes);
          pl = pl - gl * kNudge;
          std::memcpy(p + i + k, &pl, kVecBytes);
        }
        for (int k = 0; k < 64; k += kVecBytes) {
          VecBytes mb, vb;
          std::memcpy(&mb, m + i + k, kVecBytes);
          std::memcpy(&vb, v + i + k, kVecBytes);
          mb = mb + vb;
          vb = vb ^ mb;
          std::memcpy(m + i + k, &mb, kVecBytes);
          std::memcpy(v + i + k, &vb, kVecBytes);
        }
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
