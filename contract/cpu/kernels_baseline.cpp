// Compiled with the instruction-set flags of "baseline" (see CMakeLists.txt).
#define AMPFUSE_CPU_ISA baseline
#define AMPFUSE_CPU_ISA_NAME "baseline"
#include "contract/cpu/kernels_impl.inc"
