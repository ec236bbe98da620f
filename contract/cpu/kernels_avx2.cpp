// Compiled with the instruction-set flags of "avx2" (see CMakeLists.txt).
#define AMPFUSE_CPU_ISA avx2
#define AMPFUSE_CPU_ISA_NAME "avx2"
#include "contract/cpu/kernels_impl.inc"
