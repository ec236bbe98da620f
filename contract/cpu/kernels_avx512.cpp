// Compiled with the instruction-set flags of "avx512" (see CMakeLists.txt).
#define AMPFUSE_CPU_ISA avx512
#define AMPFUSE_CPU_ISA_NAME "avx512"
#include "contract/cpu/kernels_impl.inc"
