// Compiled with the instruction-set flags of "baseline" (see CMakeLists.txt).
#define AMPFUSE_CPU_ISA baseline
#include "fused/sgd_cpu_impl.inc"
