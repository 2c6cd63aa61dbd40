// AVX-512 (F/BW/VL/DQ + BF16 + VNNI) build of the executor; loaded only where cpuid and XCR0 say so.
#define HY_ISA_NAME "avx512_bf16"
#define HY_HAS_AMX 0
#include "kern_avx512.h"
#include "driver.h"
#include "api.h"
