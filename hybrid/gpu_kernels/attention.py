"""Decode attention (one new token per row) over the static KV cache, in two or three kernels.

qk_rope_write: from the fused q/k/v GEMM's output [B, (H + 2 Hkv) hd], one program per (row, head):
    q and k heads: clip (clip_qkv), per-head RMSNorm (qk_norm "head"), rotary over the first rd dims (the
    two-halves layout of hybrid.models.rope.apply_rotary); k and v heads go to the cache at (slot, position),
    position -1 (padding) to the spare column; q heads to q [B, H, hd]. An fp8 (e4m3) cache stores each value as
    StaticKVCache.write does: rounded to the model's dtype, clamped to +-448, rounded to e4m3 (scale 1.0).
decode_attention: one program per (row, K/V head, chunk of 256 positions); the rep = H / Hkv query heads of a
    K/V head share each K/V tile (grouped-query attention without expanding K/V). Keys from max(0, pos -
    window + 1) (sliding window) to the row's position; padding rows (position -1) attend to key 0, as the
    unfused mask does. Online softmax in fp32; with more than one chunk a combine kernel merges the chunks'
    (max, sum, weighted values), with the sink logits (gpt-oss) in the denominator. K/V tiles are converted to
    the query's dtype as they are loaded (exact from fp8), so an fp8 cache attends as its read-back does.

fp8 caches need compute capability 8.9 or later (Triton's e4m3 conversions; StaticKVCache refuses older GPUs).
Triton's CPU interpreter (3.6) loads e4m3 exactly but rounds stores to it wrongly (31.99 became 16), so only the
reading kernel is checked there with fp8; the write is checked on the GPU.

References (what the tests compare with): hybrid.models.layers.Attention's unfused path (RMSNorm,
apply_rotary, StaticKVCache.write/read, SDPA or sink_attention over folded_causal_mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid.gpu_kernels.launch import next_pow2, wide_math

SPLIT = 256  # positions per attention program; fixed, so results do not depend on the context bucket
BLOCK_N = 64  # keys per tile
FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # hybrid.runtime.kv_cache.FP8_MAX: e4m3's largest finite value


@triton.jit
def _as_stored(y, q_out, cache, FP8: tl.constexpr):
    """y (fp32) in the cache's dtype. fp8: rounded to the model's dtype first (the dtype the unfused path
    computes K/V in, then casts), clamped to +-FP8_MAX (saturates, never NaN), rounded to e4m3."""
    if FP8:
        y = y.to(q_out.dtype.element_ty).to(tl.float32)
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return y.to(cache.dtype.element_ty)


@triton.jit
def _qk_rope_write(qkv, cos, sin, qw, kw, pos_ptr, slot_ptr, q_out, kc, vc,
                   stride_qkv, stride_cs, s_slot, s_col, s_head, C, eps, clip,
                   H, HKV, HD: tl.constexpr, HD_PAD: tl.constexpr, RD: tl.constexpr,
                   CLIP: tl.constexpr, HEAD_NORM: tl.constexpr, FP8: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)  # head: q heads, then k heads, then v heads
    d = tl.arange(0, HD_PAD)
    dm = d < HD
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b)
    col = tl.where(pos >= 0, pos, C)  # padding writes the spare column, which no query reads
    base = qkv + b * stride_qkv + j * HD
    x = tl.load(base + d, mask=dm, other=0.0).to(tl.float32)
    if CLIP:
        x = tl.minimum(tl.maximum(x, -clip), clip)
    half: tl.constexpr = RD // 2
    if j < H + HKV:
        # the partner of dim d in the rotation: d + rd/2 (first half, negated) or d - rd/2 (second half)
        rot = d < RD
        partner = tl.where(d < half, d + half, tl.where(rot, d - half, d))
        xp = tl.load(base + partner, mask=dm, other=0.0).to(tl.float32)
        if CLIP:
            xp = tl.minimum(tl.maximum(xp, -clip), clip)
        if HEAD_NORM:
            wq = tl.load(qw + d, mask=dm, other=0.0).to(tl.float32)
            wk = tl.load(kw + d, mask=dm, other=0.0).to(tl.float32)
            wqp = tl.load(qw + partner, mask=dm, other=0.0).to(tl.float32)
            wkp = tl.load(kw + partner, mask=dm, other=0.0).to(tl.float32)
            is_q = j < H
            w = tl.where(is_q, wq, wk)
            wp = tl.where(is_q, wqp, wkp)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
            x = (x * rstd * w).to(q_out.dtype.element_ty).to(tl.float32)  # the norm's output rounding
            xp = (xp * rstd * wp).to(q_out.dtype.element_ty).to(tl.float32)
        c = tl.load(cos + b * stride_cs + d, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin + b * stride_cs + d, mask=rot, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        y = x * c + sign * xp * s
        if j < H:
            tl.store(q_out + (b * H + j) * HD + d, y.to(q_out.dtype.element_ty), mask=dm)
        else:
            dst = kc + slot * s_slot + col * s_col + (j - H) * s_head
            tl.store(dst + d, _as_stored(y, q_out, kc, FP8), mask=dm)
    else:
        dst = vc + slot * s_slot + col * s_col + (j - H - HKV) * s_head
        tl.store(dst + d, _as_stored(x, q_out, vc, FP8), mask=dm)


@triton.jit
def _decode_attn(q, kc, vc, slot_ptr, pos_ptr, sinks, out, part_o, part_ml,
                 s_slot, s_col, s_head, scale, window, H, HKV,
                 REP: tl.constexpr, REP_PAD: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NSPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
                 F32: tl.constexpr):
    bg = tl.program_id(0)
    sp = tl.program_id(1)
    b = bg // HKV
    g = bg % HKV
    pos = tl.maximum(tl.load(pos_ptr + b).to(tl.int32), 0)  # padding (-1) attends key 0
    slot = tl.load(slot_ptr + b)
    lo = sp * SPLIT
    if window > 0:
        lo = tl.maximum(lo, pos - window + 1)
    hi = tl.minimum((sp + 1) * SPLIT, pos + 1)
    r = tl.arange(0, REP_PAD)
    d = tl.arange(0, HD_PAD)
    rm = r < REP
    dm = d < HD
    head = g * REP + r  # [REP_PAD] query heads of this K/V head
    qv = tl.load(q + (b * H + head)[:, None] * HD + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    if F32:
        qv = qv.to(tl.float32)
    m_i = tl.full([REP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([REP_PAD], tl.float32)
    acc = tl.zeros([REP_PAD, HD_PAD], tl.float32)
    kv0 = slot * s_slot + g * s_head
    # A fixed trip count with the empty tiles skipped (runtime loop bounds do not run in the interpreter).
    for it in range(0, SPLIT // BLOCK_N):
        n0 = sp * SPLIT + it * BLOCK_N
        if (n0 < hi) & (n0 + BLOCK_N > lo):
            n = n0 + tl.arange(0, BLOCK_N)
            nm = (n >= lo) & (n < hi)
            off = kv0 + n[:, None] * s_col + d[None, :]
            # in the queries' dtype: a no-op for a cache in the model's dtype, exact from fp8
            kt = tl.load(kc + off, mask=nm[:, None] & dm[None, :], other=0.0).to(q.dtype.element_ty)
            vt = tl.load(vc + off, mask=nm[:, None] & dm[None, :], other=0.0).to(q.dtype.element_ty)
            if F32:
                s = tl.dot(qv, tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(qv, tl.trans(kt))
            s = tl.where(nm[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # the probabilities in the values' read-back dtype (the model's), as the unfused attention multiplies them
            pv = p.to(q.dtype.element_ty)
            if F32:
                acc = acc * alpha[:, None] + tl.dot(pv.to(tl.float32), vt.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pv, vt)
            m_i = m_new
    if NSPLIT == 1:
        # the combine kernel's formula with one chunk (the same values as through it)
        top = m_i
        if HAS_SINKS:
            sk = tl.load(sinks + head, mask=rm, other=0.0).to(tl.float32)
            top = tl.maximum(top, sk)
        c = tl.exp(m_i - top)
        den = l_i * c
        if HAS_SINKS:
            den += tl.exp(sk - top)
        o = acc * c[:, None] / den[:, None]
        tl.store(out + (b * H + head)[:, None] * HD + d[None, :], o.to(out.dtype.element_ty),
                 mask=rm[:, None] & dm[None, :])
    else:
        slot_o = ((b * H + head) * NSPLIT + sp)  # [REP_PAD]
        tl.store(part_o + slot_o[:, None] * HD_PAD + d[None, :], acc, mask=rm[:, None])
        tl.store(part_ml + slot_o * 2, m_i, mask=rm)
        tl.store(part_ml + slot_o * 2 + 1, l_i, mask=rm)


@triton.jit
def _combine(part_o, part_ml, sinks, out, H, HD: tl.constexpr, HD_PAD: tl.constexpr, NSPLIT: tl.constexpr,
             NS_PAD: tl.constexpr, HAS_SINKS: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.arange(0, NS_PAD)
    sm = s < NSPLIT
    d = tl.arange(0, HD_PAD)
    m = tl.load(part_ml + (bh * NSPLIT + s) * 2, mask=sm, other=-1.0e30)
    l = tl.load(part_ml + (bh * NSPLIT + s) * 2 + 1, mask=sm, other=0.0)
    acc = tl.load(part_o + (bh * NSPLIT + s)[:, None] * HD_PAD + d[None, :], mask=sm[:, None], other=0.0)
    top = tl.max(m, axis=0)
    if HAS_SINKS:
        sk = tl.load(sinks + bh % H).to(tl.float32)
        top = tl.maximum(top, sk)
    c = tl.exp(m - top)  # chunks with no keys: exp(-1e30 - top) = 0
    den = tl.sum(l * c, axis=0)
    if HAS_SINKS:
        den += tl.exp(sk - top)
    o = tl.sum(acc * c[:, None], axis=0) / den
    tl.store(out + bh * HD + d, o.to(out.dtype.element_ty), mask=d < HD)




def qk_rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, eps: float, clip: float | None, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, H: int, Hkv: int) -> torch.Tensor:
    """qkv [B, (H + 2 Hkv) hd] (rows contiguous), cos/sin [B, rd], q_norm/k_norm [hd] weights or None,
    k_cache/v_cache one layer's [S, C + 1, Hkv, hd] (the model's dtype or float8_e4m3fn), slots [B], positions
    [B] -> q [B, H, hd] (K/V written)."""
    B = qkv.shape[0]
    hd = k_cache.shape[-1]
    C = k_cache.shape[1] - 1
    assert qkv.stride(-1) == 1 and qkv.shape[1] == (H + 2 * Hkv) * hd
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    cos, sin = cos.reshape(B, -1), sin.reshape(B, -1)
    if cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(B, H, hd, dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    qw = q_norm if norm else qkv  # an unused pointer where there is no norm
    kw = k_norm if norm else qkv
    _qk_rope_write[(B, H + 2 * Hkv)](
        qkv, cos, sin, qw, kw, positions, slots, q, k_cache, v_cache, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), C, float(eps), float(clip or 0.0), H, Hkv,
        HD=hd, HD_PAD=next_pow2(hd), RD=cos.shape[-1], CLIP=clip is not None, HEAD_NORM=norm,
        FP8=k_cache.dtype == torch.float8_e4m3fn)
    return q


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, L: int, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, hd] (rotated), one layer's caches [S, C + 1, Hkv, hd] (q's dtype or float8_e4m3fn), slots [B],
    positions [B] (this token's, already in the cache), L: the context bucket (positions < L; fixes the number
    of chunks), window: sliding window or None, sinks [H] or None -> [B, H * hd]."""
    B, H, hd = q.shape
    Hkv = k_cache.shape[2]
    rep = H // Hkv
    nsplit = max(1, -(-L // SPLIT))
    hd_pad = next_pow2(hd)
    out = torch.empty(B, H * hd, dtype=q.dtype, device=q.device)
    if nsplit > 1:
        part_o = torch.empty(B * H * nsplit, hd_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B * H * nsplit * 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused
    sk = sinks if sinks is not None else q
    _decode_attn[(B * Hkv, nsplit)](
        q, k_cache, v_cache, slots, positions, sk, out, part_o, part_ml, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), float(scale), int(window or 0), H, Hkv, REP=rep, REP_PAD=max(16, next_pow2(rep)),
        HD=hd, HD_PAD=hd_pad, BLOCK_N=BLOCK_N, SPLIT=SPLIT, NSPLIT=nsplit, HAS_SINKS=sinks is not None,
        F32=wide_math(q))
    if nsplit > 1:
        _combine[(B * H,)](part_o, part_ml, sk, out, H, HD=hd, HD_PAD=hd_pad, NSPLIT=nsplit,
                                  NS_PAD=next_pow2(nsplit), HAS_SINKS=sinks is not None)
    return out
