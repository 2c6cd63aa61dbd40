"""Pure-PyTorch reference of the fused MoE expert layer: the test oracle and the `ref` ISA.

Shapes: T tokens, E experts, K experts per token, D hidden, F expert intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

# Gated activations act(gate, up). GPT-OSS's SwiGLU clamps gate from above and up on both sides, then
# computes gate * sigmoid(alpha * gate) * (up + 1) (openai/gpt-oss reference, alpha=1.702, limit=7).
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")


def gated_activation(g: torch.Tensor, u: torch.Tensor, activation: str = "silu", alpha: float = 1.702,
                     limit: float = 7.0) -> torch.Tensor:
    if activation == "silu":
        return F_.silu(g) * u
    if activation == "gelu":
        return F_.gelu(g) * u
    if activation == "swiglu_oai":
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
        return g * torch.sigmoid(alpha * g) * (u + 1)
    raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def moe_forward(x, w_gate, w_up, w_down, topk_ids, topk_weights, expert_mask=None, activation="silu",
                alpha: float = 1.702, limit: float = 7.0, b_gate=None, b_up=None, b_down=None) -> torch.Tensor:
    """out[t] = sum over k with expert_mask[ids[t,k]] of topk_weights[t,k] * expert_{ids[t,k]}(x[t]).

    x [T, D]; w_gate, w_up [E, F, D]; w_down [E, D, F]; topk_ids, topk_weights [T, K]; expert_mask bool
    [E] or None (all); optional biases b_gate, b_up [E, F] and b_down [E, D] (gpt-oss).
    expert(x) = down(act(gate(x) + b_gate, up(x) + b_up)) + b_down. fp32 accumulation; output dtype of x.
    """
    if x.dim() != 2 or w_gate.dim() != 3 or w_gate.shape != w_up.shape or w_down.dim() != 3:
        raise ValueError("moe_forward: expected x [T, D], w_gate/w_up [E, F, D], w_down [E, D, F]")
    T, D = x.shape
    E, F, Dw = w_gate.shape
    if Dw != D or tuple(w_down.shape) != (E, D, F):
        raise ValueError(f"moe_forward: x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_down "
                         f"{tuple(w_down.shape)} do not agree")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError("moe_forward: topk_ids and topk_weights must both be [T, K]")
    for name, b, shape in (("b_gate", b_gate, (E, F)), ("b_up", b_up, (E, F)), ("b_down", b_down, (E, D))):
        if b is not None and tuple(b.shape) != shape:
            raise ValueError(f"moe_forward: {name} must be {list(shape)}, got {tuple(b.shape)}")
    ids = topk_ids.long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"moe_forward: topk_ids out of range [0, {E})")
    out = torch.zeros(T, D, dtype=torch.float32)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        if expert_mask is not None and not bool(expert_mask[e]):
            continue
        tok, kk = (ids == e).nonzero(as_tuple=True)
        xe = xf[tok]  # [m, D]
        g, u = xe @ w_gate[e].float().T, xe @ w_up[e].float().T
        if b_gate is not None:
            g = g + b_gate[e].float()
        if b_up is not None:
            u = u + b_up[e].float()
        h = gated_activation(g, u, activation, alpha, limit)
        y = h @ w_down[e].float().T  # [m, D]
        if b_down is not None:
            y = y + b_down[e].float()
        out.index_add_(0, tok, y * topk_weights[tok, kk].float()[:, None])
    return out.to(x.dtype)


def activation_row(v: torch.Tensor, ldk: int, group: int, int4_fold: int | None = None) -> bytes:
    """The bytes of one token's activation row as the compiled int8/int4/mxfp4 kernels read it (csrc/driver.h
    quantize_row), the test oracle of that function: v [n] (n <= ldk) quantized as one row by quant.quantize_int8
    (127 / max|v| in fp32, rounded half to even, clamped to +-127), zero padded to ldk, as int8 (int4_fold: in the
    stored order of quant.int4_order(ldk, group, int4_fold)); then the fp32 scale max|v| / 127; then the int32 sums of the ldk / group
    natural groups. An all-zero row has scale 0 and zero values."""
    from cpu_kernels import quant

    v = v.float().flatten()
    q = torch.zeros(ldk, dtype=torch.int32)
    vals, scale = quant.quantize_int8(v[None]) if v.numel() else (torch.zeros(1, 0), torch.zeros(1))
    q[: v.numel()] = vals[0].to(torch.int32)
    sums = q.reshape(ldk // group, group).sum(1).to(torch.int32)
    stored = q[quant.int4_order(ldk, group, int4_fold)] if int4_fold is not None else q
    return stored.to(torch.int8).numpy().tobytes() + scale.reshape(1).float().numpy().tobytes() + sums.numpy().tobytes()
