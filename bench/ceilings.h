#pragma once
// Traffic twins: loops that move the same bytes as a kernel with trivial
// arithmetic, split over threads exactly as the engine splits its work.

#include <ampfuse/multi_tensor.h>

#include <cstdint>
#include <vector>

namespace ampfuse_bench {

/// Reads every float of the lists (the non-finite check's traffic). Returns
/// an OR of the bits so the compiler keeps the loads.
std::uint32_t read_only_twin(const std::vector<float*>& data, const ampfuse::Plan& plan);

/// Reads and writes every float once (the in-place scale's traffic); s is
/// passed at run time so that the compiler cannot drop the loop.
void read_write_twin(const std::vector<float*>& data, const ampfuse::Plan& plan, float s);

/// Adam's traffic: reads p, g, m, v and writes p, m, v (28 bytes per fp32 element).
void adam_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& m,
               const std::vector<float*>& v, const ampfuse::Plan& plan);

/// SGD-with-momentum traffic: reads p, g, buf and writes p, buf (20 bytes per fp32 element).
void sgd_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& buf,
              const ampfuse::Plan& plan);

/// LAMB's minimum traffic: the trust ratio needs ||update|| of a whole tensor
/// before any of it is written, so two passes: read p, g, m, v and write m, v;
/// then read p, m, v and write p (40 bytes per fp32 element).
void lamb_twin(const std::vector<float*>& p, const std::vector<float*>& g, const std::vector<float*>& m,
               const std::vector<float*>& v, const ampfuse::Plan& plan);

/// The pointers of 8-bit Adam's traffic: fp32 params and grads, a byte per moment.
struct Twin8Pointers {
  std::vector<float*> p, g;
  std::vector<std::uint8_t*> m, v;
};

/// 8-bit Adam's traffic: reads p, g and both moment bytes, writes p and both
/// bytes (16 bytes per fp32 element; the per-block absmax is left out).
void adam8_twin(const Twin8Pointers& t, const ampfuse::Plan& plan);

}  // namespace ampfuse_bench
