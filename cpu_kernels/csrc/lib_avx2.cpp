// AVX2 + FMA build of the executor (compiled with -mavx2 -mfma; loaded only where cpuid reports both).
#define HY_ISA_NAME "avx2"
#define HY_HAS_AMX 0
#include "kern_avx2.h"
#include "driver.h"
#include "api.h"
