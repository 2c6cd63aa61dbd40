"""Decode-sized projections from quantized weights (hybrid.models.qweight: int8, int4, fp8) in one Triton
kernel, y = x @ dequant(W).T (+ bias) for x [T, K] with T <= 8; and the row-chunk de-quantizer of prefill.

Why by hand: at batch 1 a decode projection is bound by the bytes of W it streams. De-quantizing W to bf16 and
running a GEMM (or gemv.linear_small) reads the quantized bytes, writes and reads a bf16 copy; this kernel reads
only the quantized bytes and the fp32 scales (int4: about a quarter of bf16's bytes, int8 / fp8 a half).

Design. One program per BLOCK_N rows of W (times `split` slices of K, summed by gemv's deterministic
_split_sum: no atomics); rows past N are clamped to row N-1, only a K tail is masked. Each BLOCK_K tile is
walked in sub-tiles of one scale group (min(BLOCK_K, group) inputs; fp8: its 128-wide blocks): a tensor-core
tl.dot of W's raw levels [BLOCK_N, GS] (the row operand, widened in registers) with x's rows (T padded to
T_PAD = 8 by repeating row T-1), fp32 accumulator, scaled per (row, group) after the dot. Levels in x's dtype
are exact: int8 by Triton's int8 -> bf16/fp16 conversion (byte permutes, no I2F); fp8 bytes bitcast to
float8e4nv (sm_89+); an int4 nibble written into the top mantissa bits of 1.0 is 1 + nibble/16, and - 1.5
leaves (nibble - 8) / 16 (the 16 goes into the scale). The K loop is rolled: Triton pipelines W's tiles
through shared memory (cp.async, num_stages deep). Not CUDA-core FMAs (gemv's T = 1 path): widening each
level to fp32 for its own multiply-add took 1.6 to 2.5 times this path's sm_90 instructions per weight.
Budget: streaming at the H200's ~4.8 TB/s leaves an SM about 7 thread-instructions per int8 / fp8 weight and
3.5 per int4 weight; the table's configs build to about 3.1 and 5.5, so int4 may be bound by its widening
rather than by memory (bench/qgemv.py measures it).
On the CPU the same source runs in Triton's interpreter (launch.py): operands widened to fp32 (after the int4
bit trick, which is thereby tested), dots in IEEE fp32.

dequantize_rows: one program per [BLOCK_R, BLOCK_C] output tile, bytes read once, dtype written once: the same
fp32 product as QWeight.dequantize, rounded once to nearest even (bf16 on the bits: the interpreter's
fp32 -> bf16 cast truncates), so equal to it bit for bit.

Reference: F.linear(x.float(), w.dequantize(torch.float32)) and QWeight.dequantize
(tests/test_gpu_kernels_qgemv.py). Tolerances as gemv's: fp32 1e-4, bf16/fp16 outputs rounded once from fp32
(1e-2). The table's configs compile for sm_90 without register spills (tested).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from hybrid.gpu_kernels.gemv import BIG, DTYPES, MAX_T, _split_sum
from hybrid.gpu_kernels.launch import next_pow2, wide_math
from hybrid.gpu_kernels.qformat import FP8_BLOCK, KINDS, is_quantized_weight

KIND_CODE = {"int8": 0, "int4": 1, "fp8": 2}
T_PAD = 8  # x's rows as the dot's column operand (mma m16n8k16: 8 columns; 16 would double x's shared memory)


@dataclass(frozen=True)
class QGemvConfig:
    """Block sizes (powers of two; block_k counts inputs, not bytes), launch options, K split (1 = none) and
    whether the K loop is unrolled (rolled: Triton pipelines W's tiles through shared memory, num_stages deep)."""
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 2
    num_stages: int = 4
    split: int = 1
    unroll: bool = False

    def __post_init__(self):
        for v in (self.block_n, self.block_k, self.num_warps):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{self}: block sizes and num_warps must be powers of two")
        if self.block_n < 16 or self.block_k < 32:
            raise ValueError(f"{self}: tl.dot needs block_n >= 16; block_k must be >= 32 (16 bytes of int4)")
        if self.split < 1 or self.num_stages < 1:
            raise ValueError(f"{self}: split and num_stages must be >= 1")

    def short(self) -> str:
        roll = " unrolled" if self.unroll else ""
        return f"n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} split{self.split}{roll}"


# (max N, max K, config): the first row that fits is taken, for every T (the dot pads T to 8 columns anyway).
# One warp per 16 rows (mma.sync's tile; more warps than that only duplicate the widening). Timed by bench/qgemv.py
# on an H100 (int4, T = 1): up to 8192 rows a 16-row block with K split in four gives 4 x N / 16 programs, which
# o_proj 2048 x 4096 needs (128 programs unsplit on 132 SMs: 14.1 us, split 8.2 us, bf16 7.5 us), qkv 5120 x 2048
# (10.5 -> 8.5 us) and DeepSeek's o_proj 7168 x 16384 (74 -> 52 us) gain from; the 152K-row head takes 64-row
# blocks of four warps (95 -> 87 us), where a split only adds its partial sums' traffic (213 us).
TABLE: tuple[tuple[int, int, QGemvConfig], ...] = (
    (8192, BIG, QGemvConfig(block_n=16, block_k=256, num_warps=1, num_stages=4, split=4)),
    (BIG, BIG, QGemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4)),
)


def pick_config(T: int, N: int, K: int) -> QGemvConfig:
    """The table's config for T rows and a [N, K] weight, its blocks clipped to the shape."""
    for n_max, k_max, cfg in TABLE:
        if N <= n_max and K <= k_max:
            return fit(cfg, N, K)
    return fit(QGemvConfig(), N, K)


def fit(cfg: QGemvConfig, N: int, K: int) -> QGemvConfig:
    """Blocks no larger than the shape needs (block_n at least 16, block_k at least 32)."""
    bn = max(16, min(cfg.block_n, next_pow2(N)))
    bk = max(32, min(cfg.block_k, next_pow2(-(-K // cfg.split))))
    return cfg if (bn, bk) == (cfg.block_n, cfg.block_k) else replace(cfg, block_n=bn, block_k=bk)


def _group_ok(w: "QWeight") -> bool:
    """The kernels walk K in power-of-two sub-tiles inside one scale group: groups of 32 or more, powers of two."""
    return w.group >= 32 and not w.group & (w.group - 1)


def qlinear_small_supported(x: torch.Tensor, w, b: torch.Tensor | None = None) -> bool:
    """Whether qlinear_small takes (x, w, b); otherwise de-quantize (qweight.dequant_linear). Declines: w not a
    QWeight (or its group not a power of two >= 32), x not [T, K] with 1 <= T <= 8 and unit stride along K,
    dtypes other than bf16/fp16/fp32, q or scale not contiguous, q past int32 offsets, a bias not [N] of x's
    dtype, tensors on different devices, CPU tensors unless Triton's interpreter is on, and int4 with fp32 x on
    CUDA: its compiled path missed the fp32 tolerance on an H100 (a ragged 300 x 95 case) while the interpreter
    and every bf16 / fp16 case agree, so fp32 models de-quantize until that path is understood."""
    if not is_quantized_weight(w) or not _group_ok(w):
        return False
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_T or x.shape[1] != w.k or w.k == 0 or w.n == 0:
        return False
    if x.dtype not in DTYPES or x.stride(1) != 1 or not w.q.is_contiguous() or not w.scale.is_contiguous():
        return False
    if w.q.numel() >= 2 ** 31:
        return False
    if b is not None and (b.shape != (w.n,) or b.dtype != x.dtype or not b.is_contiguous() or b.device != x.device):
        return False
    if w.q.device != x.device or w.scale.device != x.device:
        return False
    if x.is_cuda and x.dtype == torch.float32 and w.kind == "int4":
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _level_int8(v):
    """uint8 bytes of int8 levels -> fp32: (byte ^ 0x80) | 0x4B000000 is 2^23 + 128 + level."""
    return ((v ^ 0x80).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _level_nibble(v):
    """A nibble (0..15, int32) -> its fp32 level nibble - 8: nibble | 0x4B000000 is 2^23 + nibble."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _levels(v, KIND: tl.constexpr):
    """The de-quantizer's levels: uint8 bytes -> fp32 (int4: the (even, odd) nibble pair; int8 / fp8: twice)."""
    if KIND == 0:
        lv = _level_int8(v)
        return lv, lv
    elif KIND == 1:
        i = v.to(tl.int32)
        return _level_nibble(i & 0xF), _level_nibble(i >> 4)
    else:
        lv = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return lv, lv


@triton.jit
def _nibble_operand(i, ONE: tl.constexpr, SHIFT: tl.constexpr, DT: tl.constexpr):
    """Nibble bits i (in place: 0x0F or 0xF0 masked) -> 1 + nibble / 16 in DT, built on the bits: the nibble
    becomes the top four mantissa bits of 1.0 (ONE), so no int->float conversion and no subtraction."""
    if SHIFT >= 0:
        bits = (i << SHIFT) | ONE
    else:
        bits = (i >> -SHIFT) | ONE
    if DT == tl.float32:
        return bits.to(tl.float32, bitcast=True)
    return bits.to(tl.int16).to(DT, bitcast=True)


@triton.jit
def _operand(v, KIND: tl.constexpr, DT: tl.constexpr, F32: tl.constexpr):
    """Loaded bytes [BLOCK_N, bytes] -> W's sub-tile [BLOCK_N, inputs] in DT (bf16, fp16 or fp32; F32: fp32):
    int8 levels and e4m3 values exactly; int4 as 1 + nibble / 16 (exact; _sub shifts it to the level)."""
    if KIND == 0:  # Triton's int8 -> bf16 / fp16 conversion (byte tricks, no I2F; the interpreter's is wrong)
        return v.to(tl.int8, bitcast=True).to(tl.float32 if F32 else DT)
    elif KIND == 1:
        if DT == tl.float32:
            i = v.to(tl.int32)
            lo = _nibble_operand(i & 0xF, 0x3F800000, 19, DT)
            hi = _nibble_operand(i & 0xF0, 0x3F800000, 15, DT)
        elif DT == tl.bfloat16:
            i = v.to(tl.int16)
            lo = _nibble_operand(i & 0xF, 0x3F80, 3, DT)
            hi = _nibble_operand(i & 0xF0, 0x3F80, -1, DT)
        else:
            i = v.to(tl.int16)
            lo = _nibble_operand(i & 0xF, 0x3C00, 6, DT)
            hi = _nibble_operand(i & 0xF0, 0x3C00, 2, DT)
        return tl.interleave(lo, hi)  # the low nibble is the even input
    elif DT == tl.float16 and not F32:  # e4m3 -> fp16: one conversion a pair (the interpreter's is wrong)
        return v.to(tl.float8e4nv, bitcast=True).to(DT)
    else:
        return v.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DT)


@triton.jit
def _load(ptrs, idx, LIMIT: tl.constexpr, EVEN_K: tl.constexpr, FIRST: tl.constexpr):
    """Unmasked where K divides evenly, else masked past LIMIT (other = 0: a zero byte or a zero input)."""
    if EVEN_K:
        if FIRST:  # W is read once: evict it first, keep x (re-read by every program) in L2
            return tl.load(ptrs, eviction_policy="evict_first")
        return tl.load(ptrs)
    if FIRST:
        return tl.load(ptrs, mask=idx < LIMIT, other=0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=idx < LIMIT, other=0)


@triton.jit
def _scale(s, n_ld, kg, K: tl.constexpr, SG: tl.constexpr, GROUP: tl.constexpr, KIND: tl.constexpr):
    """[BLOCK_N] scales of the sub-tile starting at input kg (fp8: the rows' 128-row blocks); a sub-tile wholly
    past K (the masked tail) reads the last group's."""
    kg = tl.minimum(kg, K - 1)
    if KIND == 2:
        return tl.load(s + (n_ld // 128) * SG + kg // 128)
    return tl.load(s + n_ld * SG + kg // GROUP)


@triton.jit
def _sub(acc, x, q, s, n_ld, t_ld, kg, stride_x, K: tl.constexpr, KQ: tl.constexpr, SG: tl.constexpr,
         KIND: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr, EVEN_K: tl.constexpr, F32: tl.constexpr):
    """acc [BLOCK_N, T_PAD] plus one sub-tile (GS inputs from kg, inside one scale group): W's raw levels dotted
    with x's rows on the tensor cores, then scaled per row."""
    GB: tl.constexpr = GS // 2 if KIND == 1 else GS  # bytes of a sub-tile row
    kb = (kg // 2 if KIND == 1 else kg) + tl.arange(0, GB)
    v = _load(q + n_ld[:, None] * KQ + kb[None, :], kb[None, :], KQ, EVEN_K, True)  # [BLOCK_N, GB] bytes
    ke = kg + tl.arange(0, GS)
    xv = _load(x + t_ld[:, None] * stride_x + ke[None, :], ke[None, :], K, EVEN_K, False)  # [T_PAD, GS]
    wl = _operand(v, KIND, xv.dtype, F32)
    if F32:
        wl = wl.to(tl.float32)
    if KIND == 1:
        wl = wl - 1.5  # (nibble - 8) / 16, exact in bf16 / fp16 (packed subtractions on the GPU)
    if F32:
        part = tl.dot(wl, tl.trans(xv.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(wl, tl.trans(xv))  # [BLOCK_N, T_PAD]: W is the row operand (Hopper: from registers)
    sc = _scale(s, n_ld, kg, K, SG, GROUP, KIND)
    if KIND == 1:
        sc = 16.0 * sc
    return acc + part * sc[:, None]


@triton.jit
def _tile(acc, x, q, s, n_ld, t_ld, k0, stride_x, K: tl.constexpr, KQ: tl.constexpr, SG: tl.constexpr,
          KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, GS: tl.constexpr, EVEN_K: tl.constexpr,
          F32: tl.constexpr):
    """acc plus one BLOCK_K tile starting at input k0: BLOCK_K / GS sub-tiles, one scale group each."""
    for i in tl.static_range(BLOCK_K // GS):
        acc = _sub(acc, x, q, s, n_ld, t_ld, k0 + i * GS, stride_x, K, KQ, SG, KIND, GROUP, GS, EVEN_K, F32)
    return acc


@triton.jit
def _qgemv(x, q, s, b, y, ws, T, N, stride_x, stride_y, K: tl.constexpr, KQ: tl.constexpr, SG: tl.constexpr,
           KIND: tl.constexpr, GROUP: tl.constexpr, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, GS: tl.constexpr, ITERS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
           UNROLL: tl.constexpr, HAS_BIAS: tl.constexpr, F32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ld = tl.minimum(n, N - 1)  # the last block re-reads row N-1 instead of masking
    t = tl.arange(0, T_PAD)
    t_ld = tl.minimum(t, T - 1)  # padded rows repeat row T-1 (their outputs are never stored)
    k0 = pid_k * (ITERS * BLOCK_K)
    acc = tl.zeros([BLOCK_N, T_PAD], tl.float32)
    # compile-time trip counts (the interpreter cannot loop a runtime count)
    if UNROLL:
        for i in tl.static_range(ITERS):
            acc = _tile(acc, x, q, s, n_ld, t_ld, k0 + i * BLOCK_K, stride_x, K, KQ, SG, KIND, GROUP, BLOCK_K, GS,
                        EVEN_K, F32)
    else:
        for i in range(ITERS):
            acc = _tile(acc, x, q, s, n_ld, t_ld, k0 + i * BLOCK_K, stride_x, K, KQ, SG, KIND, GROUP, BLOCK_K, GS,
                        EVEN_K, F32)
    out = tl.trans(acc)  # [T_PAD, BLOCK_N]
    m = (t < T)[:, None] & (n < N)[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            out += tl.load(b + n_ld).to(tl.float32)[None, :]
        tl.store(y + t[:, None] * stride_y + n[None, :], out.to(y.dtype.element_ty), mask=m)
    else:
        tl.store(ws + (pid_k * T + t[:, None]) * N + n[None, :], out, mask=m)


@functools.lru_cache(maxsize=256)
def _cached_config(T: int, N: int, K: int) -> QGemvConfig:
    return pick_config(T, N, K)


def kernel_constants(w_kind: str, N: int, K: int, group: int, cfg: QGemvConfig, has_bias: bool,
                     f32: bool) -> tuple[int, dict]:
    """(split, _qgemv's compile-time arguments) for a fitted config: what qlinear_small launches (and what the
    sm_90 compile test compiles)."""
    group = FP8_BLOCK[1] if w_kind == "fp8" else group
    split = min(cfg.split, -(-K // cfg.block_k))  # no empty slices
    iters = -(-K // (split * cfg.block_k))
    return split, dict(K=K, KQ=-(-K // 2) if w_kind == "int4" else K, SG=-(-K // group), KIND=KIND_CODE[w_kind],
                       GROUP=group, T_PAD=T_PAD, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       GS=min(cfg.block_k, group), ITERS=iters, EVEN_K=split * iters * cfg.block_k == K,
                       SPLIT=split, UNROLL=cfg.unroll, HAS_BIAS=has_bias, F32=f32)


def qlinear_small(x: torch.Tensor, w: "QWeight", b: torch.Tensor | None = None, config: QGemvConfig | None = None,
                  checked: bool = False) -> torch.Tensor:
    """x [T, K] (T <= 8) @ dequant(w).T + b [N] -> y [T, N] in x's dtype, fp32 accumulation, reading only w's
    quantized bytes and scales. `config`: None takes the table's; check qlinear_small_supported first
    (checked=True: the caller just did)."""
    if not checked and not qlinear_small_supported(x, w, b):
        raise ValueError(f"qlinear_small declines x {tuple(x.shape)} {x.dtype} on {x.device} @ {w!r}; "
                         "use qweight.dequant_linear")
    T, K = x.shape
    N = w.n
    cfg = _cached_config(T, N, K) if config is None else fit(config, N, K)
    split, const = kernel_constants(w.kind, N, K, w.group, cfg, b is not None, wide_math(x))
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    ws = torch.empty(split, T, N, dtype=torch.float32, device=x.device) if split > 1 else y
    bias = b if b is not None else y  # a dummy pointer where there is no bias
    _qgemv[(triton.cdiv(N, cfg.block_n), split)](x, w.q.view(torch.uint8), w.scale, bias, y, ws, T, N, x.stride(0),
                                                 y.stride(0), **const, num_warps=cfg.num_warps,
                                                 num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _split_sum[(triton.cdiv(T * N, block),)](ws, bias, y, T, N, y.stride(0), SPLIT=split, BLOCK=block,
                                                 HAS_BIAS=b is not None, num_warps=4)
    return y


# de-quantizer tile: 8 rows x 512 inputs (256 bytes of int4), 4 warps
DQ_ROWS, DQ_COLS, DQ_WARPS = 8, 512, 4


@triton.jit
def _round_bf16(v):
    """fp32 -> the nearest bf16 (ties to even) as an fp32 holding it exactly (values are finite)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant(q, s, out, r0, R, K: tl.constexpr, KQ: tl.constexpr, SG: tl.constexpr, KIND: tl.constexpr,
             GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BF16: tl.constexpr):
    """out[r - r0, :] = level * scale for rows r0 <= r < r0 + R of one [BLOCK_R, BLOCK_C] tile (inputs)."""
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = i < R
    r = r0 + tl.minimum(i, R - 1)
    srow = r // 128 if KIND == 2 else r
    if KIND == 1:
        cb = tl.program_id(1) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)  # bytes
        v = tl.load(q + r[:, None] * KQ + cb[None, :], mask=rm[:, None] & (cb < KQ)[None, :], other=0)
        lo, hi = _levels(v, KIND)
        c = 2 * cb
        sc = tl.load(s + srow[:, None] * SG + (tl.minimum(c, K - 1) // GROUP)[None, :])  # even and odd: one group
        lo = lo * sc
        hi = hi * sc
        val = tl.interleave(lo, hi)
        c = tl.interleave(c, c + 1)
    else:
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        v = tl.load(q + r[:, None] * KQ + c[None, :], mask=rm[:, None] & (c < K)[None, :], other=0)
        lv, _ = _levels(v, KIND)
        val = lv * tl.load(s + srow[:, None] * SG + (tl.minimum(c, K - 1) // GROUP)[None, :])
    if BF16:
        val = _round_bf16(val)
    tl.store(out + i[:, None] * K + c[None, :], val.to(out.dtype.element_ty), mask=rm[:, None] & (c < K)[None, :])


def dequantize_rows(w: "QWeight", r0: int, r1: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows r0:r1 of w de-quantized -> [r1 - r0, K] in dtype (bf16 / fp16 / fp32), equal to
    w.dequantize(dtype, slice(r0, r1)) bit for bit; one kernel reading the quantized bytes once."""
    if not 0 <= r0 <= r1 <= w.n:
        raise ValueError(f"rows {r0}:{r1} are outside {w.n} rows")
    if dtype not in DTYPES:
        raise ValueError(f"dequantize_rows writes bf16, fp16 or fp32, not {dtype}")
    if not (w.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError(f"dequantize_rows runs on CUDA tensors (weights on {w.device}); use QWeight.dequantize")
    if not _group_ok(w) or not w.q.is_contiguous() or not w.scale.is_contiguous() or w.q.numel() >= 2 ** 31:
        return w.dequantize(dtype, slice(r0, r1))  # what the kernel's int32 offsets and sub-tiles do not take
    R, K = r1 - r0, w.k
    out = torch.empty(R, K, dtype=dtype, device=w.device)
    if R == 0 or K == 0:
        return out
    if R * K >= 2 ** 31:  # the output's offsets are int32 too: row chunks
        rows = (2 ** 31 - 1) // K
        for a in range(r0, r1, rows):
            out[a - r0:min(a + rows, r1) - r0] = dequantize_rows(w, a, min(a + rows, r1), dtype)
        return out
    group = FP8_BLOCK[1] if w.kind == "fp8" else w.group
    grid = (triton.cdiv(R, DQ_ROWS), triton.cdiv(K, DQ_COLS))
    _dequant[grid](w.q.view(torch.uint8), w.scale, out, r0, R, K=K, KQ=w.q.shape[1], SG=w.scale.shape[1],
                   KIND=KIND_CODE[w.kind], GROUP=group, BLOCK_R=DQ_ROWS, BLOCK_C=DQ_COLS, BF16=dtype == torch.bfloat16,
                   num_warps=DQ_WARPS)
    return out
