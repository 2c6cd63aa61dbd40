// Shared definitions of the CPU expert executor: the C ABI structs (mirrored by cpu_kernels/_native.py
// with ctypes), bf16 helpers and the activation functions. Included by every per-ISA library.
// Shape vocabulary: T tokens, E experts, K experts per token, D hidden, F expert intermediate.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

#define HY_API extern "C" __attribute__((visibility("default")))
#define HY_MAX_NODES 8

enum { HY_BF16 = 0, HY_INT8 = 1, HY_INT4 = 2 };
enum { HY_X_F32 = 0, HY_X_BF16 = 1 };
enum { HY_ACT_SILU = 0, HY_ACT_GELU = 1, HY_ACT_SWIGLU_OAI = 2 };
enum { HY_OK = 0, HY_EID = -1, HY_EARG = -2, HY_ENOMEM = -3 };

// One projection of every expert held by one NUMA node, row-major [E, rows_p, ldk] (int4: ldk/2 bytes a
// row). Rows are the output channels, ldk the (padded) reduction length. Padding is zero, so padded
// rows and columns contribute nothing; the GPU lane can use w[:, :rows, :k] as a strided view.
typedef struct {
  const uint8_t* w;
  const float* scale;    // int8: [E, rows_p] per output channel; int4: [E, rows_p, ldk/group]
  const int32_t* rsum;   // int8: [E, rows_p] sum of the row's int8 values (unused by current kernels)
  int64_t w_estride;     // bytes between experts
  int64_t s_estride;     // floats between experts in scale
  int64_t r_estride;     // int32s between experts in rsum
  int32_t rows, rows_p, k, ldk, group, dtype;
} HyMat;

typedef struct {
  void* pool;            // Pool* of this node's pinned threads
  HyMat gate, up, down;  // gate/up: rows = F_n (this node's slice of F), k = D; down: rows = D, k = F_n
} HyNode;

typedef struct {
  int32_t dtype, act, n_local, D, n_nodes, knee;  // knee: tokens/expert from which the AMX path is used
  float alpha, limit;                             // activation parameters (GPT-OSS SwiGLU)
  HyNode nodes[HY_MAX_NODES];
} HyLayer;

namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's float->bfloat16 conversion does (NaN inputs are not expected).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// Gated activation act(gate) * up, applied once per (token, intermediate channel).
inline float gated_act(int act, float g, float u, float alpha, float limit) {
  switch (act) {
    case HY_ACT_GELU:  // exact (erf) GELU, torch.nn.functional.gelu's default
      return 0.5f * g * (1.0f + std::erf(g * 0.70710678118654752f)) * u;
    case HY_ACT_SWIGLU_OAI: {  // GPT-OSS: clamp, g*sigmoid(alpha*g), times (up + 1)
      g = std::fmin(g, limit);
      u = std::fmax(std::fmin(u, limit), -limit);
      return g / (1.0f + std::exp(-alpha * g)) * (u + 1.0f);
    }
    default:  // SiLU (Qwen3, DeepSeek, Mixtral)
      return g / (1.0f + std::exp(-g)) * u;
  }
}

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Activation row layout. bf16: uint16 [ldk]. int8/int4: int8 [ldk] | fp32 scale | int32 group sums
// [ldk/group] (the int4 kernels need sum(a) per group to undo the +8 offset of the stored nibbles).
inline int64_t act_stride(int dtype, int ldk, int group) {
  if (dtype == HY_BF16) return align_up((int64_t)ldk * 2, 64);
  return align_up((int64_t)ldk + 4 + 4 * (int64_t)(ldk / group), 64);
}
inline float act_scale(const uint8_t* row, int ldk) { float s; std::memcpy(&s, row + ldk, 4); return s; }
inline const int32_t* act_gsum(const uint8_t* row, int ldk) { return (const int32_t*)(row + ldk + 4); }

}  // namespace
