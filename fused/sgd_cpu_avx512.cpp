// Compiled with the instruction-set flags of "avx512" (see CMakeLists.txt).
#define AMPFUSE_CPU_ISA avx512
#include "fused/sgd_cpu_impl.inc"
