"""Resident experts held quantized in VRAM: y[m] = x[m] @ dequant(W[slot[m]]).T for a batch of routed rows, each
row with the expert slot it was routed to, in one Triton kernel that reads only the quantized bytes.

Why by hand: resident experts in int8 / int4 (hybrid.offload.resident) hold two to four times as many experts in
the same VRAM as bf16 ones. Captured decode cannot de-quantize "the experts this step uses" into a scratch buffer
first: which ones those are is known on the device only, and de-quantizing all of a layer's residents every step
would read each of them. A grouped GEMM over de-quantized copies (torch._grouped_mm) therefore does not apply, and
no library kernel takes a per-row expert index with our byte formats.

Design. One program per (BLOCK_N rows of W, routed row m): it reads slot[m]; a slot >= R (a cold expert, the CPU
lane's) writes zeros and reads nothing, so cold rows cost a launch slot only. Otherwise the program is
qgemv's T = 1 GEMV (the same tile functions: W's raw levels on the tensor cores, fp32 accumulator, per-group
scales after each sub-tile) over the slot's matrix, x's row broadcast to the dot's 8 columns. Rows routed to the
same expert re-read its bytes (from L2 when their programs run together); at decode sizes (T x K <= 64 rows) that
is what a step reads anyway. The formats are hybrid.models.qweight's int8 and int4 (per `group` inputs), stacked:
q [R, N, KQ], scale [R, N, ceil(K / group)].

Reference: hybrid.offload.resident.QuantStack.dequantize with F.linear per row (tests/test_expert_qgemv.py, in
Triton's interpreter on the CPU and compiled on CUDA).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hybrid.gpu_kernels.gemv import DTYPES
from hybrid.gpu_kernels.launch import next_pow2, wide_math
from hybrid.gpu_kernels.qgemv import KIND_CODE, T_PAD, _tile

BLOCK_N = 32
BLOCK_K = 256
NUM_WARPS = 2
NUM_STAGES = 4


def supported(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, kind: str, group: int) -> bool:
    """Whether gathered_qlinear takes x [M, K] against a stack q [R, N, KQ] / scale: bf16/fp16/fp32 x with unit
    stride along K, contiguous stacks on x's device, groups of 32 or more (powers of two), offsets within int32
    per matrix; CUDA, or CPU tensors under Triton's interpreter; not int4 with fp32 x on CUDA (qgemv declines it)."""
    if kind not in ("int8", "int4") or x.dim() != 2 or x.dtype not in DTYPES or x.stride(1) != 1 or x.shape[0] == 0:
        return False
    if group < 32 or group & (group - 1):
        return False
    if not q.is_contiguous() or not scale.is_contiguous() or q.device != x.device or scale.device != x.device:
        return False
    if q[0].numel() >= 2 ** 31 or x.shape[0] >= 2 ** 16:
        return False
    if x.is_cuda and x.dtype == torch.float32 and kind == "int4":
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gathered(x, slot, q, s, y, R, N, stride_x, stride_y, stride_qe, stride_se, K: tl.constexpr, KQ: tl.constexpr,
              SG: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, GS: tl.constexpr, ITERS: tl.constexpr, EVEN_K: tl.constexpr, F32: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    e = tl.load(slot + m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if e < R:
        n_ld = tl.minimum(n, N - 1)
        t_ld = tl.zeros([T_PAD], tl.int32)  # every dot column is row m (only column 0 is kept)
        qe = q + e * stride_qe
        se = s + e * stride_se
        xm = x + m * stride_x
        acc = tl.zeros([BLOCK_N, T_PAD], tl.float32)
        for i in range(ITERS):
            acc = _tile(acc, xm, qe, se, n_ld, t_ld, i * BLOCK_K, stride_x, K, KQ, SG, KIND, GROUP, BLOCK_K, GS,
                        EVEN_K, F32)
        col = tl.arange(0, T_PAD)
        out = tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1)
    else:
        out = tl.zeros([BLOCK_N], tl.float32)
    tl.store(y + m * stride_y + n, out.to(y.dtype.element_ty), mask=n < N)


def constants(kind: str, N: int, K: int, group: int) -> dict:
    """_gathered's compile-time arguments for a stack of [N, K] matrices (what the sm_90 compile test builds)."""
    bk = max(32, min(BLOCK_K, next_pow2(K)))
    iters = -(-K // bk)
    return dict(K=K, KQ=-(-K // 2) if kind == "int4" else K, SG=-(-K // group), KIND=KIND_CODE[kind], GROUP=group,
                T_PAD=T_PAD, BLOCK_N=max(16, min(BLOCK_N, next_pow2(N))), BLOCK_K=bk, GS=min(bk, group), ITERS=iters,
                EVEN_K=iters * bk == K)


def gathered_qlinear(x: torch.Tensor, slot: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, kind: str,
                     group: int, n: int) -> torch.Tensor:
    """x [M, K] (row m routed to expert slot[m] of the stack; slot >= R: a zero row) -> y [M, n] in x's dtype.
    q [R, n, KQ] / scale: the stacked matrices (hybrid.offload.resident.QuantStack). Check `supported` first."""
    M, K = x.shape
    R = q.shape[0]
    if slot.shape != (M,):
        raise ValueError(f"one slot per row: slot {tuple(slot.shape)} for x {tuple(x.shape)}")
    const = constants(kind, n, K, group)
    y = torch.empty(M, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, const["BLOCK_N"]), M)
    _gathered[grid](x, slot, q.view(torch.uint8), scale, y, R, n, x.stride(0), y.stride(0), q[0].numel(),
                    scale[0].numel(), **const, F32=wide_math(x), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
