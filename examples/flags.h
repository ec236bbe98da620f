#pragma once
// Command-line values for the example programs, read whole: "abc" or "10x"
// is a usage error, where std::stoll would throw (an abort) or take the 10.

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>

namespace ampfuse_examples {

inline bool whole_number(const char* text, std::int64_t& out) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  out = v;
  return end != text && *end == '\0' && errno == 0;
}

inline bool number(const char* text, double& out) {
  char* end = nullptr;
  errno = 0;
  out = std::strtod(text, &end);
  return end != text && *end == '\0' && errno == 0 && std::isfinite(out);
}

}  // namespace ampfuse_examples
