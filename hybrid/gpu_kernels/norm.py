"""Residual add + RMSNorm in one kernel: (h + delta, rms_norm(h + delta) * weight).

Rounding as the unfused chain: the sum is rounded to the activation dtype (what `h + delta` stores), then
normalised in fp32 and scaled by the weight, rounded once (what F.rms_norm does on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid.gpu_kernels.launch import next_pow2


@triton.jit
def _add_rms_norm(h, delta, w, h_out, y_out, D, stride_h, stride_d, stride_ho, stride_y, eps,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < D
    x = tl.load(h + row * stride_h + i, mask=m, other=0.0).to(tl.float32)
    x += tl.load(delta + row * stride_d + i, mask=m, other=0.0).to(tl.float32)
    x = x.to(h_out.dtype.element_ty).to(tl.float32)  # the residual stream's own rounding
    tl.store(h_out + row * stride_ho + i, x.to(h_out.dtype.element_ty), mask=m)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    wt = tl.load(w + i, mask=m, other=0.0).to(tl.float32)
    tl.store(y_out + row * stride_y + i, (x * rstd * wt).to(y_out.dtype.element_ty), mask=m)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """h, delta [..., D] (delta may be another dtype, e.g. fp32, or live in mapped host memory) -> (h + delta,
    its RMSNorm scaled by weight [D]), both in h's dtype and shape."""
    D = h.shape[-1]
    h2, d2 = h.reshape(-1, D), delta.reshape(-1, D)
    if h2.stride(-1) != 1 or d2.stride(-1) != 1:
        h2, d2 = h2.contiguous(), d2.contiguous()
    rows = h2.shape[0]
    h_out = torch.empty(rows, D, dtype=h.dtype, device=h.device)
    y = torch.empty_like(h_out)
    if rows:
        _add_rms_norm[(rows,)](h2, d2, weight, h_out, y, D, h2.stride(0), d2.stride(0), h_out.stride(0),
                               y.stride(0), float(eps), BLOCK=next_pow2(D))
    return h_out.view(h.shape), y.view(h.shape)
