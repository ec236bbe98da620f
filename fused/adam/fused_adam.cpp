// Torch adapter of FusedAdam / FusedAdamW: validation, state, grouping by
// (group, device, dtype), and the CPU or CUDA kernel per list.

#include "ampfuse/fused_adam.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>

#include "ampfuse/tensor_ops.h"
#include "contract/cpu/kernels.h"
#include "fused/adam/adam8_cpu.h"
#include "fused/adam/adam_cpu.h"

#if defined(AMPFUSE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "contract/cuda/launch.h"
#include "fused/adam/adam8_cuda.h"
#include "fused/adam/adam_cuda.h"
#endif

namespace ampfuse {

namespace {

// The version of the 8-bit code a checkpoint's bytes are in, saved under
// "code_8bit" beside them. 2: the tapered maps of fused/adam/adam8_math.h.
// 1 (no "code_8bit" key: ampfuse before December 2026): plain minifloats,
// exp_avg a sign, a 4-bit exponent and 3 mantissa bits, exp_avg_sq a 5-bit
// exponent and 3 mantissa bits, subnormals, 1.0 the largest value.
constexpr std::int64_t kCode8Version = 2;

// value(magnitude code) of version 1's maps, exact.
float version1_value(std::uint32_t mag, bool is_signed) {
  const int bias = is_signed ? 15 : 31, e = static_cast<int>(mag >> 3), f = static_cast<int>(mag & 7u);
  return e == 0 ? std::ldexp(static_cast<float>(f), -bias - 2) : std::ldexp(1.0f + static_cast<float>(f) / 8.0f, e - bias);
}

// Version 1 bytes, decoded by its map and coded again by today's (the
// moments then carry one more rounding). Left alone when they are not well
// formed: the load's checks refuse them, naming the key.
void recode_version1(at::Tensor& codes, at::Tensor& absmax, Moment8 which) {
  if (!codes.defined() || !absmax.defined() || codes.scalar_type() != at::kByte || !codes.is_non_overlapping_and_dense() ||
      absmax.scalar_type() != at::kFloat || absmax.dim() != 1 || absmax.numel() != fused::quant_blocks(codes.numel()))
    return;
  const bool is_signed = which == Moment8::kExpAvg;
  const at::Tensor c = codes.cpu(), a = absmax.cpu().contiguous();
  // damaged (check_codes refuses it); a NaN absmax, which a step on a NaN grad makes, stays NaN
  if ((a < 0).any().item<bool>() || a.isinf().any().item<bool>()) return;
  at::Tensor values = at::empty_like(c, c.options().dtype(at::kFloat), at::MemoryFormat::Preserve);
  const std::uint8_t* cp = c.data_ptr<std::uint8_t>();
  const float* ap = a.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  for (std::int64_t k = 0; k < c.numel(); ++k) {  // storage order, as the blocks are
    const std::uint32_t mag = is_signed ? cp[k] & 0x7Fu : cp[k];
    const float v = version1_value(mag, is_signed) * ap[k / fused::kQuantBlock];
    vp[k] = is_signed && (cp[k] & 0x80u) != 0 ? -v : v;
  }
  Coded8 again = quantize_8bit(values, which);
  codes = again.codes.to(codes.device());
  absmax = again.absmax.to(absmax.device());
}

}  // namespace

template <class BaseState>
void FusedAdamParamStateT<BaseState>::serialize(torch::serialize::OutputArchive& archive) const {
  sdk::save_counted<BaseState>(*this, archive);
  if (master().defined()) archive.write("master", master());
  for (const auto& [key, t] : {std::pair<const char*, const at::Tensor*>{"exp_avg_8bit", &exp_avg_8bit()},
                                {"exp_avg_absmax", &exp_avg_absmax()},
                                {"exp_avg_sq_8bit", &exp_avg_sq_8bit()},
                                {"exp_avg_sq_absmax", &exp_avg_sq_absmax()}})
    if (t->defined()) archive.write(key, *t);
  if (exp_avg_8bit().defined() || exp_avg_sq_8bit().defined()) archive.write("code_8bit", c10::IValue(kCode8Version));
}

template <class BaseState>
void FusedAdamParamStateT<BaseState>::serialize(torch::serialize::InputArchive& archive) {
  BaseState::serialize(archive);
  // A fresh tensor per key: try_read into a defined tensor would set_ it in place.
  auto read = [&archive](const char* key) {
    at::Tensor saved;
    archive.try_read(key, saved);
    return saved;
  };
  if (at::Tensor t = read("master"); t.defined()) master(t);
  at::Tensor m = read("exp_avg_8bit"), m_absmax = read("exp_avg_absmax");
  at::Tensor v = read("exp_avg_sq_8bit"), v_absmax = read("exp_avg_sq_absmax");
  c10::IValue version;
  if (!archive.try_read("code_8bit", version)) {
    recode_version1(m, m_absmax, Moment8::kExpAvg);
    recode_version1(v, v_absmax, Moment8::kExpAvgSq);
  } else {
    TORCH_CHECK(version.isInt() && version.toInt() == kCode8Version, "code_8bit is ", version,
                ": 8-bit moments of a code this ampfuse does not know (it reads ", kCode8Version,
                ", and checkpoints without the key as 1)");
  }
  exp_avg_8bit(m);
  exp_avg_absmax(m_absmax);
  exp_avg_sq_8bit(v);
  exp_avg_sq_absmax(v_absmax);
}

template struct FusedAdamParamStateT<torch::optim::AdamParamState>;
template struct FusedAdamParamStateT<torch::optim::AdamWParamState>;

namespace detail {

struct FusedAdamWorkspace {
#if defined(AMPFUSE_WITH_CUDA)
  sdk::TicketCounters counters;
#endif
  sdk::DeviceScalars lr;  ///< capturable: the fp64 device lr per (group, device)
};

}  // namespace detail

namespace {

// The moments' dtype: the param's (as LibTorch), fp32 with master weights, or bf16.
c10::ScalarType state_dtype(const at::Tensor& p, const FusedAdamOptions& fused) {
  if (fused.bf16_moments()) return at::kBFloat16;
  return fused.master_weights() ? at::kFloat : p.scalar_type();
}

constexpr const char* optimizer_name(bool decoupled) { return decoupled ? "FusedAdamW" : "FusedAdam"; }

template <class State>
bool holds_coded(const State& s) {
  return s.exp_avg_8bit().defined() || s.exp_avg_absmax().defined() || s.exp_avg_sq_8bit().defined() ||
         s.exp_avg_sq_absmax().defined();
}

// exp_avg / exp_avg_sq into codes (the parameter's strides: the moments have them).
template <class State>
void code_moments(State& s) {
  Coded8 m = quantize_8bit(s.exp_avg(), Moment8::kExpAvg);
  Coded8 v = quantize_8bit(s.exp_avg_sq(), Moment8::kExpAvgSq);
  s.exp_avg_8bit(std::move(m.codes));
  s.exp_avg_absmax(std::move(m.absmax));
  s.exp_avg_sq_8bit(std::move(v.codes));
  s.exp_avg_sq_absmax(std::move(v.absmax));
  s.exp_avg(at::Tensor());
  s.exp_avg_sq(at::Tensor());
}

// The codes back into exp_avg / exp_avg_sq of `dtype`.
template <class State>
void decode_moments(State& s, c10::ScalarType dtype) {
  s.exp_avg(dequantize_8bit(s.exp_avg_8bit(), s.exp_avg_absmax(), Moment8::kExpAvg).to(dtype));
  s.exp_avg_sq(dequantize_8bit(s.exp_avg_sq_8bit(), s.exp_avg_sq_absmax(), Moment8::kExpAvgSq).to(dtype));
  s.exp_avg_8bit(at::Tensor());
  s.exp_avg_absmax(at::Tensor());
  s.exp_avg_sq_8bit(at::Tensor());
  s.exp_avg_sq_absmax(at::Tensor());
}

void check_code_values(const at::Tensor& codes, const at::Tensor& absmax, const char* name, const char* codes_key,
                       const char* absmax_key, std::size_t g, std::size_t i, bool loading);

void check_codes(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& p, const char* name,
                 const char* codes_key, const char* absmax_key, std::size_t g, std::size_t i, bool loading) {
  sdk::check_required_state_tensor(codes, p, at::kByte, name, codes_key, g, i);
  TORCH_CHECK(absmax.defined(), name, ": param group ", g, ", param ", i, ": state ", absmax_key, " is missing (", codes_key,
              " is there; a damaged checkpoint?)");
  const std::int64_t blocks = fused::quant_blocks(p.numel());
  TORCH_CHECK(absmax.dim() == 1 && absmax.numel() == blocks && absmax.scalar_type() == at::kFloat &&
                  absmax.device() == p.device() && absmax.is_contiguous(),
              name, ": param group ", g, ", param ", i, ": state ", absmax_key, " has shape ", absmax.sizes(), ", dtype ",
              absmax.scalar_type(), " on ", absmax.device(), " but ", name, " keeps it contiguous with shape [", blocks,
              "], dtype Float on ", p.device(), " (one per 256 elements)");
  check_code_values(codes, absmax, name, codes_key, absmax_key, g, i, loading);
}

// The values of codes and their absmax (laid out as check_codes asks, or
// in another layout of the parameter's shape, about to be decoded).
void check_code_values(const at::Tensor& codes, const at::Tensor& absmax, const char* name, const char* codes_key,
                       const char* absmax_key, std::size_t g, std::size_t i, bool loading) {
  const std::int64_t blocks = absmax.numel();
  // A negative absmax would decode a negative second moment (and its sqrt to
  // NaN). A loaded one is never inf either: a step keeps the largest finite
  // fp32 value for an inf (fused/adam/adam8_math.h). A NaN one is what a
  // step on a NaN grad makes (its block's moments are NaN): it loads as
  // saved, as fp32 Adam's NaN moments do. Read at load only on CUDA, where
  // waiting for the tensor costs nothing.
  if (absmax.is_cpu() || loading) {
    const at::Tensor host = absmax.cpu();
    const float* a = host.data_ptr<float>();
    for (std::int64_t b = 0; b < blocks; ++b) {
      TORCH_CHECK(!(a[b] < 0.0f), name, ": param group ", g, ", param ", i, ": state ", absmax_key, " holds ", a[b],
                  " at block ", b, "; an absmax is never negative (a damaged checkpoint?)");
      TORCH_CHECK(!loading || !std::isinf(a[b]), name, ": param group ", g, ", param ", i, ": state ", absmax_key,
                  " holds ", a[b], " at block ", b,
                  "; an absmax is never inf (a step keeps the largest finite value; a damaged checkpoint?)");
    }
  }
  // A loaded byte is one of the map's codes: exp_avg's magnitudes run to 126
  // (a sign bit above them), exp_avg_sq's to 254; 127 or 255 would decode
  // above the block's absmax.
  if (loading) {
    const bool is_signed = std::strcmp(codes_key, "exp_avg_8bit") == 0;
    const std::uint32_t top = is_signed ? fused::SignedMap8::kOne : fused::UnsignedMap8::kOne;
    const at::Tensor host = codes.cpu().contiguous();  // in the parameter's logical order
    const std::uint8_t* c = host.data_ptr<std::uint8_t>();
    const std::uint8_t* bad = std::find_if(c, c + host.numel(), [&](std::uint8_t byte) {
      return (is_signed ? byte & 0x7Fu : std::uint32_t{byte}) > top;
    });
    TORCH_CHECK(bad == c + host.numel(), name, ": param group ", g, ", param ", i, ": state ", codes_key,
                " holds the byte ", static_cast<int>(*bad), " at element ", bad - c,
                " (in the parameter's logical order); its codes run to ", top, is_signed ? " in magnitude" : "",
                " (a damaged checkpoint?)");
  }
}

}  // namespace

Coded8 quantize_8bit(const at::Tensor& x, Moment8 which) {
  TORCH_CHECK(x.defined() && x.layout() == at::kStrided && at::isFloatingType(x.scalar_type()),
              "quantize_8bit: x must be a strided floating-point tensor");
  at::Tensor src = at::empty_like(x, x.options().dtype(at::kFloat).device(at::kCPU), at::MemoryFormat::Preserve);
  src.copy_(x);
  const std::int64_t n = src.numel(), blocks = fused::quant_blocks(n);
  Coded8 out{at::empty_like(src, src.options().dtype(at::kByte), at::MemoryFormat::Preserve),
             at::empty({blocks}, src.options())};
  const fused::cpu::Quant8Args args{src.data_ptr<float>(), out.codes.data_ptr<std::uint8_t>(),
                                    out.absmax.data_ptr<float>(), n, which == Moment8::kExpAvg};
  const fused::cpu::Quant8Fn kernel = fused::cpu::quant8_kernel();
  at::parallel_for(0, blocks, 256, [&](std::int64_t b, std::int64_t e) {
    const sdk::cpu::FlushSubnormals flush;
    kernel(args, b, e);
  });
  if (!x.is_cpu()) {
    out.codes = out.codes.to(x.device());
    out.absmax = out.absmax.to(x.device());
  }
  return out;
}

at::Tensor dequantize_8bit(const at::Tensor& codes_in, const at::Tensor& absmax_in, Moment8 which) {
  TORCH_CHECK(codes_in.defined() && absmax_in.defined() && codes_in.scalar_type() == at::kByte &&
                  absmax_in.scalar_type() == at::kFloat && absmax_in.dim() == 1 &&
                  absmax_in.numel() == fused::quant_blocks(codes_in.numel()) && codes_in.is_non_overlapping_and_dense(),
              "dequantize_8bit: codes must be a dense Byte tensor and absmax a Float vector of one element per 256 codes");
  const at::Tensor codes = codes_in.cpu(), absmax = absmax_in.cpu().contiguous();
  at::Tensor out = at::empty_like(codes, codes.options().dtype(at::kFloat), at::MemoryFormat::Preserve);
  const std::uint8_t* c = codes.data_ptr<std::uint8_t>();
  const float* a = absmax.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const bool is_signed = which == Moment8::kExpAvg;
  at::parallel_for(0, codes.numel(), 1 << 16, [&](std::int64_t b, std::int64_t e) {
    const sdk::cpu::FlushSubnormals flush;  // as the step decodes
    for (std::int64_t k = b; k < e; ++k) {
      const float scale = a[k / fused::kQuantBlock];
      o[k] = is_signed ? fused::decode8<fused::SignedMap8>(c[k], scale) : fused::decode8<fused::UnsignedMap8>(c[k], scale);
    }
  });
  return codes_in.is_cpu() ? out : out.to(codes_in.device());
}

namespace detail {

template <class Base, class Options, class State, bool kDecoupled>
const char* FusedAdamImpl<Base, Options, State, kDecoupled>::name() const {
  return optimizer_name(kDecoupled);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::check_state(const at::Tensor& p, const State& st,
                                                                  std::size_t g, std::size_t i) const {
  check_adam_state(p, st, g, i, /*loading=*/false);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::check_loaded_state(const at::Tensor& p, const State& st,
                                                                         std::size_t g, std::size_t i) const {
  check_adam_state(p, st, g, i, /*loading=*/true);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::check_adam_state(const at::Tensor& p, const State& st,
                                                                       std::size_t g, std::size_t i,
                                                                       bool loading) const {
  const c10::ScalarType dtype = state_dtype(p, fused_);
  sdk::check_state_step(st.step(), name(), g, i);
  if (holds_coded(st)) {
    // 8-bit moments (of this optimizer, or of a checkpoint: the step codes or decodes them as its options ask).
    TORCH_CHECK(!st.exp_avg().defined() && !st.exp_avg_sq().defined(), name(), ": param group ", g, ", param ", i,
                ": state holds both exp_avg and exp_avg_8bit; it keeps one or the other (a damaged checkpoint?)");
    check_codes(st.exp_avg_8bit(), st.exp_avg_absmax(), p, name(), "exp_avg_8bit", "exp_avg_absmax", g, i, loading);
    check_codes(st.exp_avg_sq_8bit(), st.exp_avg_sq_absmax(), p, name(), "exp_avg_sq_8bit", "exp_avg_sq_absmax", g, i,
                loading);
  } else {
    sdk::check_required_state_tensor(st.exp_avg(), p, dtype, name(), "exp_avg", g, i);
    sdk::check_required_state_tensor(st.exp_avg_sq(), p, dtype, name(), "exp_avg_sq", g, i);
  }
  sdk::check_state_tensor(st.max_exp_avg_sq(), p, dtype, name(), "max_exp_avg_sq", g, i);
  sdk::check_state_tensor(st.master(), p, at::kFloat, name(), "master", g, i);
  sdk::check_device_step(st.device_step(), p, name(), g, i);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::follow_param(const at::Tensor& p, State& st,
                                                                   const sdk::Follow& follow) {
  const c10::ScalarType dtype = state_dtype(p, fused_);
  follow(st.exp_avg(), dtype);
  follow(st.exp_avg_sq(), dtype);
  follow(st.max_exp_avg_sq(), dtype);
  follow(st.master(), at::kFloat);
  follow.seen(st.device_step());  // (written by the kernels; never follows)
  for (at::Tensor* t : {&st.exp_avg_8bit(), &st.exp_avg_absmax(), &st.exp_avg_sq_8bit(), &st.exp_avg_sq_absmax()})
    follow.seen(*t);
  // Codes in another layout than the kernels walk (a checkpoint of a model
  // laid out otherwise since, or a parameter converted since the last
  // step): decoded in their saved memory order, then coded again in the
  // parameter's layout; where these options keep the moments decoded (a
  // 32-bit optimizer loading an 8-bit checkpoint), decoded into that layout
  // once, not coded again first. What check_codes would refuse for more
  // than its layout is left to it.
  const auto decodable = [&](const at::Tensor& codes, const at::Tensor& absmax) {
    return codes.defined() && absmax.defined() && codes.scalar_type() == at::kByte && codes.sizes() == p.sizes() &&
           codes.device() == p.device() && absmax.device() == p.device() && codes.is_non_overlapping_and_dense() &&
           absmax.scalar_type() == at::kFloat && absmax.dim() == 1 &&
           absmax.numel() == fused::quant_blocks(p.numel()) && absmax.is_contiguous();
  };
  const auto laid_out_otherwise = [&](const at::Tensor& codes) {
    return codes.strides() != c10::IntArrayRef(sdk::kernel_strides(p));
  };
  if (follow.records_only()) return;
  const bool first_ok = decodable(st.exp_avg_8bit(), st.exp_avg_absmax());
  const bool second_ok = decodable(st.exp_avg_sq_8bit(), st.exp_avg_sq_absmax());
  const bool keep_coded = coded_8bit(p) && p.scalar_type() != at::kDouble;
  const bool decode_both = !keep_coded && first_ok && second_ok && !st.exp_avg().defined() &&
                           !st.exp_avg_sq().defined() &&
                           (laid_out_otherwise(st.exp_avg_8bit()) || laid_out_otherwise(st.exp_avg_sq_8bit()));
  const auto recode = [&](at::Tensor& codes, at::Tensor& absmax, at::Tensor& decoded, Moment8 which, bool ok) {
    if (!ok || !(decode_both || laid_out_otherwise(codes))) return;
    follow.refuse_under_capture();  // (decoding reads the codes on the host)
    // Codes a checkpoint holds (load() follows too) are checked as load() checks codes before they are
    // decoded; a step's own pass these checks.
    const bool first = which == Moment8::kExpAvg;
    check_code_values(codes, absmax, name(), first ? "exp_avg_8bit" : "exp_avg_sq_8bit",
                      first ? "exp_avg_absmax" : "exp_avg_sq_absmax", follow.group(), follow.index(),
                      /*loading=*/true);
    const at::Tensor values = at::empty_strided(p.sizes(), sdk::kernel_strides(p), absmax.options());
    values.copy_(dequantize_8bit(codes, absmax, which));
    if (decode_both) {
      follow.replace(decoded, values.to(dtype));
      follow.replace(codes, at::Tensor());
      follow.replace(absmax, at::Tensor());
      return;
    }
    Coded8 coded = quantize_8bit(values, which);
    follow.replace(codes, std::move(coded.codes));
    follow.replace(absmax, std::move(coded.absmax));
  };
  recode(st.exp_avg_8bit(), st.exp_avg_absmax(), st.exp_avg(), Moment8::kExpAvg, first_ok);
  recode(st.exp_avg_sq_8bit(), st.exp_avg_sq_absmax(), st.exp_avg_sq(), Moment8::kExpAvgSq, second_ok);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::check_entries(const std::vector<sdk::Entry>& entries) const {
  if (fused_.moments_8bit()) {
    TORCH_CHECK(!fused_.bf16_moments(), name(), ": moments_8bit and bf16_moments both asked for; choose one");
    // (in every group, also when set between steps: amsgrad is the plan key)
    for (std::size_t g = 0; g < this->param_groups().size(); ++g)
      TORCH_CHECK(!this->options_of(g).amsgrad(), name(), ": param group ", g,
                  ": amsgrad with moments_8bit; 8-bit moments have no max_exp_avg_sq (turn one of them off)");
    for (const sdk::Entry& e : entries) {
      TORCH_CHECK(e.dtype != at::kDouble, name(), ": param group ", e.group, ", param ", e.index,
                  ": moments_8bit asked for on a Double parameter; Double parameters keep Double moments");
    }
  }
  if (!fused_.master_weights() && !fused_.bf16_moments()) return;
  for (const sdk::Entry& e : entries) {
    TORCH_CHECK(!fused_.master_weights() || (e.dtype != at::kFloat && e.dtype != at::kDouble), name(),
                ": param group ", e.group, ", param ", e.index, ": master_weights asked for on a ", e.dtype,
                " parameter; it is for Half and BFloat16 parameters");
    TORCH_CHECK(!fused_.bf16_moments() || e.dtype != at::kDouble, name(), ": param group ", e.group, ", param ",
                e.index, ": bf16_moments asked for on a Double parameter; Double parameters keep Double moments");
  }
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::load_extra(torch::serialize::InputArchive& archive,
                                                                 const at::Tensor& p, std::size_t g, std::size_t i,
                                                                 State& state) {
  // Moments in fp32 where these options keep fp16 or bf16 ones, or the
  // reverse (a torch::optim::Adam checkpoint of bf16 parameters, whose
  // moments are bf16, loaded with master_weights, which keeps fp32 moments):
  // converted, as torch::optim steps moments of any dtype. (Double moments
  // for a parameter that is not Double stay refused, by check_state.)
  const c10::ScalarType want = state_dtype(p, fused_);
  const auto converted = [&](const at::Tensor& t) {
    const bool convert = t.defined() && t.layout() == at::kStrided && at::isReducedFloatingType(want) !=
                             at::isReducedFloatingType(t.scalar_type()) &&
                         (t.scalar_type() == at::kFloat || want == at::kFloat) && t.sizes() == p.sizes() &&
                         t.device() == p.device();
    return convert ? t.to(want) : t;
  };
  state.exp_avg(converted(state.exp_avg()));
  state.exp_avg_sq(converted(state.exp_avg_sq()));
  state.max_exp_avg_sq(converted(state.max_exp_avg_sq()));
  // Checkpoints written before the master copy moved into the state keep it
  // under a top-level key per parameter (check_state validates it).
  at::Tensor saved;
  if (state.master().defined() ||
      !archive.try_read("ampfuse_master_weights_" + std::to_string(g) + "_" + std::to_string(i), saved))
    return;
  state.master(saved.device() == p.device() ? saved : saved.to(p.device()));
}

template <class Base, class Options, class State, bool kDecoupled>
std::vector<std::string> FusedAdamImpl<Base, Options, State, kDecoupled>::saved_state_keys() const {
  return {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master",
          "exp_avg_8bit", "exp_avg_absmax", "exp_avg_sq_8bit", "exp_avg_sq_absmax", "code_8bit"};
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::after_load(const at::Tensor& param, State& state) {
  // (The loaded master follows the parameter already: sdk::follow_loaded_master.)
  // A master copy that these options do not keep would be neither stepped
  // nor refreshed, and saved again, stale: dropped.
  if (!fused_.master_weights()) state.master(at::Tensor());
  // The moments as these options keep them: coded or decoded once, here.
  const bool want = coded_8bit(param) && param.scalar_type() != at::kDouble;
  if (want && !holds_coded(state)) code_moments(state);
  else if (!want && holds_coded(state)) decode_moments(state, state_dtype(param, fused_));
}

template <class Base, class Options, class State, bool kDecoupled>
std::size_t FusedAdamImpl<Base, Options, State, kDecoupled>::state_stamp(const State& s) const {
  return this->stamp_tensors({&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq(), &s.master(), &s.device_step(),
                              &s.exp_avg_8bit(), &s.exp_avg_absmax(), &s.exp_avg_sq_8bit(), &s.exp_avg_sq_absmax()});
}

namespace {

enum class Coded8List : int { kParam, kGrad, kMaster, kExpAvg, kExpAvgAbsmax, kExpAvgSq, kExpAvgSqAbsmax };
constexpr int kCoded8Lists = 7;

// What a list keeps between steps (its ListSlot): the states and the
// pointers the kernels take, valid while the step plan holds.
template <class State>
struct AdamKept {
  std::vector<State*> states;
  // The state tensors pointed to, held so that none is freed (and another
  // made at its address, which its state stamp would not tell apart) while
  // kept, with their storages (sdk::HeldState).
  sdk::HeldState held;
  std::vector<std::int64_t> numels;
  std::vector<char> coded;  // moments_8bit: which tensors are coded (left out of `numels`' plan)
  std::vector<std::int64_t> numels8;  // their numels, 0 for the others (empty when none is coded)
#if defined(AMPFUSE_WITH_CUDA)
  TensorListsView views;
  std::shared_ptr<const sdk::ListMeta> meta;
  std::vector<at::Tensor> empty_steps;  // counters of zero-element parameters
  // moments_8bit: the coded tensors' lists (fused::cuda::Adam8List) and metadata, planned in
  // 256-element chunks; null when the list has none.
  TensorListsView views8;
  std::shared_ptr<const sdk::ListMeta> meta8;
#endif
  // CPU: one pointer array per list of AdamList (kStep aside), and each
  // step's counters and scalars (reused: the step's launch ran before the
  // next step prepares).
  std::vector<std::vector<void*>> ptrs;
  std::shared_ptr<const Plan> plan;
  // moments_8bit: the coded tensors' pointer arrays (by Coded8List) and plan.
  std::vector<std::vector<void*>> ptrs8;
  std::shared_ptr<const Plan> plan8;
  std::vector<std::int64_t> steps;
  std::vector<fused::AdamStepScalars> scalars;
};

}  // namespace

template <class Base, class Options, class State, bool kDecoupled>
sdk::Launch FusedAdamImpl<Base, Options, State, kDecoupled>::prepare_list(const sdk::ParamList& pl) {
  using fused::AdamList;
  const auto& list = pl.entries;
  const c10::Device device = pl.device;
  const Options& o = this->options_of(pl.group);
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  const fused::AdamHyper hyper = fused::make_adam_hyper(o.lr(), beta1, beta2, o.eps(), o.weight_decay(),
                                                        o.amsgrad(), fused_.maximize(), kDecoupled);
  const ScalarType st = pl.kernel_dtype();
  const c10::ScalarType state_st_torch = state_dtype(list.front()->param, fused_);
  const ScalarType state_st = to_scalar_type(state_st_torch);
  const bool master = fused_.master_weights();
  const bool on_cuda = device.is_cuda();
  const std::size_t n = list.size();

  std::shared_ptr<AdamKept<State>> kept = pl.slot.get<AdamKept<State>>();
  const bool fresh = kept == nullptr;  // (and after amsgrad was switched: plan_key)
  if (fresh) {
    AdamKept<State> k;
    k.states.resize(n);
    k.numels.assign(n, 0);
    k.coded.assign(n, 0);
    std::vector<std::int64_t> numels8(n, 0);
    bool any_coded = false;
    sdk::SmallStatePool pool(list.front()->param.options().dtype(state_st_torch));
    for (const sdk::Entry* e : list)
      if (e->state == nullptr && !coded_8bit(e->user_param())) pool.reserve(e->param, o.amsgrad() ? 3 : 2);
    for (std::size_t i = 0; i < n; ++i) {  // creates state (first step): on this thread
      const sdk::Entry& e = *list[i];
      const at::Tensor& p = e.param;
      const auto zeros = [&] { return pool.take(p); };
      const bool coded = coded_8bit(e.user_param());
      State& state = this->state_for(e, [&](State& s) {
        s.step(0);
        if (coded) {
          const at::Tensor none = at::zeros_like(p, p.options().dtype(at::kByte), at::MemoryFormat::Preserve);
          const at::Tensor zero_absmax = at::zeros({fused::quant_blocks(p.numel())}, p.options().dtype(at::kFloat));
          s.exp_avg_8bit(none);
          s.exp_avg_absmax(zero_absmax);
          s.exp_avg_sq_8bit(none.clone());
          s.exp_avg_sq_absmax(zero_absmax.clone());
        } else {
          s.exp_avg(zeros());
          s.exp_avg_sq(zeros());
        }
      });
      if (coded != holds_coded(state)) {
        // A state of the other kind (loaded, or set by hand): coded or decoded as these options keep it.
        this->undo_on_failure([&state, kept_state = state] {
          state.exp_avg(kept_state.exp_avg());
          state.exp_avg_sq(kept_state.exp_avg_sq());
          state.exp_avg_8bit(kept_state.exp_avg_8bit());
          state.exp_avg_absmax(kept_state.exp_avg_absmax());
          state.exp_avg_sq_8bit(kept_state.exp_avg_sq_8bit());
          state.exp_avg_sq_absmax(kept_state.exp_avg_sq_absmax());
        });
        coded ? code_moments(state) : decode_moments(state, state_st_torch);
      }
      if (o.amsgrad() && !state.max_exp_avg_sq().defined()) {
        this->undo_on_failure([&state] { state.max_exp_avg_sq(at::Tensor()); });
        state.max_exp_avg_sq(zeros());
      }
      this->prepare_device_step(e, state);
      k.states[i] = &state;
      // The 32-bit plan takes the others; a coded tensor has numel 0 there.
      k.coded[i] = state.exp_avg_8bit().defined() ? 1 : 0;
      (k.coded[i] != 0 ? numels8[i] : k.numels[i]) = p.numel();
      any_coded = any_coded || k.coded[i] != 0;
    }
    if (any_coded) k.numels8 = std::move(numels8);
    if (!on_cuda) k.ptrs.assign(fused::kAdamCpuLists, std::vector<void*>(n, nullptr));
    kept = std::make_shared<AdamKept<State>>(std::move(k));
  }
  // Masters made above are fresh; an existing one is refreshed when the
  // parameter was written from outside (its version is read every step).
  if (master)
    for (std::size_t i = 0; i < n; ++i) this->prepare_master(*list[i], *kept->states[i]);
  if (fresh)
    for (const State* s : kept->states)
      for (const at::Tensor* t : {&s->exp_avg(), &s->exp_avg_sq(), &s->max_exp_avg_sq(), &s->master(), &s->device_step(),
                                  &s->exp_avg_8bit(), &s->exp_avg_absmax(), &s->exp_avg_sq_8bit(),
                                  &s->exp_avg_sq_absmax()})
        if (t->defined()) kept->held.hold(*t);

  auto& ptrs = kept->ptrs;
  if (!on_cuda) {
    auto list_ptrs = [&](AdamList l) -> std::vector<void*>& { return ptrs[list_index(l)]; };
    auto coded_ptrs = [&](Coded8List l) -> std::vector<void*>& { return kept->ptrs8[list_index(l)]; };
    if (fresh) {
      const bool any_coded = !kept->numels8.empty();
      if (any_coded) kept->ptrs8.assign(kCoded8Lists, std::vector<void*>(n, nullptr));
      sdk::fill_entries(n, [&](std::size_t i) {
        const State& s = *kept->states[i];
        if (kept->coded[i] != 0) {
          coded_ptrs(Coded8List::kParam)[i] = sdk::writable_data(list[i]->param);
          coded_ptrs(Coded8List::kGrad)[i] = list[i]->grad_data();
          if (master) coded_ptrs(Coded8List::kMaster)[i] = sdk::writable_data(s.master());
          coded_ptrs(Coded8List::kExpAvg)[i] = sdk::writable_data(s.exp_avg_8bit());
          coded_ptrs(Coded8List::kExpAvgAbsmax)[i] = sdk::writable_data(s.exp_avg_absmax());
          coded_ptrs(Coded8List::kExpAvgSq)[i] = sdk::writable_data(s.exp_avg_sq_8bit());
          coded_ptrs(Coded8List::kExpAvgSqAbsmax)[i] = sdk::writable_data(s.exp_avg_sq_absmax());
          return;
        }
        list_ptrs(AdamList::kParam)[i] = sdk::writable_data(list[i]->param);
        list_ptrs(AdamList::kGrad)[i] = list[i]->grad_data();
        list_ptrs(AdamList::kExpAvg)[i] = sdk::writable_data(s.exp_avg());
        list_ptrs(AdamList::kExpAvgSq)[i] = sdk::writable_data(s.exp_avg_sq());
        if (o.amsgrad()) list_ptrs(AdamList::kMaxExpAvgSq)[i] = sdk::writable_data(s.max_exp_avg_sq());
        if (master) list_ptrs(AdamList::kMaster)[i] = sdk::writable_data(s.master());
      });
      kept->plan = sdk::list_plan(list, kept->numels, list_index(AdamList::kParam));  // (runs of views with gaps)
      if (any_coded) kept->plan8 = std::make_shared<const Plan>(kept->numels8, sdk::cpu::kChunkSize);
    } else if (pl.grads_moved) {
      sdk::parallel_entries(n, [&](std::size_t i) {
        (kept->coded[i] != 0 ? coded_ptrs(Coded8List::kGrad) : list_ptrs(AdamList::kGrad))[i] = list[i]->grad_data();
      });
    }
    // Two pow() per run of equal steps (in each thread's range), not per tensor.
    this->advance_host_steps(kept, kept->scalars, [&](std::int64_t step) {
      return fused::adam_step_scalars(o.lr(), beta1, beta2, static_cast<double>(step));
    });
    const double grad_factor = sdk::cpu_grad_factor(pl.signal);
    if (fresh) pl.slot.keep(kept);
    return [=] {
      const std::vector<fused::AdamStepScalars>& scalars = kept->scalars;
      auto array = [&](AdamList l) { return kept->ptrs[list_index(l)].data(); };
      const fused::cpu::AdamArgs args{sdk::cpu::plan_ref(*kept->plan), array(AdamList::kParam), array(AdamList::kGrad),
                                      array(AdamList::kExpAvg), array(AdamList::kExpAvgSq), array(AdamList::kMaxExpAvgSq),
                                      master ? array(AdamList::kMaster) : nullptr, st, state_st, scalars.data(), hyper,
                                      grad_factor};
      const fused::cpu::AdamFn kernel = fused::cpu::adam_kernel(sdk::cpu::isa_for(*kept->plan));
      if (kept->plan8 == nullptr) {
        sdk::parallel_chunks(*kept->plan, [&](std::int64_t b, std::int64_t e) { kernel(args, b, e); });
      } else {
        // One parallel region over both plans: the 32-bit chunks, then the 8-bit ones.
        auto coded = [&](Coded8List l) { return kept->ptrs8[list_index(l)].data(); };
        auto codes = [&](Coded8List l) { return reinterpret_cast<std::uint8_t* const*>(coded(l)); };
        auto absmax = [&](Coded8List l) { return reinterpret_cast<float* const*>(coded(l)); };
        const fused::cpu::Adam8Args args8{sdk::cpu::plan_ref(*kept->plan8), coded(Coded8List::kParam),
                                          coded(Coded8List::kGrad), master ? coded(Coded8List::kMaster) : nullptr,
                                          codes(Coded8List::kExpAvg), absmax(Coded8List::kExpAvgAbsmax),
                                          codes(Coded8List::kExpAvgSq), absmax(Coded8List::kExpAvgSqAbsmax), st,
                                          scalars.data(), hyper, grad_factor};
        const fused::cpu::Adam8Fn kernel8 = fused::cpu::adam8_kernel();
        const std::int64_t n32 = kept->plan->num_chunks(), n8 = kept->plan8->num_chunks();
        const std::int64_t grain =
            sdk::cpu::chunks_grain(n32 + n8, kept->plan->total_elements() + kept->plan8->total_elements());
        at::parallel_for(0, n32 + n8, grain, [&](std::int64_t b, std::int64_t e) {
          const sdk::cpu::FlushSubnormals flush;
          if (b < n32) kernel(args, b, std::min(e, n32));
          if (e > n32) kernel8(args8, std::max(b, n32) - n32, e - n32);
        });
      }
    };
  }
#if defined(AMPFUSE_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(device);
  using fused::cuda::Adam8List;
  if (fresh) {
    TensorListsView& views = kept->views;
    views.lists.assign(fused::kAdamLists, std::vector<TensorView>(n));
    auto set = [&](AdamList l, std::size_t i, void* data, std::int64_t numel, ScalarType t) {
      views.lists[list_index(l)][i] = {data, numel, t};
    };
    if (!kept->numels8.empty()) kept->views8.lists.assign(fused::cuda::kAdam8Lists, std::vector<TensorView>(n));
    for (std::size_t i = 0; i < n; ++i) {
      const at::Tensor& p = list[i]->param;
      State& s = *kept->states[i];
      const std::int64_t numel = p.numel();
      if (kept->coded[i] != 0) {
        // Left out of the 32-bit launch (numel 0 there), in the 8-bit one.
        auto set8 = [&](Adam8List l, void* data, ScalarType t) {
          kept->views8.lists[list_index(l)][i] = {data, numel, t};
        };
        set8(Adam8List::kParam, p.data_ptr(), st);
        set8(Adam8List::kGrad, list[i]->grad_data(), st);
        set8(Adam8List::kMaster, master ? s.master().data_ptr() : nullptr, ScalarType::Float32);
        // Byte lists and absmax travel as pointers; their dtype tags are not read.
        set8(Adam8List::kExpAvg, s.exp_avg_8bit().data_ptr(), ScalarType::Float32);
        set8(Adam8List::kExpAvgAbsmax, s.exp_avg_absmax().data_ptr(), ScalarType::Float32);
        set8(Adam8List::kExpAvgSq, s.exp_avg_sq_8bit().data_ptr(), ScalarType::Float32);
        set8(Adam8List::kExpAvgSqAbsmax, s.exp_avg_sq_absmax().data_ptr(), ScalarType::Float32);
        set8(Adam8List::kStep, s.device_step().data_ptr(), ScalarType::Float32);
        continue;
      }
      if (numel == 0) kept->empty_steps.push_back(s.device_step());
      set(AdamList::kParam, i, p.data_ptr(), numel, st);
      set(AdamList::kGrad, i, list[i]->grad_data(), numel, st);
      set(AdamList::kExpAvg, i, s.exp_avg().data_ptr(), numel, state_st);
      set(AdamList::kExpAvgSq, i, s.exp_avg_sq().data_ptr(), numel, state_st);
      // The fp64 counter travels as a pointer; its dtype tag is not read.
      set(AdamList::kStep, i, s.device_step().data_ptr(), 1, ScalarType::Float32);
      set(AdamList::kMaxExpAvgSq, i, o.amsgrad() ? s.max_exp_avg_sq().data_ptr() : nullptr, numel, state_st);
      set(AdamList::kMaster, i, master ? s.master().data_ptr() : nullptr, numel, ScalarType::Float32);
    }
  } else if (pl.grads_moved) {
    for (std::size_t i = 0; i < n; ++i) {
      if (kept->coded[i] != 0) kept->views8.lists[list_index(Adam8List::kGrad)][i].data = list[i]->grad_data();
      else kept->views.lists[list_index(AdamList::kGrad)][i].data = list[i]->grad_data();
    }
  }
  if (fresh || pl.grads_moved) {
    const Plan plan(kept->numels, sdk::cuda::kChunkSize);
    kept->meta = sdk::make_launch_meta(kept->views, plan, device);
    if (!kept->numels8.empty()) {
      const Plan plan8(kept->numels8, fused::kQuantBlock);
      kept->meta8 = sdk::make_launch_meta(kept->views8, plan8, device);
    }
  } else {
    kept->meta = sdk::reuse_launch_meta(kept->meta, device);
    if (kept->meta8) kept->meta8 = sdk::reuse_launch_meta(kept->meta8, device);
  }
  const std::shared_ptr<const sdk::ListMeta> meta = kept->meta;  // held by the Launch
  const std::shared_ptr<const sdk::ListMeta> meta8 = kept->meta8;
  const double* lr_device = nullptr;
  if (fused_.capturable()) {
    bool created = false;
    lr_device = workspace_->lr.prepare(pl.group, device, o.lr(), name(), &created).template data_ptr<double>();
    if (created) this->undo_on_failure([this, g = pl.group, device] { workspace_->lr.erase(g, device); });
  }
  const sdk::SignalPointers sig = sdk::signal_pointers(pl.signal);
  const fused::cuda::AdamCudaArgs args{state_st, master, hyper, o.lr(), beta1, beta2, o.weight_decay(), lr_device,
                                       sig.found_inf, sig.inv_scale, sig.clip_coef,
                                       workspace_->counters.get({pl.group, device, pl.dtype},
                                                               std::max(meta->launch.num_tensors,
                                                                        meta8 ? meta8->launch.num_tensors : 0))};
  const fused::cuda::Adam8CudaArgs args8{master, hyper, o.lr(), beta1, beta2, o.weight_decay(), lr_device,
                                         sig.found_inf, sig.inv_scale, sig.clip_coef, args.counters};
  const ScaleSignal* signal = pl.signal;
  const bool capturable = fused_.capturable();
  const double lr = o.lr();
  const std::size_t group = pl.group;
  if (fresh) pl.slot.keep(kept);
  return [=] {
    const c10::cuda::CUDAGuard launch_guard(device);
    if (capturable) workspace_->lr.refresh(group, device, lr);
    fused::cuda::adam(meta->launch, st, args, sdk::current_stream(device));
    // The coded tensors, after it on the same stream (which frees the ticket counters again).
    if (meta8) fused::cuda::adam8(meta8->launch, st, args8, sdk::current_stream(device));
    // Zero-element parameters have no chunk: advance their counters here.
    sdk::advance_step_counters(kept->empty_steps, signal);
  };
#else
  TORCH_CHECK(false, name(), ": ampfuse was built without CUDA");
#endif
}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::FusedAdamImpl(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults, FusedAdamOptions fused)
    : sdk::FusedOptimizer<Base, Options, State>(param_groups, std::move(defaults)),
      fused_(fused),
      workspace_(std::make_unique<FusedAdamWorkspace>()) {}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::FusedAdamImpl(std::vector<at::Tensor> params, Options defaults,
                                                               FusedAdamOptions fused)
    : FusedAdamImpl({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), fused) {}

template <class Base, class Options, class State, bool kDecoupled>
FusedAdamImpl<Base, Options, State, kDecoupled>::~FusedAdamImpl() = default;

template <class Base, class Options, class State, bool kDecoupled>
bool FusedAdamImpl<Base, Options, State, kDecoupled>::coded_8bit(const at::Tensor& p) const {
  if (!fused_.moments_8bit()) return false;
  const auto it = whole_numel_.find(p.unsafeGetTensorImpl());
  return (it == whole_numel_.end() ? p.numel() : it->second) >= fused::kMin8bitNumel;
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::set_whole_tensor(const at::Tensor& piece, std::int64_t whole_numel,
                                                                       std::int64_t offset) {
  // (group, index) of each parameter, made again when the piece is not in it (groups added since).
  auto it = place_of_.find(piece.unsafeGetTensorImpl());
  if (it == place_of_.end()) {
    place_of_.clear();
    const auto& groups = this->param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g)
      for (std::size_t i = 0; i < groups[g].params().size(); ++i)
        place_of_[groups[g].params()[i].unsafeGetTensorImpl()] = {g, i};
    it = place_of_.find(piece.unsafeGetTensorImpl());
  }
  TORCH_CHECK(it != place_of_.end(), name(), ": set_whole_tensor: the tensor is not one of this optimizer's parameters");
  const auto [g, i] = it->second;
  const std::int64_t end = offset + piece.numel();
  TORCH_CHECK(offset >= 0 && end <= whole_numel, name(), ": param group ", g, ", param ", i,
              ": set_whole_tensor: elements [", offset, ", ", end, ") are not part of a tensor of ", whole_numel,
              " elements");
  TORCH_CHECK(this->state().count(piece.unsafeGetTensorImpl()) == 0, name(), ": param group ", g, ", param ", i,
              ": set_whole_tensor after the parameter has state (call it before the first step or load)");
  TORCH_CHECK(!fused_.moments_8bit() || whole_numel < fused::kMin8bitNumel ||
                  (offset % fused::kQuantBlock == 0 && (end % fused::kQuantBlock == 0 || end == whole_numel)),
              name(), ": param group ", g, ", param ", i, ": moments_8bit on elements [", offset, ", ", end,
              ") of a tensor of ", whole_numel, "; a piece must start at a multiple of ", fused::kQuantBlock,
              " and end at one or at the tensor's end, so that its 8-bit blocks are the tensor's");
  whole_numel_[piece.unsafeGetTensorImpl()] = whole_numel;
}

template <class Base, class Options, class State, bool kDecoupled>
std::int64_t FusedAdamImpl<Base, Options, State, kDecoupled>::saved_elements_per_entry(const std::string& key) const {
  return key == "exp_avg_absmax" || key == "exp_avg_sq_absmax" ? fused::kQuantBlock : 0;
}

template <class Base, class Options, class State, bool kDecoupled>
at::Tensor FusedAdamImpl<Base, Options, State, kDecoupled>::lr_tensor(std::size_t group, c10::Device device) const {
  return workspace_->lr.find(group, device);
}

template <class Base, class Options, class State, bool kDecoupled>
void FusedAdamImpl<Base, Options, State, kDecoupled>::sync_state() {
  for (auto& entry : this->state()) {
    if (!entry.second || typeid(*entry.second) != typeid(State)) continue;  // (validation refuses those)
    State& s = static_cast<State&>(*entry.second);
    if (s.device_step().defined()) s.step(static_cast<std::int64_t>(s.device_step().template item<double>()));
  }
}

template class FusedAdamImpl<torch::optim::Adam, torch::optim::AdamOptions, FusedAdamParamState, false>;
template class FusedAdamImpl<torch::optim::AdamW, torch::optim::AdamWOptions, FusedAdamWParamState, true>;

}  // namespace detail
}  // namespace ampfuse
