// Compiled with the instruction-set flags of "avx2" (see CMakeLists.txt).
#define AMPFUSE_CPU_ISA avx2
#include "fused/sgd_cpu_impl.inc"
