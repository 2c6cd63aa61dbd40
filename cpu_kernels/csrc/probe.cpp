// CPU feature probe, compiled for the baseline x86-64 so that it loads everywhere. Reports what both
// the CPU (cpuid) and the OS (XCR0 via xgetbv) enable, and asks Linux for the AMX tile-data permission.
// Bits: Intel SDM vol. 2A "CPUID" (leaf 1 ECX, leaf 7.0 EBX/ECX/EDX, leaf 7.1 EAX) and vol. 1 ch. 13
// (XCR0 state components: 1-2 SSE/AVX, 5-7 AVX-512, 17-18 AMX TILECFG/TILEDATA).
#include <cpuid.h>
#include <cstdint>
#include <sys/syscall.h>
#include <unistd.h>

#define HY_API extern "C" __attribute__((visibility("default")))

enum {
  F_AVX2 = 1 << 0, F_FMA = 1 << 1, F_AVX512F = 1 << 2, F_AVX512BW = 1 << 3, F_AVX512VL = 1 << 4,
  F_AVX512DQ = 1 << 5, F_AVX512VNNI = 1 << 6, F_AVX512BF16 = 1 << 7, F_AMX_TILE = 1 << 8,
  F_AMX_BF16 = 1 << 9, F_AMX_INT8 = 1 << 10, F_OS_AVX = 1 << 11, F_OS_AVX512 = 1 << 12, F_OS_AMX = 1 << 13, F_F16C = 1 << 14,
};

static uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}

HY_API int hy_cpu_features() {
  unsigned a, b, c, d;
  int f = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  bool osxsave = c & (1u << 27);
  if (c & (1u << 12)) f |= F_FMA;
  if (c & (1u << 29)) f |= F_F16C;
  if (osxsave) {
    uint64_t x = xgetbv0();
    if ((x & 0x6) == 0x6) f |= F_OS_AVX;
    if ((x & 0xE6) == 0xE6) f |= F_OS_AVX512;
    if ((x & 0x60000) == 0x60000) f |= F_OS_AMX;
  }
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    unsigned max_sub = a;
    if (b & (1u << 5)) f |= F_AVX2;
    if (b & (1u << 16)) f |= F_AVX512F;
    if (b & (1u << 17)) f |= F_AVX512DQ;
    if (b & (1u << 30)) f |= F_AVX512BW;
    if (b & (1u << 31)) f |= F_AVX512VL;
    if (c & (1u << 11)) f |= F_AVX512VNNI;
    if (d & (1u << 22)) f |= F_AMX_BF16;
    if (d & (1u << 24)) f |= F_AMX_TILE;
    if (d & (1u << 25)) f |= F_AMX_INT8;
    if (max_sub >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5))) f |= F_AVX512BF16;
  }
  return f;
}

// Linux >= 5.16 keeps AMX tile data off until the process asks (arch/x86/include/uapi/asm/prctl.h:
// ARCH_REQ_XCOMP_PERM = 0x1023; XFEATURE_XTILEDATA = 18). Returns 0 when granted.
HY_API int hy_request_amx() {
  return (int)syscall(SYS_arch_prctl, 0x1023, 18);
}
