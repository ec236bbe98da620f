// Every CPU kernel's results on fixed inputs, as one hash per case: the
// lines that ctest's kernel_bits tests compare between instruction sets on
// this machine, and between the x86-64 baseline build and the AArch64 one
// (NEON) run under qemu. No LibTorch: the kernels take raw pointers, so this
// program is built for AArch64 from the kernels' baseline sources alone.
//
// Output: one line per case, "<kind> <case> <hash>". "exact" lines hash
// element-wise results, which every build of a kernel computes bit for bit
// alike (the same math, rounded the same way). "sum" lines hash sums of
// squares, whose order of addition follows the block width, so they agree
// only between builds of the same width (the x86-64 and AArch64 baselines,
// four fp32 lanes each). NaNs hash as one value: x86 and ARM produce NaNs
// of different sign and payload.
//
// Usage: kernel_bits [isa]   (isa: baseline, avx2, avx512; --isas lists the
// ones this machine runs). Built with AMPFUSE_KERNEL_BITS_BASELINE, it runs
// the baseline kernels only and takes no argument.

#include <cinttypes>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ampfuse/multi_tensor.h"
#include "ampfuse/sdk/cpu.h"
#include "contract/cpu/kernels.h"
#include "fused/adagrad/adagrad_cpu.h"
#include "fused/adam/adam8_cpu.h"
#include "fused/adam/adam_cpu.h"
#include "fused/lamb/lamb_cpu.h"
#include "fused/rmsprop/rmsprop_cpu.h"
#include "fused/sgd/sgd_cpu.h"

namespace {

using ampfuse::Plan;
using ampfuse::ScalarType;
namespace fc = ampfuse::fused::cpu;
namespace fm = ampfuse::fused;  // the math shared by every build
namespace ec = ampfuse::cpu;

struct KernelSet {
  fc::AdamFn adam;
  fc::Adam8Fn adam8;
  fc::Quant8Fn quant8;
  fc::SgdFn sgd;
  fc::LambFn lamb_moments, lamb_apply;
  fc::RmspropFn rmsprop;
  fc::AdagradFn adagrad;
  ec::CheckFn check;
  ec::ScaleFn scale;
};

// splitmix64: the same numbers on every platform.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<std::uint64_t>(n)); }
};

// What a list's elements are drawn from.
enum class Dist {
  kSigned,    // normal numbers of either sign, |x| in [2^-12, 2^3), a few subnormals
  kPositive,  // the same, positive (second moments, sums)
  kSpecial,   // kSigned with infinities and NaNs here and there (grads of an overflowed step)
  kTiny,      // half subnormals, half the smallest normal numbers (|x| < 2^-106 in fp32)
};

struct Format {
  int bits, mantissa, bias;
};
Format format_of(ScalarType t) {
  switch (t) {
    case ScalarType::Float32: return {32, 23, 127};
    case ScalarType::Float16: return {16, 10, 15};
    case ScalarType::BFloat16: return {16, 7, 127};
    case ScalarType::Float64: break;
  }
  return {64, 52, 1023};
}

std::uint64_t draw(Rng& rng, ScalarType t, Dist dist) {
  const Format f = format_of(t);
  const std::uint64_t mantissa = rng.next() & ((std::uint64_t{1} << f.mantissa) - 1);
  const std::uint64_t all_ones = (std::uint64_t{1} << (f.bits - 1 - f.mantissa)) - 1;
  std::uint64_t sign = dist == Dist::kPositive ? 0 : rng.next() & 1;
  std::uint64_t exponent = static_cast<std::uint64_t>(f.bias - 12 + rng.below(15));
  const int roll = rng.below(97);
  if (roll == 0) exponent = 0;  // subnormal (or zero)
  if (dist == Dist::kSpecial && roll == 1) exponent = all_ones;  // inf or NaN
  if (dist == Dist::kTiny) exponent = roll % 2 == 0 ? 0 : static_cast<std::uint64_t>(1 + rng.below(20));
  sign <<= f.bits - 1;
  return sign | exponent << f.mantissa | mantissa;
}

// One list of tensors: storage per tensor and the pointer array a kernel takes.
struct List {
  std::vector<std::vector<unsigned char>> tensors;
  std::vector<void*> ptrs;
  std::size_t element = 0;
  ScalarType dtype = ScalarType::Float32;
  bool floating = true;  // false: bytes (8-bit codes)
};

List make_list(Rng& rng, const std::vector<std::int64_t>& numels, ScalarType t, Dist dist) {
  List l;
  l.dtype = t;
  l.element = ampfuse::element_size(t);
  for (const std::int64_t n : numels) {
    std::vector<unsigned char> data(static_cast<std::size_t>(n) * l.element + 1);  // never empty
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint64_t bits = draw(rng, t, dist);
      std::memcpy(data.data() + i * l.element, &bits, l.element);  // little-endian on both
    }
    l.tensors.push_back(std::move(data));
  }
  for (auto& d : l.tensors) l.ptrs.push_back(d.data());
  return l;
}

List make_bytes(Rng& rng, const std::vector<std::int64_t>& numels) {
  List l;
  l.element = 1;
  l.floating = false;
  for (const std::int64_t n : numels) {
    std::vector<unsigned char> data(static_cast<std::size_t>(n) + 1);
    for (auto& b : data) b = static_cast<unsigned char>(rng.next());
    l.tensors.push_back(std::move(data));
  }
  for (auto& d : l.tensors) l.ptrs.push_back(d.data());
  return l;
}

// Positive fp32 scales (absmax), one per 256-element block; `nan_block`
// puts a NaN into one block of the first tensor.
List make_absmax(Rng& rng, const std::vector<std::int64_t>& numels, bool nan_block) {
  List l;
  l.element = 4;
  for (const std::int64_t n : numels) {
    const std::int64_t blocks = (n + fm::kQuantBlock - 1) / fm::kQuantBlock;
    std::vector<unsigned char> data(static_cast<std::size_t>(blocks) * 4 + 1);
    for (std::int64_t b = 0; b < blocks; ++b) {
      float x = static_cast<float>(1 + rng.below(1000)) / 1024.0f;
      if (nan_block && l.tensors.empty() && b == 1) x = __builtin_nanf("");
      std::memcpy(data.data() + b * 4, &x, 4);
    }
    l.tensors.push_back(std::move(data));
  }
  for (auto& d : l.tensors) l.ptrs.push_back(d.data());
  return l;
}

struct Hash {
  std::uint64_t h = 0xCBF29CE484222325ull;
  std::int64_t elements = 0, nans = 0;  // of floating-point lists
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  }
  void element(const unsigned char* p, const List& l) {
    if (!l.floating) return bytes(p, l.element);
    std::uint64_t bits = 0;
    std::memcpy(&bits, p, l.element);
    const Format f = format_of(l.dtype);
    const std::uint64_t exponent_mask = ((std::uint64_t{1} << (f.bits - 1 - f.mantissa)) - 1) << f.mantissa;
    const std::uint64_t mantissa_mask = (std::uint64_t{1} << f.mantissa) - 1;
    ++elements;
    if ((bits & exponent_mask) == exponent_mask && (bits & mantissa_mask) != 0) {
      bits = ~std::uint64_t{0};
      ++nans;
    }
    bytes(&bits, sizeof bits);
  }
  // fp64 sums, NaNs as one value (a chunk with inf or NaN sums to either).
  void sums(const std::vector<double>& xs) {
    List f64;
    f64.dtype = ScalarType::Float64;
    f64.element = 8;
    for (const double& x : xs) element(reinterpret_cast<const unsigned char*>(&x), f64);
  }
  void list(const List& l, const std::vector<std::int64_t>& numels) {
    for (std::size_t t = 0; t < l.tensors.size(); ++t)
      for (std::int64_t i = 0; i < numels[t]; ++i) element(l.tensors[t].data() + i * l.element, l);
  }
};

void print(const char* kind, const std::string& name, const Hash& h) {
  std::printf("%s %s %016" PRIx64 "\n", kind, name.c_str(), h.h);
}

[[noreturn]] void fail(const std::string& name, const char* why) {
  std::fprintf(stderr, "kernel_bits: %s: %s\n", name.c_str(), why);
  std::exit(1);
}

// An update's results, hashed after the kernel ran: a kernel that wrote
// nothing, or NaNs (from inputs no optimizer sees), would make every build
// agree, so this program fails instead.
void print_update(const std::string& name, const Hash& before, const Hash& after) {
  if (before.h == after.h) fail(name, "the kernel changed none of its results");
  if (after.nans * 100 > after.elements) fail(name, "more than 1% of the results are NaN");
  print("exact", name, after);
}

// Sizes that reach every path of a block walk: tails of every length, whole
// unrolled blocks, a tensor over two chunks (64 Ki elements each).
const std::vector<std::int64_t> kSizes = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 100, 257, 1000, 4099, 70001};
// FusedAdam's 8-bit moments: 4096 elements and more, whole and partial 256-element blocks.
const std::vector<std::int64_t> kSizes8 = {4096, 4099, 4351, 5000, 70001};

const ScalarType kAll[] = {ScalarType::Float32, ScalarType::Float16, ScalarType::BFloat16, ScalarType::Float64};

const char* dtype_name(ScalarType t) { return ampfuse::to_string(t); }

std::string suffix(bool b, const char* name) { return b ? std::string("_") + name : std::string(); }

void run_check_scale(const KernelSet& k, Rng& rng) {
  const Plan plan(kSizes, ampfuse::sdk::cpu::kChunkSize);
  const auto ref = ampfuse::sdk::cpu::plan_ref(plan);
  const std::size_t chunks = static_cast<std::size_t>(plan.num_chunks());
  for (const ScalarType t : kAll)
    for (const bool special : {false, true}) {
      const std::string name = std::string("check_") + dtype_name(t) + suffix(special, "special");
      List data = make_list(rng, kSizes, t, special ? Dist::kSpecial : Dist::kSigned);
      std::vector<unsigned char> flags(chunks);
      std::vector<double> sums(chunks);
      k.check({ref, data.ptrs.data(), t, flags.data(), sums.data()}, 0, plan.num_chunks());
      Hash f, s;
      f.bytes(flags.data(), flags.size());
      s.sums(sums);
      const bool flagged = std::any_of(flags.begin(), flags.end(), [](unsigned char x) { return x != 0; });
      if (flagged != special) fail(name, special ? "no chunk flagged" : "a chunk of finite values flagged");
      if (!special && !(sums[0] > 0.0)) fail(name, "no sum of squares");
      print("exact", name + "_flags", f);
      print("sum", name + "_sum_sq", s);
      Hash before;
      before.list(data, kSizes);
      std::vector<unsigned char> scale_flags(chunks);
      k.scale({ref, data.ptrs.data(), t, 0.75f / 65536.0f, scale_flags.data()}, 0, plan.num_chunks());
      Hash d;
      d.list(data, kSizes);
      d.bytes(scale_flags.data(), scale_flags.size());
      if (before.h == d.h) fail(name, "scale changed nothing");
      print("exact", "scale_" + name.substr(6), d);
    }
}

void run_adam(const KernelSet& k, Rng& rng) {
  const Plan plan(kSizes, ampfuse::sdk::cpu::kChunkSize);
  const auto ref = ampfuse::sdk::cpu::plan_ref(plan);
  struct Config {
    ScalarType param, state;
    bool master;
  };
  const Config configs[] = {{ScalarType::Float32, ScalarType::Float32, false},
                            {ScalarType::Float16, ScalarType::Float32, true},
                            {ScalarType::BFloat16, ScalarType::Float32, true},
                            {ScalarType::BFloat16, ScalarType::BFloat16, false},
                            {ScalarType::Float16, ScalarType::Float16, false},
                            {ScalarType::Float64, ScalarType::Float64, false}};
  for (const Config& c : configs)
    for (int variant = 0; variant < 4; ++variant) {
      const bool amsgrad = variant == 1, adamw = variant == 2, l2 = variant == 3;
      auto hyper = fm::make_adam_hyper(1e-3, 0.9, 0.999, 1e-8, adamw || l2 ? 0.01 : 0.0, amsgrad, l2, adamw);
      std::vector<fm::AdamStepScalars> scalars;
      for (std::size_t t = 0; t < kSizes.size(); ++t)
        scalars.push_back(fm::adam_step_scalars(1e-3, 0.9, 0.999, static_cast<double>(1 + 7 * t)));
      List p = make_list(rng, kSizes, c.param, Dist::kSigned), g = make_list(rng, kSizes, c.param, Dist::kSigned),
           m = make_list(rng, kSizes, c.state, Dist::kSigned), v = make_list(rng, kSizes, c.state, Dist::kPositive),
           vmax = make_list(rng, kSizes, c.state, Dist::kPositive),
           master = make_list(rng, kSizes, ScalarType::Float32, Dist::kSigned);
      fc::AdamArgs a{ref,
                     p.ptrs.data(),
                     g.ptrs.data(),
                     m.ptrs.data(),
                     v.ptrs.data(),
                     amsgrad ? vmax.ptrs.data() : nullptr,
                     c.master ? master.ptrs.data() : nullptr,
                     c.param,
                     c.state,
                     scalars.data(),
                     hyper,
                     variant == 0 ? 1.0 : 3.0 / 65536.0};
      Hash before, h;
      for (const List* l : {&p, &m, &v, &vmax, &master}) before.list(*l, kSizes);
      k.adam(a, 0, plan.num_chunks());
      for (const List* l : {&p, &m, &v, &vmax, &master}) h.list(*l, kSizes);
      print_update(std::string("adam_") + dtype_name(c.param) + "_" + dtype_name(c.state) + suffix(c.master, "master") +
                suffix(amsgrad, "amsgrad") + suffix(adamw, "adamw") + suffix(l2, "l2_maximize"),
            before, h);
    }
}

void run_adam8(const KernelSet& k, Rng& rng) {
  const Plan plan(kSizes8, ampfuse::sdk::cpu::kChunkSize);
  const auto ref = ampfuse::sdk::cpu::plan_ref(plan);
  for (const ScalarType t : {ScalarType::Float32, ScalarType::Float16, ScalarType::BFloat16})
    for (int variant = 0; variant < 3; ++variant) {
      const bool master = t != ScalarType::Float32 && variant != 2, adamw = variant == 1, nan_block = variant == 2;
      auto hyper = fm::make_adam_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, false, false, adamw);
      std::vector<fm::AdamStepScalars> scalars;
      for (std::size_t i = 0; i < kSizes8.size(); ++i)
        scalars.push_back(fm::adam_step_scalars(1e-3, 0.9, 0.999, static_cast<double>(3 + 11 * i)));
      List p = make_list(rng, kSizes8, t, Dist::kSigned), g = make_list(rng, kSizes8, t, Dist::kSigned),
           mp = make_list(rng, kSizes8, ScalarType::Float32, Dist::kSigned), m = make_bytes(rng, kSizes8),
           v = make_bytes(rng, kSizes8), m_absmax = make_absmax(rng, kSizes8, nan_block),
           v_absmax = make_absmax(rng, kSizes8, false);
      std::vector<std::uint8_t*> m_codes, v_codes;
      std::vector<float*> m_scales, v_scales;
      for (std::size_t i = 0; i < kSizes8.size(); ++i) {
        m_codes.push_back(static_cast<std::uint8_t*>(m.ptrs[i]));
        v_codes.push_back(static_cast<std::uint8_t*>(v.ptrs[i]));
        m_scales.push_back(static_cast<float*>(m_absmax.ptrs[i]));
        v_scales.push_back(static_cast<float*>(v_absmax.ptrs[i]));
      }
      fc::Adam8Args a{ref,          p.ptrs.data(),     g.ptrs.data(), master ? mp.ptrs.data() : nullptr,
                      m_codes.data(), m_scales.data(), v_codes.data(), v_scales.data(),
                      t,            scalars.data(),    hyper,         variant == 0 ? 1.0 : 1.0 / 1024.0};
      const auto hash = [&] {
        Hash h;
        for (const List* l : {&p, &mp, &m, &v}) h.list(*l, kSizes8);
        for (std::size_t i = 0; i < kSizes8.size(); ++i) {
          const std::int64_t blocks = (kSizes8[i] + fm::kQuantBlock - 1) / fm::kQuantBlock;
          h.bytes(m_absmax.tensors[i].data(), static_cast<std::size_t>(blocks) * 4);
          h.bytes(v_absmax.tensors[i].data(), static_cast<std::size_t>(blocks) * 4);
        }
        return h;
      };
      const Hash before = hash();
      k.adam8(a, 0, plan.num_chunks());
      print_update(std::string("adam8_") + dtype_name(t) + suffix(master, "master") + suffix(adamw, "adamw") +
                suffix(nan_block, "nan_absmax"),
            before, hash());
    }
  // Coding fp32 moments (a checkpoint's, or a tensor growing past 4096 elements).
  for (const bool is_signed : {true, false}) {
    const std::int64_t n = 70001;
    List src = make_list(rng, {n}, ScalarType::Float32, is_signed ? Dist::kSigned : Dist::kPositive);
    List codes = make_bytes(rng, {n});
    const std::int64_t blocks = (n + fm::kQuantBlock - 1) / fm::kQuantBlock;
    std::vector<float> absmax(static_cast<std::size_t>(blocks));
    Hash before, h;
    before.list(codes, {n});
    before.bytes(absmax.data(), absmax.size() * 4);
    k.quant8({static_cast<const float*>(src.ptrs[0]), static_cast<std::uint8_t*>(codes.ptrs[0]), absmax.data(), n,
              is_signed},
             0, blocks);
    h.list(codes, {n});
    h.bytes(absmax.data(), absmax.size() * 4);
    print_update(std::string("quant8_") + (is_signed ? "signed" : "unsigned"), before, h);
  }
}

void run_sgd(const KernelSet& k, Rng& rng) {
  const Plan plan(kSizes, ampfuse::sdk::cpu::kChunkSize);
  const auto ref = ampfuse::sdk::cpu::plan_ref(plan);
  for (const ScalarType t : kAll)
    for (int variant = 0; variant < 4; ++variant) {
      fm::SgdHyper h;
      h.neg_lr = -0.01;
      h.momentum = variant == 0 ? 0.0 : 0.9;
      h.use_momentum = variant != 0;
      h.one_minus_dampening = variant == 2 ? 0.75 : 1.0;
      h.weight_decay = variant >= 2 ? 1e-4 : 0.0;
      h.nesterov = variant == 3;
      h.maximize = variant == 2;
      List p = make_list(rng, kSizes, t, Dist::kSigned), g = make_list(rng, kSizes, t, Dist::kSigned),
           buf = make_list(rng, kSizes, t, Dist::kSigned);
      std::vector<unsigned char> first(kSizes.size());
      for (std::size_t i = 0; i < first.size(); ++i) first[i] = i % 3 == 0;
      const auto hash = [&] {
        Hash h;
        h.list(p, kSizes);
        if (variant != 0) h.list(buf, kSizes);
        return h;
      };
      const Hash before = hash();
      k.sgd({ref, p.ptrs.data(), g.ptrs.data(), variant == 0 ? nullptr : buf.ptrs.data(), first.data(), t, h,
             variant == 1 ? 1.0 / 65536.0 : 1.0},
            0, plan.num_chunks());
      print_update(std::string("sgd_") + dtype_name(t) + "_" + std::to_string(variant), before, hash());
    }
}

void run_lamb(const KernelSet& k, Rng& rng) {
  const Plan plan(kSizes, ampfuse::sdk::cpu::kChunkSize);
  const auto ref = ampfuse::sdk::cpu::plan_ref(plan);
  const std::size_t chunks = static_cast<std::size_t>(plan.num_chunks());
  for (const ScalarType t : kAll)
    for (const bool master : {false, true}) {
      if (master && (t == ScalarType::Float32 || t == ScalarType::Float64)) continue;
      const ScalarType state = t == ScalarType::Float64 ? t : ScalarType::Float32;
      fm::LambHyper h;
      std::vector<fm::LambStepScalars> scalars;
      std::vector<double> neg_step;
      for (std::size_t i = 0; i < kSizes.size(); ++i) {
        const double step = static_cast<double>(1 + 5 * i);
        scalars.push_back({1.0 - std::pow(0.9, step), 1.0 - std::pow(0.999, step)});
        neg_step.push_back(-1e-3 * (0.5 + static_cast<double>(i) / 16.0));
      }
      List p = make_list(rng, kSizes, t, Dist::kSigned), g = make_list(rng, kSizes, t, Dist::kSigned),
           m = make_list(rng, kSizes, state, Dist::kSigned), v = make_list(rng, kSizes, state, Dist::kPositive),
           mp = make_list(rng, kSizes, ScalarType::Float32, Dist::kSigned);
      std::vector<double> param_sq(chunks), update_sq(chunks);
      fc::LambArgs a{ref, p.ptrs.data(), g.ptrs.data(), m.ptrs.data(), v.ptrs.data(),
                     master ? mp.ptrs.data() : nullptr, t, scalars.data(), h, 0.5, param_sq.data(),
                     update_sq.data(), neg_step.data()};
      Hash before, e, s;
      for (const List* l : {&p, &m, &v, &mp}) before.list(*l, kSizes);
      k.lamb_moments(a, 0, plan.num_chunks());
      k.lamb_apply(a, 0, plan.num_chunks());
      for (const List* l : {&p, &m, &v, &mp}) e.list(*l, kSizes);
      s.sums(param_sq);
      s.sums(update_sq);
      const std::string name = std::string("lamb_") + dtype_name(t) + suffix(master, "master");
      if (!(param_sq[0] > 0.0 && update_sq[0] > 0.0)) fail(name, "no sums of squares");
      print_update(name, before, e);
      print("sum", name + "_sum_sq", s);
    }
}

void run_rmsprop(const KernelSet& k, Rng& rng) {
  const Plan plan(kSizes, ampfuse::sdk::cpu::kChunkSize);
  const auto ref = ampfuse::sdk::cpu::plan_ref(plan);
  for (const ScalarType t : kAll)
    for (int variant = 0; variant < 4; ++variant) {
      fm::RmspropHyper h;
      h.neg_lr = -0.01;
      h.momentum = variant >= 2 ? 0.9 : 0.0;
      h.use_momentum = variant >= 2;
      h.centered = variant == 1 || variant == 3;
      h.weight_decay = variant == 3 ? 1e-4 : 0.0;
      h.maximize = variant == 3;
      List p = make_list(rng, kSizes, t, Dist::kSigned), g = make_list(rng, kSizes, t, Dist::kSigned),
           sq = make_list(rng, kSizes, t, Dist::kPositive), buf = make_list(rng, kSizes, t, Dist::kSigned),
           avg = make_list(rng, kSizes, t, Dist::kSigned);
      // Centered: square_avg - grad_avg^2 stays positive.
      if (h.centered)
        for (std::size_t i = 0; i < kSizes.size(); ++i) std::memset(avg.tensors[i].data(), 0, avg.tensors[i].size());
      fc::RmspropArgs a{};
      a.plan = ref;
      a.lists[0] = p.ptrs.data();
      a.lists[1] = g.ptrs.data();
      a.lists[2] = sq.ptrs.data();
      a.lists[3] = h.use_momentum ? buf.ptrs.data() : nullptr;
      a.lists[4] = h.centered ? avg.ptrs.data() : nullptr;
      a.dtype = t;
      a.hyper = h;
      a.grad_factor = variant == 2 ? 1.0 / 4096.0 : 1.0;
      Hash before, hash;
      for (const List* l : {&p, &sq, &buf, &avg}) before.list(*l, kSizes);
      k.rmsprop(a, 0, plan.num_chunks());
      for (const List* l : {&p, &sq, &buf, &avg}) hash.list(*l, kSizes);
      print_update(std::string("rmsprop_") + dtype_name(t) + "_" + std::to_string(variant), before, hash);
    }
}

void run_adagrad(const KernelSet& k, Rng& rng) {
  const Plan plan(kSizes, ampfuse::sdk::cpu::kChunkSize);
  const auto ref = ampfuse::sdk::cpu::plan_ref(plan);
  for (const ScalarType t : kAll)
    for (int variant = 0; variant < 2; ++variant) {
      fm::AdagradHyper h;
      h.weight_decay = variant == 1 ? 1e-4 : 0.0;
      h.maximize = variant == 1;
      h.lr_decay = variant == 1 ? 0.01 : 0.0;
      std::vector<double> neg_clr;
      for (std::size_t i = 0; i < kSizes.size(); ++i)
        neg_clr.push_back(fm::adagrad_neg_clr(h, static_cast<double>(1 + 3 * i)));
      List p = make_list(rng, kSizes, t, Dist::kSigned), g = make_list(rng, kSizes, t, Dist::kSigned),
           sum = make_list(rng, kSizes, t, Dist::kPositive);
      Hash before, hash;
      before.list(p, kSizes);
      before.list(sum, kSizes);
      k.adagrad({ref, p.ptrs.data(), g.ptrs.data(), sum.ptrs.data(), neg_clr.data(), t, h,
                 variant == 1 ? 1.0 / 65536.0 : 1.0},
                0, plan.num_chunks());
      hash.list(p, kSizes);
      hash.list(sum, kSizes);
      print_update(std::string("adagrad_") + dtype_name(t) + "_" + std::to_string(variant), before, hash);
    }
}

// Adam on moments and grads near the bottom of the exponent range, with
// subnormals flushed (FlushSubnormals: DAZ and FTZ on x86-64, FPCR.FZ on
// AArch64), which must change the results, and the same on every build.
void run_flushed(const KernelSet& k, std::uint64_t seed) {
  const Plan plan(kSizes, ampfuse::sdk::cpu::kChunkSize);
  const auto ref = ampfuse::sdk::cpu::plan_ref(plan);
  for (const ScalarType t : kAll) {
    const bool master = t == ScalarType::Float16;
    const ScalarType state = t == ScalarType::Float64 ? t : ScalarType::Float32;
    const auto run = [&](bool flush) {
      Rng rng{seed + static_cast<std::uint64_t>(t)};  // the same inputs for both runs
      List p = make_list(rng, kSizes, t, Dist::kTiny), g = make_list(rng, kSizes, t, Dist::kTiny),
           m = make_list(rng, kSizes, state, Dist::kTiny), v = make_list(rng, kSizes, state, Dist::kTiny),
           mp = make_list(rng, kSizes, ScalarType::Float32, Dist::kTiny);
      for (auto& tensor : v.tensors)  // second moments are not negative
        for (std::size_t i = 0; i + v.element <= tensor.size(); i += v.element) tensor[i + v.element - 1] &= 0x7F;
      std::vector<fm::AdamStepScalars> scalars(kSizes.size(), fm::adam_step_scalars(1e-3, 0.9, 0.999, 100.0));
      const fc::AdamArgs a{ref, p.ptrs.data(), g.ptrs.data(), m.ptrs.data(), v.ptrs.data(), nullptr,
                           master ? mp.ptrs.data() : nullptr, t, state, scalars.data(),
                           fm::make_adam_hyper(1e-3, 0.9, 0.999, 1e-30, 0.0, false, false, false), 0.5};
      {
        std::unique_ptr<ampfuse::sdk::cpu::FlushSubnormals> flushing;
        if (flush) flushing = std::make_unique<ampfuse::sdk::cpu::FlushSubnormals>();
        k.adam(a, 0, plan.num_chunks());
      }
      Hash h;
      for (const List* l : {&p, &m, &v, &mp}) h.list(*l, kSizes);
      return h;
    };
    const std::string name = std::string("flushed_adam_") + dtype_name(t) + suffix(master, "master");
    const Hash ieee = run(false), flushed = run(true);
    if (ieee.h == flushed.h) fail(name, "flushing subnormals changed nothing");
    print("exact", name, flushed);
  }
}

KernelSet kernels_in_use() {
#if defined(AMPFUSE_KERNEL_BITS_BASELINE)
  namespace b = fc::baseline;
  return {b::kAdam, b::kAdam8, b::kQuant8, b::kSgd, b::kLambMoments, b::kLambApply,
          b::kRmsprop, b::kAdagrad, ec::baseline::kKernels.check, ec::baseline::kKernels.scale};
#else
  return {fc::adam_kernel(),         fc::adam8_kernel(),         fc::quant8_kernel(),   fc::sgd_kernel(),
          fc::lamb_moments_kernel(), fc::lamb_apply_kernel(),    fc::rmsprop_kernel(),  fc::adagrad_kernel(),
          ec::kernels().check,       ec::kernels().scale};
#endif
}

}  // namespace

int main(int argc, char** argv) {
#if !defined(AMPFUSE_KERNEL_BITS_BASELINE)
  if (argc > 1 && std::strcmp(argv[1], "--isas") == 0) {
    for (const std::string& isa : ec::available_isas()) std::printf("%s\n", isa.c_str());
    return 0;
  }
  ampfuse::sdk::cpu::force_isa(argc > 1 ? argv[1] : "baseline");
#else
  (void)argc;
  (void)argv;
#endif
  const KernelSet k = kernels_in_use();
  Rng rng{20261204};
  run_check_scale(k, rng);
  run_adam(k, rng);
  run_adam8(k, rng);
  run_sgd(k, rng);
  run_lamb(k, rng);
  run_rmsprop(k, rng);
  run_adagrad(k, rng);
  ampfuse::sdk::cpu::keep_subnormals(false);  // whatever AMPFUSE_KEEP_SUBNORMALS says
  run_flushed(k, rng.next());
  return 0;
}
