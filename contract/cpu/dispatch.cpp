// Run-time choice of the CPU kernels' instruction set.

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "contract/cpu/kernels.h"

namespace ampfuse::sdk::cpu {
namespace {

struct Target {
  Isa isa;
  bool (*supported)();
};

#if defined(AMPFUSE_CPU_HAS_AVX512)
bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#endif
#if defined(AMPFUSE_CPU_HAS_AVX2)
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif
bool always() { return true; }

// Compiled in, best first.
constexpr Target kTargets[] = {
#if defined(AMPFUSE_CPU_HAS_AVX512)
    {Isa::kAvx512, &has_avx512},
#endif
#if defined(AMPFUSE_CPU_HAS_AVX2)
    {Isa::kAvx2, &has_avx2},
#endif
    {Isa::kBaseline, &always},
};

// The best supported target, or the one named by AMPFUSE_CPU_ISA (as
// ATEN_CPU_CAPABILITY does for ATen) when it is compiled in and supported.
// A name that is not, as ATen does for its variable, is ignored with a
// warning on stderr naming what is used instead (a silent fallback let a
// test run of "scalar" run avx512 unnoticed).
struct Choice {
  Isa isa;
  bool named;  // by AMPFUSE_CPU_ISA (isa_named)
};
Choice best() {
  Isa found = Isa::kBaseline;
  for (const Target& t : kTargets)
    if (t.supported()) {
      found = t.isa;
      break;
    }
  const char* wanted = std::getenv("AMPFUSE_CPU_ISA");
  if (wanted == nullptr || *wanted == '\0') return {found, false};
  std::string names;
  for (const Target& t : kTargets) {
    if (std::strcmp(wanted, to_string(t.isa)) == 0) {
      if (t.supported()) return {t.isa, true};
      std::fprintf(stderr, "ampfuse: AMPFUSE_CPU_ISA=%s is not supported by this CPU; using %s\n", wanted,
                   to_string(found));
      return {found, false};
    }
    names += names.empty() ? "" : ", ";
    names += to_string(t.isa);
  }
  std::fprintf(stderr, "ampfuse: AMPFUSE_CPU_ISA=%s names no instruction set compiled in (%s); using %s\n", wanted,
               names.c_str(), to_string(found));
  return {found, false};
}

// best(), read once.
const Choice& automatic() {
  static const Choice choice = best();
  return choice;
}

std::vector<std::string> supported_isa_names() {
  std::vector<std::string> names;
  for (const Target& t : kTargets)
    if (t.supported()) names.emplace_back(to_string(t.isa));
  return names;
}

constexpr int kAutomatic = -1;
std::atomic<int> g_forced{kAutomatic};

}  // namespace

const char* to_string(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kBaseline: break;
  }
  return "baseline";
}

Isa current_isa() {
  const int forced = g_forced.load(std::memory_order_acquire);
  return forced == kAutomatic ? automatic().isa : static_cast<Isa>(forced);
}

bool isa_named() {
  return automatic().named || g_forced.load(std::memory_order_acquire) != kAutomatic;
}

Isa isa_for(std::int64_t elements, std::int64_t tensors) {
  const Isa isa = current_isa();
#if defined(AMPFUSE_CPU_HAS_AVX2)
  if (isa == Isa::kAvx512 && tensors > 0 && elements < 16 * tensors && !isa_named()) return Isa::kAvx2;
#else
  (void)elements;
  (void)tensors;
#endif
  return isa;
}

void force_isa(const char* name) {
  if (name == nullptr || *name == '\0') {
    g_forced.store(kAutomatic, std::memory_order_release);
    return;
  }
  for (const Target& t : kTargets) {
    if (std::strcmp(name, to_string(t.isa)) == 0) {
      if (!t.supported())
        throw std::invalid_argument(std::string("ampfuse: CPU instruction set ") + name + " is not supported here");
      g_forced.store(static_cast<int>(t.isa), std::memory_order_release);
      return;
    }
  }
  throw std::invalid_argument(std::string("ampfuse: CPU instruction set ") + name + " is not compiled in");
}

namespace {

std::atomic<bool>& kept_subnormals() {
  static std::atomic<bool> kept{[] {
    const char* env = std::getenv("AMPFUSE_KEEP_SUBNORMALS");
    return env != nullptr && *env != '\0' && std::strcmp(env, "0") != 0;
  }()};
  return kept;
}

}  // namespace

void keep_subnormals(bool keep) { kept_subnormals().store(keep, std::memory_order_release); }
bool subnormals_kept() { return kept_subnormals().load(std::memory_order_acquire); }

namespace {

// The floating-point control register's flush bits, and how to read and write it.
#if defined(__SSE__)
// MXCSR: bit 15 flushes subnormal results to zero, bit 6 reads subnormal inputs as zero.
constexpr unsigned kFlushBits = (1u << 15) | (1u << 6);
unsigned read_fp_mode() { return _mm_getcsr(); }
void write_fp_mode(unsigned mode) { _mm_setcsr(mode); }
#elif defined(__aarch64__)
// FPCR.FZ: fp32 and fp64 arithmetic reads subnormal inputs as zero and
// writes subnormal results as zero, as DAZ and FTZ together do on x86 (so
// both give the same numbers). Conversions from fp16 keep its subnormals, as
// F16C does.
constexpr unsigned kFlushBits = 1u << 24;
unsigned read_fp_mode() { return __builtin_aarch64_get_fpcr(); }
void write_fp_mode(unsigned mode) { __builtin_aarch64_set_fpcr(mode); }
#endif

}  // namespace

#if defined(__SSE__) || defined(__aarch64__)
FlushSubnormals::FlushSubnormals() {
  if (subnormals_kept()) return;
  saved_ = read_fp_mode();
  if ((saved_ & kFlushBits) == kFlushBits) return;
  write_fp_mode(saved_ | kFlushBits);
  changed_ = true;
}
FlushSubnormals::~FlushSubnormals() {
  // The flush bits only: exception flags the kernel raised stay raised.
  if (changed_) write_fp_mode((read_fp_mode() & ~kFlushBits) | (saved_ & kFlushBits));
}
#else
FlushSubnormals::FlushSubnormals() {}
FlushSubnormals::~FlushSubnormals() {}
#endif

PlanRef plan_ref(const Plan& plan) {
  const bool runs = !plan.begins().empty();
  return {plan.tensors().data(),
          plan.numels().data(),
          plan.chunk_offsets().data(),
          static_cast<std::int64_t>(plan.tensors().size()),
          plan.chunk_size(),
          runs ? plan.begins().data() : nullptr,
          runs ? plan.places().data() : nullptr};
}

std::int64_t chunks_grain(const Plan& plan) { return chunks_grain(plan.num_chunks(), plan.total_elements()); }

}  // namespace ampfuse::sdk::cpu

namespace ampfuse::cpu {

const Kernels& kernels() {
#if defined(AMPFUSE_CPU_HAS_AVX512) && defined(AMPFUSE_CPU_HAS_AVX2)
  return *sdk::cpu::pick_isa(&avx512::kKernels, &avx2::kKernels, &baseline::kKernels);
#else
  return baseline::kKernels;
#endif
}

std::vector<std::string> available_isas() { return sdk::cpu::supported_isa_names(); }

}  // namespace ampfuse::cpu
