// AMX build: the AVX-512 vector kernels below the knee (DESIGN.md section 3) plus AMX tiles above it.
#define HY_ISA_NAME "amx"
#define HY_HAS_AMX 1
#include "kern_avx512.h"
#include "kern_amx.h"
#include "driver.h"
#include "api.h"
