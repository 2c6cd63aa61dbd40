"""Routers' top-k in one kernel: logits [T, E] -> (ids [T, K] int64, weights [T, K] fp32).

router_topk (softmax routers: Qwen, Mixtral, OLMoE, gpt-oss):

Replaces the unfused chain's cast to fp32, torch.topk (two kernels on the GPU: a radix select and a
bitonic sort) and the softmax: one program per token takes the K largest logits by
K rounds of argmax (descending, ties to the lower index, as torch.topk orders them), then
- norm_topk_prob: the softmax over those K logits (= softmax over all E, top-K, renormalised);
- otherwise: the K probabilities of the softmax over all E;
times the routed scaling factor.
router_sigmoid_topk (DeepSeek-V3, Kimi-K2, GLM-4.5): see its docstring.
Reference: hybrid.models.moe.select_experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid.gpu_kernels.launch import next_pow2


@triton.jit
def _softmax_topk(x, e, K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr, E_LAST: tl.constexpr):
    """x [E_PAD] fp32 logits (-inf past E, no NaN), e = arange(E_PAD), E_LAST = E_PAD - 1 -> (ids [K_PAD]
    int32, weights [K_PAD] fp32, 0 past K)."""
    k = tl.arange(0, K_PAD)
    vals = tl.full([K_PAD], float("-inf"), tl.float32)
    idx = tl.zeros([K_PAD], tl.int32)
    # One max per round over int64 keys: the logit's bits made order-preserving as a signed int, above the
    # index reversed (so ties go to the lower index, as torch.topk orders them); not a max and an argmax.
    bits = x.to(tl.int32, bitcast=True)
    keys = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (E_LAST - e).to(tl.int64)
    for j in tl.static_range(K):
        top_key = tl.max(keys, axis=0)
        i = E_LAST - (top_key & 0xFFFFFFFF).to(tl.int32)
        sv = (top_key >> 32).to(tl.int32)
        v = (sv ^ ((sv >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        vals = tl.where(k == j, v, vals)
        idx = tl.where(k == j, i, idx)
        keys = tl.where(e == i, -9223372036854775807 - 1, keys)
    top = tl.max(vals, axis=0)
    p = tl.exp(vals - top)  # 0 past K
    if NORM:
        w = p / tl.sum(p, axis=0)
    else:
        w = p / tl.sum(tl.exp(x - top), axis=0)
    return idx, w


@triton.jit
def _router_topk(logits, ids, wts, E, stride, scaling, K: tl.constexpr, K_PAD: tl.constexpr,
                 E_PAD: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    x = tl.load(logits + t * stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
    idx, w = _softmax_topk(x, e, K, K_PAD, NORM, E_PAD - 1)
    k = tl.arange(0, K_PAD)
    km = k < K
    tl.store(ids + t * K + k, idx.to(tl.int64), mask=km)
    tl.store(wts + t * K + k, w * scaling, mask=km)


def router_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, scaling: float = 1.0):
    """logits [T, E] (any float dtype) -> (topk_ids [T, K] int64, topk_weights [T, K] fp32)."""
    T, E = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    wts = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T:
        _router_topk[(T,)](logits, ids, wts, E, logits.stride(0), float(scaling), K=top_k, K_PAD=next_pow2(top_k),
                           E_PAD=next_pow2(E), NORM=bool(norm_topk_prob))
    return ids, wts


@triton.jit
def _router_sigmoid_topk(logits, bias, ids, wts, E, stride, scaling, G, NG, K: tl.constexpr, K_PAD: tl.constexpr,
                         E_PAD: tl.constexpr, NG_PAD: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                         GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    em = e < E
    s1 = tl.sigmoid(tl.load(logits + t * stride + e, mask=em, other=0.0).to(tl.float32))  # the weights' scores
    c1 = s1
    if HAS_BIAS:
        c1 = s1 + tl.load(bias + e, mask=em, other=0.0).to(tl.float32)  # the choice's scores
    work = tl.where(em, c1, float("-inf"))
    if GROUPED:
        # each group's score: the sum of its two best choice scores; only the TOPK_GROUP best groups stay eligible
        g = tl.arange(0, NG_PAD)
        j = tl.arange(0, G_PAD)
        m2 = (g < NG)[:, None] & (j < G)[None, :]
        off = g[:, None] * G + j[None, :]
        c2 = tl.sigmoid(tl.load(logits + t * stride + off, mask=m2, other=0.0).to(tl.float32))
        if HAS_BIAS:
            c2 = c2 + tl.load(bias + off, mask=m2, other=0.0).to(tl.float32)
        c2 = tl.where(m2, c2, float("-inf"))
        best = tl.max(c2, axis=1)
        at = tl.argmax(c2, axis=1, tie_break_left=True)
        second = tl.max(tl.where(j[None, :] == at[:, None], float("-inf"), c2), axis=1)
        gs = tl.where(g < NG, best + second, float("-inf"))
        keep = e < 0
        for r in tl.static_range(TOPK_GROUP):
            gi = tl.argmax(gs, axis=0, tie_break_left=True)
            keep = keep | ((e // G) == gi)
            gs = tl.where(g == gi, float("-inf"), gs)
        work = tl.where(keep, work, float("-inf"))
    k = tl.arange(0, K_PAD)
    w = tl.zeros([K_PAD], tl.float32)
    idx = tl.zeros([K_PAD], tl.int32)
    for jj in tl.static_range(K):
        i = tl.argmax(work, axis=0, tie_break_left=True)
        w = tl.where(k == jj, tl.sum(tl.where(e == i, s1, 0.0), axis=0), w)
        idx = tl.where(k == jj, i, idx)
        work = tl.where(e == i, float("-inf"), work)
    if NORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)  # the reference's epsilon
    km = k < K
    tl.store(ids + t * K + k, idx.to(tl.int64), mask=km)
    tl.store(wts + t * K + k, w * scaling, mask=km)


def router_sigmoid_topk(logits: torch.Tensor, score_bias: torch.Tensor | None, top_k: int, norm_topk_prob: bool,
                        n_group: int = 1, topk_group: int = 1, scaling: float = 1.0):
    """Sigmoid routers (DeepSeek-V3 "noaux_tc", GLM-4.5): logits [T, E] -> (ids [T, K] int64, weights [T, K]
    fp32), select_experts' sigmoid branch in one kernel (its ~12 kernels otherwise): the choice by sigmoid
    score + score_bias among the topk_group groups whose two best choice scores sum highest, the weights the
    unbiased scores, optionally renormalised, times the scaling factor."""
    T, E = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if E % n_group:
        raise ValueError(f"{E} experts do not split into {n_group} groups")
    G = E // n_group
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    wts = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T:
        _router_sigmoid_topk[(T,)](
            logits, logits if score_bias is None else score_bias, ids, wts, E, logits.stride(0), float(scaling), G,
            n_group, K=top_k, K_PAD=next_pow2(top_k), E_PAD=next_pow2(E), NG_PAD=next_pow2(n_group),
            G_PAD=next_pow2(G), TOPK_GROUP=topk_group, GROUPED=n_group > 1, HAS_BIAS=score_bias is not None,
            NORM=bool(norm_topk_prob))
    return ids, wts


GEMV_MAX_T = 8  # rows router_gemv_topk takes (decode batches); larger batches: F.linear + router_topk
# (experts per program, D chunk, warps): one expert a program with one warp was the fastest measured at every
# router shape of the supported models, ahead of wider programs and of cuBLAS's GEMM + router_topk.
GEMV_CONFIG = (1, 2048, 1)


@triton.jit
def _router_gemv_topk(x, w, bias, logits, cnt, ids, wts, pk_x, pk_ids, pk_w, E, D, sx, scaling,
                      K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, EB: tl.constexpr,
                      BD: tl.constexpr, ND: tl.constexpr, NB: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NORM: tl.constexpr, PACK: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)
    r = j * EB + tl.arange(0, EB)
    rm = r < E
    acc = tl.zeros([EB], tl.float32)
    for it in tl.static_range(ND):
        d = it * BD + tl.arange(0, BD)
        dm = d < D
        xr = tl.load(x + t * sx + d, mask=dm, other=0.0)
        wv = tl.load(w + r[:, None] * D + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xr.to(tl.float32)[None, :], axis=1)
        if PACK:
            if j == 0:
                tl.store(pk_x + t * D + d, xr, mask=dm)  # the CPU lane's copy of the row
    if HAS_BIAS:
        acc += tl.load(bias + r, mask=rm, other=0.0).to(tl.float32)
    acc = acc.to(x.dtype.element_ty).to(tl.float32)  # the logits F.linear returns: rounded to the model's dtype
    tl.store(logits + t * E_PAD + r, acc, mask=rm)
    # The last of the row's NB programs to finish picks the top K (its acquire sees the others' logits).
    if tl.atomic_add(cnt + t, 1, sem="acq_rel") == NB - 1:
        e = tl.arange(0, E_PAD)
        lg = tl.load(logits + t * E_PAD + e, mask=e < E, other=float("-inf"), cache_modifier=".cg")
        idx, wk = _softmax_topk(lg, e, K, K_PAD, NORM, E_PAD - 1)
        k = tl.arange(0, K_PAD)
        km = k < K
        tl.store(ids + t * K + k, idx.to(tl.int64), mask=km)
        tl.store(wts + t * K + k, wk * scaling, mask=km)
        if PACK:
            tl.store(pk_ids + t * K + k, idx.to(tl.int64), mask=km)
            tl.store(pk_w + t * K + k, wk * scaling, mask=km)
        tl.store(cnt + t, 0)  # re-armed for the next launch (graphs replay this kernel as it is)


class RouterScratch:
    """A router's kernel-owned buffers for router_gemv_topk: fp32 logits [GEMV_MAX_T, E_PAD] and one arrival
    counter per row (zero between launches: the last program of a row resets it). One per router, made
    outside graph capture and kept as long as the router (captured graphs hold their addresses); a router
    runs on one stream at a time, so launches never share them concurrently."""

    def __init__(self, E: int, device):
        self.e_pad = next_pow2(E)
        self.logits = torch.empty(GEMV_MAX_T, self.e_pad, dtype=torch.float32, device=device)
        self.cnt = torch.zeros(GEMV_MAX_T, dtype=torch.int32, device=device)


def router_gemv_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether router_gemv_topk takes these: decode-sized rows, contiguous router weights, one dtype."""
    return (x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_T and x.stride(-1) == 1 and w.is_contiguous()
            and w.dtype == x.dtype and x.shape[1] == w.shape[1])


def router_gemv_topk(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, top_k: int, norm_topk_prob: bool,
                     scaling: float, scratch: RouterScratch, into: tuple | None = None, config: tuple | None = None):
    """Softmax routers at decode sizes, the logits GEMV included: x [T, D] (T <= GEMV_MAX_T), router weights
    w [E, D] (+ bias [E]) -> (ids [T, K] int64, weights [T, K] fp32), as F.linear + router_topk give them
    (logits rounded to the model's dtype before the top-k; the sums' order differs from cuBLAS's).

    Replaces the router's cuBLAS GEMM (at batch 1 one small tile on a few SMs) and the top-k kernel:
    T x ceil(E / EB) programs each reduce EB experts' rows over the whole D, and the row's last program to
    finish (an arrival counter in `scratch`) takes the top K. config = (EB, D chunk, warps), GEMV_CONFIG by
    default.
    into = (x, ids, weights) targets (the CPU lane's page-locked inputs through their mapped aliases): the
    kernel also writes the row, ids (int64) and weights (fp32) there, which saves the lane its packing kernel."""
    T, D = x.shape
    E = w.shape[0]
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    wts = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    eb, bd, warps = config or GEMV_CONFIG
    BD = min(next_pow2(D), bd)
    nb = -(-E // eb)
    px, pi, pw = into if into is not None else (x, ids, wts)
    _router_gemv_topk[(T, nb)](
        x, w, bias if bias is not None else w, scratch.logits, scratch.cnt, ids, wts, px, pi, pw, E, D, x.stride(0),
        float(scaling), K=top_k, K_PAD=next_pow2(top_k), E_PAD=scratch.e_pad, EB=eb, BD=BD, ND=-(-D // BD), NB=nb,
        HAS_BIAS=bias is not None, NORM=bool(norm_topk_prob), PACK=into is not None, num_warps=warps)
    return ids, wts
