// AVX2 + FMA + F16C build of the executor (compiled with -mavx2 -mfma -mf16c; loaded only where cpuid reports all three).
#define HY_ISA_NAME "avx2"
#define HY_HAS_AMX 0
#include "kern_avx2.h"
#include "driver.h"
#include "api.h"
