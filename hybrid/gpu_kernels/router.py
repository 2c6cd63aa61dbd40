"""Softmax routers' top-k in one kernel: logits [T, E] -> (ids [T, K] int64, weights [T, K] fp32).

Replaces the unfused chain's cast to fp32, torch.topk (two kernels on the GPU box: a radix select and a
bitonic sort, ~8 us together at E = 128) and the softmax: one program per token takes the K largest logits by
K rounds of argmax (descending, ties to the lower index, as torch.topk orders them), then
- norm_topk_prob: the softmax over those K logits (= softmax over all E, top-K, renormalised);
- otherwise: the K probabilities of the softmax over all E;
times the routed scaling factor. Reference: hybrid.models.moe.select_experts (its softmax branches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid.gpu_kernels.launch import next_pow2


@triton.jit
def _router_topk(logits, ids, wts, E, stride, scaling, K: tl.constexpr, K_PAD: tl.constexpr,
                 E_PAD: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    x = tl.load(logits + t * stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    k = tl.arange(0, K_PAD)
    vals = tl.full([K_PAD], float("-inf"), tl.float32)
    idx = tl.zeros([K_PAD], tl.int32)
    work = x
    for j in tl.static_range(K):
        v = tl.max(work, axis=0)
        i = tl.argmax(work, axis=0, tie_break_left=True)
        vals = tl.where(k == j, v, vals)
        idx = tl.where(k == j, i, idx)
        work = tl.where(e == i, float("-inf"), work)
    p = tl.exp(vals - top)  # 0 past K
    if NORM:
        w = p / tl.sum(p, axis=0)
    else:
        w = p / tl.sum(tl.exp(x - top), axis=0)
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
