"""Prefill projections from FP8 weights on FP8 tensor cores: y = x @ dequant(W).T (+ bias) for x [M, K], M > 8.

W keeps its e4m3 bytes and 128 x 128 fp32 block scales (hybrid.models.qweight's fp8, DeepSeek-V3's published
layout). x is quantized per token and 128-input block to e4m3 (scale = the block's largest magnitude / 448,
DeepSeek-V3's activation recipe: its own inference code runs its FP8 linears so), then one program per
[BLOCK_M, BLOCK_N] output tile walks K in 128-input steps: an e4m3 x e4m3 tensor-core dot with fp32
accumulation, scaled by the step's activation scales [BLOCK_M] and weight scales [BLOCK_N] and summed in fp32;
the bias is added and the sum rounded once to x's dtype. On sm_90 each 32-input MMA's sum is promoted to fp32
(IMPRECISE_ACC): within one instruction the tensor cores still sum in their narrower format.

Why by hand: the de-quantizing path (qweight.dequant_linear) writes and re-reads a bf16 copy of W chunk by chunk
and runs a bf16 GEMM; FP8 dots have twice bf16's tensor throughput on sm_89 / sm_90 and read W's bytes as they
are. torch._scaled_mm takes one scale per row and column, not per 128-input block.

What it changes: the activations' e4m3 rounding (3 mantissa bits: a relative error up to 2^-4 per value, mostly
averaging out over a dot's 128-input blocks) on top of W's own quantization; decode rows (M <= 8) keep reading
bf16 activations (qgemv). HYBRID_FP8_GEMM=0 keeps prefill on the de-quantizing GEMMs.

Needs compute capability >= 8.9 for e4m3 dots. On the CPU the same source runs in Triton's interpreter
(launch.py): the e4m3 operands are widened to fp32 and dotted in IEEE fp32, which computes the same sum.

Reference: fp8_linear_reference (the same activation quantization, then fp32 matmuls per 128-input block;
tests/test_fp8_gemm.py).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

from hybrid.gpu_kernels.launch import wide_math
from hybrid.gpu_kernels.qformat import FP8_BLOCK

E4M3_MAX = 448.0
# Hopper's e4m3 MMAs accumulate in a narrower format than fp32 (about 14 bits kept: DeepSeek-V3's report, 3.3.2).
# Triton's default on sm_90 keeps the narrow sum over a whole dot; 32 (one wgmma's K) adds each instruction's
# sum into the fp32 accumulator, DeepSeek's promotion at the finest step.
IMPRECISE_ACC = tl.constexpr(32)
KB = FP8_BLOCK[1]  # inputs per activation and weight scale
# activation rows quantized at once: three fp32 temporaries of at most this many values (16 MiB each), within the
# de-quantized row chunk's 64 MiB that placement.memory counts for quantized GPU parts
QUANT_CHUNK_VALUES = 4 * 2**20
MIN_ROWS = 9  # below this the decode GEMV (qgemv) reads bf16 activations against W's bytes
MIN_CAPABILITY = (8, 9)  # e4m3 tensor-core dots
log = logging.getLogger("hybrid.gpu_kernels")


def fp8_gemm_supported(x: torch.Tensor, w, b: torch.Tensor | None = None) -> bool:
    """Whether fp8_linear takes (x [M, K], QWeight w, bias b): fp8 weights, prefill-sized bf16 / fp16 x with unit
    stride along K, contiguous q and scales, int32 offsets, a bias [N] beside x, a GPU with e4m3 dots (or Triton's
    interpreter), and not switched off by HYBRID_FP8_GEMM=0. HYBRID_FP8_GEMM=1 on a GPU without e4m3 dots is an
    error, not a silent fallback."""
    from cpu_kernels.knobs import knobs

    if getattr(w, "kind", None) != "fp8" or x.dim() != 2 or x.shape[0] < MIN_ROWS or x.shape[1] != w.k or w.n == 0:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1 or w.q.device != x.device:
        return False
    if not w.q.is_contiguous() or not w.scale.is_contiguous() or max(x.numel(), w.q.numel()) >= 2 ** 31:
        return False
    if b is not None and (b.shape != (w.n,) or not b.is_contiguous() or b.device != x.device):
        return False
    want = knobs().fp8_gemm
    if want == "0":
        return False
    if not x.is_cuda:
        return os.environ.get("TRITON_INTERPRET") == "1"
    cap = torch.cuda.get_device_capability(x.device)
    if cap < MIN_CAPABILITY and want == "1":
        raise RuntimeError(f"HYBRID_FP8_GEMM=1, but {torch.cuda.get_device_name(x.device)} (compute capability "
                           f"{cap[0]}.{cap[1]}) has no e4m3 tensor-core dots (8.9+); unset it to de-quantize instead")
    _announce(x.device.index or 0, cap >= MIN_CAPABILITY, want)
    return cap >= MIN_CAPABILITY


@functools.lru_cache(maxsize=None)
def _announce(device: int, used: bool, want: str) -> None:
    """One log line per GPU: which GEMMs prefill runs on FP8 weights."""
    if used:
        log.info("FP8 weights' prefill GEMMs: e4m3 tensor cores, activations in e4m3 per 128-input block "
                 "(HYBRID_FP8_GEMM=%s; 0 de-quantizes to bf16 instead)", want)
    else:
        log.info("FP8 weights' prefill GEMMs: de-quantized to bf16 (GPU %d has no e4m3 tensor-core dots)", device)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K / 128)]): each token's 128-input blocks scaled so their
    largest magnitude is 448 (an all-zero block gets scale 1). x ~= q * scale[:, k // 128]. Rows go a slice at a
    time, so the fp32 temporaries stay within QUANT_CHUNK_VALUES values whatever the prompt's length."""
    M, K = x.shape
    nb = -(-K // KB)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, nb, dtype=torch.float32, device=x.device)
    step = max(1, QUANT_CHUNK_VALUES // (nb * KB))
    for r in range(0, M, step):
        xf = torch.nn.functional.pad(x[r:r + step].float(), (0, nb * KB - K)).view(-1, nb, KB)
        amax = xf.abs().amax(dim=-1)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q[r:r + step] = (xf / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(-1, nb * KB)[:, :K]
        scale[r:r + step] = s
    return q, scale


def fp8_linear_reference(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """What fp8_linear computes, in torch (fp32): the same activation quantization, one fp32 matmul per 128-input
    block of both operands' e4m3 values, scaled by the block's activation and weight scales and summed."""
    q, sx = quantize_activations(x)
    M, K = x.shape
    wq = w.q.float()  # [N, K] e4m3 values
    sw = w.scale.float().repeat_interleave(FP8_BLOCK[0], dim=0)[: w.n]  # [N, ceil(K / 128)]
    y = torch.zeros(M, w.n, dtype=torch.float32, device=x.device)
    for j in range(-(-K // KB)):
        k0, k1 = j * KB, min(K, (j + 1) * KB)
        y += (q[:, k0:k1].float() @ wq[:, k0:k1].T) * sx[:, j : j + 1] * sw[:, j][None, :]
    if b is not None:
        y += b.float()
    return y.to(x.dtype)


@triton.jit
def _fp8_gemm(xq, sx, wq, sw, b, y, M, N, K, stride_y, SK: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, KB: tl.constexpr, STEPS: tl.constexpr, EVEN_K: tl.constexpr,
              HAS_BIAS: tl.constexpr, F32: tl.constexpr):
    """y[m, n] for one [BLOCK_M, BLOCK_N] tile: sum over 128-input steps of dot(xq, wq^T) * sx[m] * sw[n]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ld = tl.minimum(m, M - 1)  # edge tiles re-read the last row / column instead of masking
    n_ld = tl.minimum(n, N - 1)
    kk = tl.arange(0, KB)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j in range(STEPS):
        k = j * KB + kk
        if EVEN_K:
            a = tl.load(xq + m_ld[:, None] * K + k[None, :])
            w = tl.load(wq + n_ld[:, None] * K + k[None, :], eviction_policy="evict_first")
        else:  # the K tail: zero bytes are e4m3 zeros
            a = tl.load(xq + m_ld[:, None] * K + k[None, :], mask=(k < K)[None, :], other=0)
            w = tl.load(wq + n_ld[:, None] * K + k[None, :], mask=(k < K)[None, :], other=0)
        a = a.to(tl.float8e4nv, bitcast=True)
        w = w.to(tl.float8e4nv, bitcast=True)
        if F32:
            part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            # [BLOCK_M, BLOCK_N] fp32 on e4m3 tensor cores; each instruction's sum promoted to fp32 at once
            part = tl.dot(a, tl.trans(w), max_num_imprecise_acc=IMPRECISE_ACC)
        s_a = tl.load(sx + m_ld * SK + j)  # [BLOCK_M]
        s_w = tl.load(sw + (n_ld // 128) * SK + j)  # [BLOCK_N]: the rows' 128-row blocks
        acc += part * s_a[:, None] * s_w[None, :]
    if HAS_BIAS:
        acc += tl.load(b + n_ld).to(tl.float32)[None, :]
    tl.store(y + m[:, None] * stride_y + n[None, :], acc.to(y.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


def pick_blocks(M: int, N: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 128 x 128 tiles (one weight scale block a tile) for long
    prompts, 64-row tiles for short ones."""
    if M <= 64:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def fp8_linear(x: torch.Tensor, w, b: torch.Tensor | None = None, checked: bool = False) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ dequant(w).T + b -> [M, N] in x's dtype, on e4m3 tensor cores: check
    fp8_gemm_supported first (checked=True: the caller just did)."""
    if not checked and not fp8_gemm_supported(x, w, b):
        raise ValueError(f"fp8_linear declines x {tuple(x.shape)} {x.dtype} on {x.device} @ {w!r}")
    M, K = x.shape
    N = w.n
    q, sx = quantize_activations(x.contiguous())
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm, bn, warps, stages = pick_blocks(M, N)
    steps = -(-K // KB)
    _fp8_gemm[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        q.view(torch.uint8), sx.contiguous(), w.q.view(torch.uint8), w.scale, b if b is not None else y, y, M, N, K,
        y.stride(0), SK=steps, BLOCK_M=bm, BLOCK_N=bn, KB=KB, STEPS=steps, EVEN_K=steps * KB == K,
        HAS_BIAS=b is not None, F32=wide_math(x), num_warps=warps, num_stages=stages)
    return y
