// AMX driver path with the tile instructions emulated in scalar code over the AVX2 vector kernels:
// exercises the AMX-specific packing, tiling and write-back on any AVX2 machine (tests only; slow).
#define HY_ISA_NAME "amx_emu"
#define HY_HAS_AMX 1
#define HY_AMX_EMULATE 1
#include "kern_avx2.h"
#include "kern_amx.h"
#include "driver.h"
#include "api.h"
