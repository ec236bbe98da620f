// Run-time choice of the CPU kernels' instruction set.

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "contract/cpu/kernels.h"

namespace ampfuse::cpu {
namespace {

struct Target {
  const Kernels* kernels;
  bool (*supported)();
};

bool has_avx512() {
#if defined(AMPFUSE_CPU_HAS_AVX512)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}
bool has_avx2() {
#if defined(AMPFUSE_CPU_HAS_AVX2)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
bool always() { return true; }

std::vector<Target> compiled_targets() {
  std::vector<Target> t;
#if defined(AMPFUSE_CPU_HAS_AVX512)
  t.push_back({&avx512::kKernels, &has_avx512});
#endif
#if defined(AMPFUSE_CPU_HAS_AVX2)
  t.push_back({&avx2::kKernels, &has_avx2});
#endif
  t.push_back({&baseline::kKernels, &always});
  return t;
}

// The best supported target, or the one named by AMPFUSE_CPU_ISA (as
// ATEN_CPU_CAPABILITY does for ATen) when it is compiled in and supported.
const Kernels* best() {
  const char* wanted = std::getenv("AMPFUSE_CPU_ISA");
  if (wanted != nullptr && *wanted != '\0')
    for (const Target& t : compiled_targets())
      if (t.supported() && std::strcmp(wanted, t.kernels->isa) == 0) return t.kernels;
  for (const Target& t : compiled_targets())
    if (t.supported()) return t.kernels;
  return &baseline::kKernels;
}

std::atomic<const Kernels*> g_forced{nullptr};

}  // namespace

const Kernels& kernels() {
  static const Kernels* const automatic = best();
  const Kernels* forced = g_forced.load(std::memory_order_acquire);
  return forced ? *forced : *automatic;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (const Target& t : compiled_targets())
    if (t.supported()) names.emplace_back(t.kernels->isa);
  return names;
}

void force_isa(const std::string& name) {
  if (name.empty()) {
    g_forced.store(nullptr, std::memory_order_release);
    return;
  }
  for (const Target& t : compiled_targets()) {
    if (name == t.kernels->isa) {
      if (!t.supported()) throw std::invalid_argument("ampfuse: CPU instruction set " + name + " is not supported here");
      g_forced.store(t.kernels, std::memory_order_release);
      return;
    }
  }
  throw std::invalid_argument("ampfuse: CPU instruction set " + name + " is not compiled in");
}

}  // namespace ampfuse::cpu

namespace ampfuse::sdk::cpu {

PlanRef plan_ref(const Plan& plan) {
  return {plan.tensors().data(), plan.numels().data(), plan.chunk_offsets().data(),
          static_cast<std::int64_t>(plan.tensors().size()), plan.chunk_size()};
}

const char* isa() { return ::ampfuse::cpu::kernels().isa; }

void force_isa(const char* name) { ::ampfuse::cpu::force_isa(name); }

}  // namespace ampfuse::sdk::cpu
