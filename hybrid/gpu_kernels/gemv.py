"""Decode-sized dense projections: y = x @ w.T (+ bias) for x [T, K] with T <= 8, in one Triton kernel.

Why by hand: at batch 1 the decoder layer's dense projections run cuBLAS kernels sized for GEMMs, which
stream the weights well below HBM bandwidth (o_proj adds a split-K reduce kernel; the router's small matrix is
all latency). A GEMV only has to stream W once at full bandwidth, so the kernel is built for that, not for
FLOPs.

Design. One program per BLOCK_N rows of W (optionally times `split` slices of K); each streams its rows in
BLOCK_K-wide tiles (16-byte vector loads: K is a compile-time constant and a multiple of 16, rows past N are
clamped to row N-1 rather than masked, so only a K tail is ever masked) and accumulates in fp32. Two ways to do the
multiply-adds, picked by the config:
- FMA (`dot=False`): CUDA-core multiply-adds, accumulated element-wise in fp32 ([BLOCK_N, BLOCK_K] at T = 1,
  [T, BLOCK_N, BLOCK_K] at T > 1, T padded to a power of two) and reduced over K once after the loop, so the
  loop has no shuffles. At T = 1 x's row is loaded with W's tile shape (pointers broadcast over the rows), so
  both loads share one layout and nothing goes through shared memory: per tile, 16-byte loads and FMAs only
  (read off the sm_90 SASS when this was written). The K loop is unrolled (`unroll`), so ptxas issues most of a program's W loads
  before the first FMA: Triton pipelines only loads that feed a dot, and a rolled loop would keep one tile in
  flight. At T > 1 Triton re-lays x and W through shared memory for the 3-D products every tile, which is why
  the table takes the dot there.
- dot (`dot=True`): tensor-core tl.dot with the T rows padded to 16 (rows past T repeat row T-1: each output
  row depends only on its own x row, and the padded rows are never stored), bf16/fp16 operands, fp32
  accumulator; the loop stays rolled so Triton pipelines the W tiles through shared memory (cp.async,
  num_stages deep).
Split-K (`split > 1`) is deterministic: each K slice writes its fp32 partial [T, N] to a workspace and a second
small kernel sums the slices in slice order, adds the bias and rounds once. No atomics, so a given config gives
bitwise the same output on every call (eager or captured); different configs (block_k, split, dot) sum in
different orders and agree only to fp32 rounding before the final cast. The price of splitting is the second
launch (what cuBLAS's o_proj pays too), so the default table splits nothing and uses small BLOCK_N instead
(256-640 programs on q/k/v and o_proj at T = 1; 32 on the router, whose time is latency anyway).
The table's configs compile for sm_90 without register spills (triton.compile for GPUTarget("cuda", 90, 32)
needs no GPU: tests/test_gpu_kernels_gemv.py checks it).

The config table (`TABLE`) is keyed by T and (N, K) ranges. Timed against cuBLAS with the weights rotated past
L2, its configs beat cuBLAS at one row (q/k/v, o_proj and the router) and lost at eight, so the model calls
this kernel at one row only (layers.decode_linear).
On the CPU the same source runs in Triton's interpreter (TRITON_INTERPRET=1, see launch.py): operands are
widened to fp32 first and dots run in IEEE fp32 (the interpreter's bf16 arithmetic is wrong), and its
fp32->bf16 casts truncate where the GPU rounds.
Reference: F.linear (tests/test_gpu_kernels_gemv.py). Callers check `linear_small_supported` and otherwise run
F.linear.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from hybrid.gpu_kernels.launch import next_pow2, wide_math

MAX_T = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIG = 1 << 62


@dataclass(frozen=True)
class GemvConfig:
    """Block sizes (powers of two), launch options, K split (1 = none) and the multiply-add kind."""
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1
    split: int = 1
    dot: bool = False
    unroll: bool | None = None  # None: unrolled for FMA, rolled (and pipelined) for dot

    def __post_init__(self):
        if self.unroll is None:
            object.__setattr__(self, "unroll", not self.dot)
        for v in (self.block_n, self.block_k, self.num_warps):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{self}: block sizes and num_warps must be powers of two")
        if self.split < 1 or self.num_stages < 1:
            raise ValueError(f"{self}: split and num_stages must be >= 1")
        if self.dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"{self}: tl.dot needs block_n and block_k >= 16")

    def short(self) -> str:
        kind = "dot" if self.dot else "fma"
        roll = "" if self.unroll == (not self.dot) else (" unrolled" if self.unroll else " rolled")
        return f"{kind} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} split{self.split}{roll}"


# (max T, max N, max K, config): the first row that fits is taken; the last rows are the defaults. FMA at T = 1
# keeps block_n * block_k fp32 accumulators over 32 * num_warps threads (32 each below; 90-160 registers on
# sm_90 with the unrolled loop's loads in flight: 3-5 programs of 4 warps a multiprocessor). T > 1 takes the dot: the FMA
# path's [T, block_n, block_k] products need x and W re-laid through shared memory every tile (see _tile).
TABLE: tuple[tuple[int, int, int, GemvConfig], ...] = (
    # routers (N = 128-256): latency-bound; 4 rows a program for 32-64 programs at T = 1
    (1, 512, BIG, GemvConfig(block_n=4, block_k=512, num_warps=4)),
    (8, 512, BIG, GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=4, dot=True)),
    # q/k/v, o_proj and other dense projections: 8 rows a program at T = 1 (256-640 programs at N = 2048-5120)
    (1, BIG, BIG, GemvConfig(block_n=8, block_k=512, num_warps=4)),
    (8, BIG, BIG, GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=3, dot=True)),
)


def pick_config(T: int, N: int, K: int) -> GemvConfig:
    """The table's config for T rows and a [N, K] weight, its blocks clipped to the shape."""
    for t_max, n_max, k_max, cfg in TABLE:
        if T <= t_max and N <= n_max and K <= k_max:
            return fit(cfg, N, K)
    return fit(GemvConfig(), N, K)


def fit(cfg: GemvConfig, N: int, K: int) -> GemvConfig:
    """Blocks no larger than the shape needs (a 96-wide K does not stream 512-wide tiles); dot keeps 16."""
    lo = 16 if cfg.dot else 1
    bn = max(lo, min(cfg.block_n, next_pow2(N)))
    bk = max(16, min(cfg.block_k, next_pow2(-(-K // cfg.split))))
    return cfg if (bn, bk) == (cfg.block_n, cfg.block_k) else replace(cfg, block_n=bn, block_k=bk)


def linear_small_supported(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether linear_small takes (x, w, bias); otherwise call F.linear. Declines: x not [T, K] with
    1 <= T <= 8, dtypes other than bf16/fp16/fp32 or mixed, w not a contiguous [N, K], K not a multiple of 16
    (16-byte rows), N * K past int32 offsets, a bias not [N] of x's dtype, tensors on different devices, and
    CPU tensors unless Triton's interpreter is on."""
    if x.dim() != 2 or w.dim() != 2 or not 1 <= x.shape[0] <= MAX_T:
        return False
    N, K = w.shape
    if x.shape[1] != K or K == 0 or K % 16 or N == 0 or N * K >= 2 ** 31:
        return False
    if x.dtype not in DTYPES or w.dtype != x.dtype or not w.is_contiguous() or x.stride(1) != 1:
        return False
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype or not bias.is_contiguous()
                             or bias.device != x.device):
        return False
    if w.device != x.device:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile(acc, w_rows, x_rows, x_bcast, k, K: tl.constexpr, T_PAD: tl.constexpr, EVEN_K: tl.constexpr,
          DOT: tl.constexpr, F32: tl.constexpr):
    """acc plus one BLOCK_K-wide tile's products (k: the tile's columns)."""
    km = k < K
    if EVEN_K:  # W is read once: evict it first, keep x (re-read by every program) in L2
        wt = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
    else:
        wt = tl.load(w_rows + k[None, :], mask=km[None, :], other=0.0, eviction_policy="evict_first")
    if T_PAD == 1 and not DOT:  # x's row loaded in W's tile shape: the same layout, no shuffle via shared memory
        if EVEN_K:
            xt = tl.load(x_bcast + k[None, :])
        else:
            xt = tl.load(x_bcast + k[None, :], mask=km[None, :], other=0.0)
    elif EVEN_K:
        xt = tl.load(x_rows + k[None, :])
    else:
        xt = tl.load(x_rows + k[None, :], mask=km[None, :], other=0.0)
    if DOT:
        if F32:
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wt))
    elif T_PAD == 1:
        acc += wt.to(tl.float32) * xt.to(tl.float32)
    else:
        acc += xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _gemv(x, w, b, y, ws, T, N, stride_x, stride_y, K: tl.constexpr, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, ITERS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
          UNROLL: tl.constexpr, HAS_BIAS: tl.constexpr, F32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ld = tl.minimum(n, N - 1)  # the last block re-reads row N-1 instead of masking: unmasked vector loads
    t = tl.arange(0, T_PAD)
    t_ld = tl.minimum(t, T - 1)  # padded rows repeat row T-1 (their outputs are never stored)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w + n_ld[:, None] * K
    x_rows = x + t_ld[:, None] * stride_x
    x_bcast = x + 0 * n[:, None]  # [BLOCK_N, 1] pointers to x's row (T = 1): L1 serves the repeats
    k0 = pid_k * (ITERS * BLOCK_K)
    if DOT:
        acc = tl.zeros([T_PAD, BLOCK_N], tl.float32)
    elif T_PAD == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # reduced over K once, after the loop
    else:
        acc = tl.zeros([T_PAD, BLOCK_N, BLOCK_K], tl.float32)
    # compile-time trip counts (the interpreter cannot loop a runtime count). Unrolled, ptxas issues most of
    # the slice's W loads before the first multiply-add (the FMA path's prefetch); the rolled loop is for dot,
    # whose W tiles Triton pipelines through shared memory (num_stages)
    if UNROLL:
        for i in tl.static_range(ITERS):
            acc = _tile(acc, w_rows, x_rows, x_bcast, k0 + i * BLOCK_K + kk, K, T_PAD, EVEN_K, DOT, F32)
    else:
        for i in range(ITERS):
            acc = _tile(acc, w_rows, x_rows, x_bcast, k0 + i * BLOCK_K + kk, K, T_PAD, EVEN_K, DOT, F32)
    if DOT:
        out = acc
    elif T_PAD == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    m = (t < T)[:, None] & (n < N)[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            out += tl.load(b + n_ld).to(tl.float32)[None, :]
        tl.store(y + t[:, None] * stride_y + n[None, :], out.to(y.dtype.element_ty), mask=m)
    else:
        tl.store(ws + (pid_k * T + t[:, None]) * N + n[None, :], out, mask=m)


@triton.jit
def _split_sum(ws, b, y, T, N, stride_y, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y = sum of the SPLIT fp32 partials [SPLIT, T, N] in slice order (+ bias), rounded once."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < T * N
    acc = tl.load(ws + i, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws + s * T * N + i, mask=m, other=0.0)
    t = i // N
    n = i - t * N
    if HAS_BIAS:
        acc += tl.load(b + n, mask=m, other=0.0).to(tl.float32)
    tl.store(y + t * stride_y + n, acc.to(y.dtype.element_ty), mask=m)


@functools.lru_cache(maxsize=256)
def _cached_config(T: int, N: int, K: int) -> GemvConfig:
    return pick_config(T, N, K)


def kernel_constants(T: int, N: int, K: int, cfg: GemvConfig, has_bias: bool, f32: bool) -> tuple[int, dict]:
    """(split, _gemv's compile-time arguments) for a fitted config: what linear_small launches (and what the
    sm_90 compile test compiles)."""
    split = min(cfg.split, -(-K // cfg.block_k))  # no empty slices
    iters = -(-K // (split * cfg.block_k))
    return split, dict(K=K, T_PAD=16 if cfg.dot else next_pow2(T), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       ITERS=iters, EVEN_K=split * iters * cfg.block_k == K, SPLIT=split, DOT=cfg.dot,
                       UNROLL=cfg.unroll, HAS_BIAS=has_bias, F32=f32)


def linear_small(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 config: GemvConfig | None = None, checked: bool = False) -> torch.Tensor:
    """x [T, K] (T <= 8) @ w.T (w [N, K] contiguous) + bias [N] -> y [T, N] in x's dtype, fp32 accumulation.
    `config`: None takes the table's (pick_config); check linear_small_supported first (checked=True: the
    caller just did, so it is not done again on the decode path)."""
    if not checked and not linear_small_supported(x, w, bias):
        raise ValueError(f"linear_small declines x {tuple(x.shape)} {x.dtype} @ w {tuple(w.shape)} {w.dtype} "
                         f"(contiguous: {w.is_contiguous()}); use F.linear")
    T, K = x.shape
    N = w.shape[0]
    cfg = _cached_config(T, N, K) if config is None else fit(config, N, K)
    split, const = kernel_constants(T, N, K, cfg, bias is not None, wide_math(x))
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    ws = torch.empty(split, T, N, dtype=torch.float32, device=x.device) if split > 1 else y
    b = bias if bias is not None else w  # a dummy pointer where there is no bias
    _gemv[(triton.cdiv(N, cfg.block_n), split)](x, w, b, y, ws, T, N, x.stride(0), y.stride(0), **const,
                                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _split_sum[(triton.cdiv(T * N, block),)](ws, b, y, T, N, y.stride(0), SPLIT=split, BLOCK=block,
                                                 HAS_BIAS=bias is not None, num_warps=4)
    return y
