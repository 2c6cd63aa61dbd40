"""Multi-head Latent Attention (DeepSeek-V2 paper, sec. 2.1; DeepSeek-V3) over the static latent cache.

Per token:  c = RMSNorm(W_DKV x)  [kv_lora]          k_rope = RoPE(W_KR x)  [rope]   (shared by all heads)
            q = W_UQ RMSNorm(W_DQ x)  (or W_Q x without q_lora_rank), per head [nope + rope]
            k_h = [W_UK_h c ; k_rope],  v_h = W_UV_h c        (W_UK, W_UV: the rows of kv_b_proj)

The cache keeps only [c ; k_rope] (ModelConfig.kv_layout "latent"). Two ways to attend:
  expanded: k_h, v_h built for every head (what the reference does); used for a prefill (a fresh one, where the
      prompt's own tokens are all there is to see, or a later pass of a long prompt: more than ABSORB_MAX_T
      tokens), where the work is compute-bound anyway.
  absorbed: q_nope_h . k_nope_h = (W_UK_h^T q_nope_h) . c, so each head's query moves into latent space
      and attends over [c ; k_rope] directly; the output is o_h = W_UV_h (sum_j p_j c_j). Reads the cache
      once for all heads (one "key head" of kv_lora + rope values): the decode path, and any step that
      reads the cache with a few tokens. Its heads fold into the query axis, so its mask and scores are H x T x L:
      fine for a decode step, 1+ GB for a 2,048-token pass over 4K cached tokens, hence the expanded form there.
      `mode` forces one for tests: "auto" | "expanded" | "absorbed".
Softmax scale: (nope + rope)^-0.5, times mscale^2 with mscale = 0.1 mscale_all_dim ln(factor) + 1 under
YaRN (DeepSeek-V3's released inference code and transformers' yarn_apply_mscale do exactly this).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from hybrid.models.config import ModelConfig
from hybrid.models.layers import TAIL, Linear, RMSNorm, folded_causal_mask, query_block
from hybrid.models.qweight import QWeight, dequantize_on_device
from hybrid.models.rope import apply_rotary

MODES = ("auto", "expanded", "absorbed")
ABSORB_MAX_T = 16  # tokens per row up to which a step that reads the cache attends in latent space


def softmax_scale(cfg: ModelConfig) -> float:
    m, rope = cfg.mla, cfg.rope
    scale = m.qk_head_dim ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        ms = 1.0 if rope.factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= ms * ms
    return scale


class MLAttention(nn.Module):
    """forward(x [B, T, D], cos/sin [B, T, rope], positions [B, T], slots [B], cache, ...) -> [B, T, D];
    the same contract as hybrid.models.layers.Attention."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        m, D, H = cfg.mla, cfg.hidden_size, cfg.num_heads
        self.layer, self.H = layer, H
        self.nope, self.rope, self.vd, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        if m.q_lora_rank is None:
            self.q_proj = Linear(D, H * m.qk_head_dim, False)
        else:
            self.q_a_proj = Linear(D, m.q_lora_rank, cfg.qkv_bias)
            self.q_a_norm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(m.q_lora_rank, H * m.qk_head_dim, False)
        self.kv_a_proj = Linear(D, m.kv_lora_rank + m.qk_rope_head_dim, cfg.qkv_bias)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), False)
        self.o_proj = Linear(H * m.v_head_dim, D, cfg.o_bias)
        self.scale = softmax_scale(cfg)
        self.mode = "auto"

    @torch.no_grad()
    def rope_rows_from_interleaved_(self) -> None:
        """The loader's once-per-model fix for rope_interleave checkpoints (DeepSeek's), whose rope dims come
        out of q and kv_a_proj as (x0, x1), (x2, x3) pairs: re-orders the rows that produce them to the
        half-split layout apply_rotary rotates (x0, x2, ...; x1, x3, ...). Done to both q and k, so their
        dot products are those of the interleaved rotation; forward assumes the half-split layout."""
        perm = torch.cat((torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)))
        q = self.q_proj if hasattr(self, "q_proj") else self.q_b_proj
        head = self.nope + self.rope
        if isinstance(q.weight, QWeight):  # the same row order, moved with each row's scales
            rows = torch.arange(self.H * head).view(self.H, head)
            rows[:, self.nope:] = rows[:, self.nope:][:, perm]
            q.weight.permute_rows_(rows.reshape(-1))
        else:
            w = q.weight.view(self.H, head, -1)
            w[:, self.nope:] = w[:, self.nope:][:, perm.to(w.device)]
        kv = self.kv_a_proj
        if isinstance(kv.weight, QWeight):
            kv.weight.permute_rows_(torch.cat((torch.arange(self.rank), self.rank + perm)))
        for t in (kv.weight, kv.bias):
            if t is not None and not isinstance(t, QWeight):
                t[self.rank:] = t[self.rank:][perm.to(t.device)]

    def _up(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's rows per head: W_UK [H, nope, rank], W_UV [H, v, rank] (views, no copy; a quantized
        kv_b_proj is de-quantized for the call, by one kernel on the GPU: absorbed attention multiplies by it per
        head)."""
        w = self.kv_b_proj.weight
        if isinstance(w, QWeight):
            w = dequantize_on_device(w, dtype)
        w = w.view(self.H, self.nope + self.vd, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x, cos, sin, positions, slots, cache, kv_len: int | None, fresh: bool, masks: dict):
        B, T, _ = x.shape
        H = self.H
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(B, T, H, self.nope + self.rope)
        q_nope, q_rope = q[..., :self.nope], q[..., self.nope:]
        ckv = self.kv_a_proj(x)  # [B, T, rank + rope]
        c, k_rope = self.kv_a_norm(ckv[..., :self.rank]), ckv[..., self.rank:]
        # one rotation over q and k together (as Attention does): [B, T, H + 1, rope]
        qk = apply_rotary(torch.cat((q_rope, k_rope[:, :, None]), dim=2), cos, sin)
        q_rope, k_rope = qk[:, :, :H], qk[:, :, H]
        latent = torch.cat((c, k_rope), dim=-1)  # [B, T, rank + rope]
        cache.write(self.layer, slots, positions, latent, step=masks)
        if fresh:  # this step's latent as the cache holds it (an fp8 cache rounds it)
            latent, = cache.as_stored(latent)
        mode = self.mode if self.mode != "auto" else ("expanded" if fresh or T > ABSORB_MAX_T else "absorbed")
        if fresh and mode == "expanded":
            out = self._expanded(q_nope, q_rope, latent, None, masks)
        elif mode == "expanded":
            lat, = cache.read(self.layer, slots, kv_len)  # [B, L, rank + rope]
            out = self._expanded(q_nope, q_rope, lat, positions, masks)
        else:
            lat = latent if fresh else cache.read(self.layer, slots, kv_len)[0]
            out = self._absorbed(q_nope, q_rope, lat, hidden_keys(positions, lat.shape[1], H, masks))
        return self.o_proj(out)

    def _expanded(self, q_nope, q_rope, lat, positions, masks: dict):
        """Keys and values per head from the latent rows lat [B, L, rank + rope]; positions None = causal over
        the prompt itself (fresh), else [B, T] over the cache. -> [B, T, H * v]. Over a long context the heads go
        in groups and the queries in blocks, so that neither one group's keys and values nor one block's mask (and
        SDPA's additive form of it) take more than ATTENTION_BLOCK_BYTES."""
        B, T, H = q_nope.shape[0], q_nope.shape[1], self.H
        L, gb, qk = lat.shape[1], q_nope.element_size(), self.nope + self.rope
        pad = q_nope.is_cuda and self.vd != qk
        tail = positions is not None and TAIL in masks  # rows end at key L - 1: a causal bias, no mask
        # per head and key: kv_b_proj's output, k, and v (padded to k's width on CUDA)
        g = query_block(H, B * L * (self.nope + self.vd + qk + (qk if pad else self.vd)) * gb)
        c = T if positions is None else query_block(T, B * L * (1 + gb))
        q = torch.cat((q_nope, q_rope), dim=-1)
        if g >= H and c >= T:  # one call
            mask = causal_lower_right(T, L) if tail else \
                None if positions is None else folded_causal_mask(positions, L, 1, None, masks)
            return self._attend_heads(q, self.kv_b_proj(lat[..., :self.rank]), lat, mask, pad).reshape(B, T, H * self.vd)
        w = self.kv_b_proj.weight
        w = (dequantize_on_device(w, q.dtype) if isinstance(w, QWeight) else w).view(H, self.nope + self.vd, self.rank)
        out = q.new_empty(B, T, H, self.vd)
        for h0 in range(0, H, g):
            kv = F.linear(lat[..., :self.rank], w[h0:h0 + g].reshape(-1, self.rank))
            for t0 in range(0, T, c):
                t1 = min(T, t0 + c)
                if tail:  # the block's last query sees key L - T + t1 - 1 and none after it
                    n = L - T + t1
                    out[:, t0:t1, h0:h0 + g] = self._attend_heads(q[:, t0:t1, h0:h0 + g], kv[:, :n], lat[:, :n],
                                                                  causal_lower_right(t1 - t0, n), pad)
                    continue
                mask = None if positions is None else folded_causal_mask(positions[:, t0:t1], L, 1, None, {})
                out[:, t0:t1, h0:h0 + g] = self._attend_heads(q[:, t0:t1, h0:h0 + g], kv, lat, mask, pad)
        return out.reshape(B, T, H * self.vd)

    def _attend_heads(self, q, kv, lat, mask, pad: bool):
        """q [B, t, h, nope + rope] of h heads, kv [B, L, h * (nope + v)] their rows of kv_b_proj's output,
        lat [B, L, rank + rope], mask None (causal, fresh), [B, 1, t, L], or a causal bias aligned to the last key
        (torch's causal_lower_right: no mask is built, and flash kernels take it) -> [B, t, h, v]."""
        B, t, h = q.shape[:3]
        L = lat.shape[1]
        kv = kv.view(B, L, h, self.nope + self.vd)
        k = torch.cat((kv[..., :self.nope], lat[:, :, None, self.rank:].expand(B, L, h, self.rope)), dim=-1)
        v = kv[..., self.nope:]
        if pad:
            # flash kernels need one head dim for q, k and v: zero-pad v (its extra outputs are zeros,
            # sliced off), else a long prompt would fall to a kernel that materialises T x T scores
            v = F.pad(v, (0, self.nope + self.rope - self.vd))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None, scale=self.scale)  # [B, h, t, v]
        return out[..., :self.vd].transpose(1, 2)

    def _absorbed(self, q_nope, q_rope, lat, hidden):
        """Attention in latent space over lat [B, L, rank + rope], hidden [B, H*T, L] the keys each query may not
        see (or None): every head is a query of the one shared latent "head" (heads folded into the query axis).
        -> [B, T, H * v].
        Two batched matrix products around an fp32 softmax, not SDPA: a 576-wide key and 512-wide value leave
        SDPA only its memory-efficient kernel, whose tiles keep the output in global memory (0.83 ms a layer at 8K
        keys on an H100; with these products, kv_b_proj de-quantized in one kernel and the retimed qgemv table a
        61-layer decode step went from 146 to 32 ms). The scores
        [B, H*T, L] are fp32 (a decode step's are in the graph buffers; a pass of up to ABSORB_MAX_T tokens holds
        less than a long pass's expanded keys), the probabilities rounded once to the input dtype as a flash
        kernel rounds them."""
        B, T, H = q_nope.shape[0], q_nope.shape[1], self.H
        w_uk, w_uv = self._up(q_nope.dtype)
        q_lat = torch.einsum("bthn,hnc->bhtc", q_nope, w_uk)  # [B, H, T, rank]
        qg = torch.cat((q_lat, q_rope.transpose(1, 2)), dim=-1).reshape(B, H * T, self.rank + self.rope)
        scores = _bmm_fp32(qg, lat.transpose(1, 2)).mul_(self.scale)  # [B, H*T, L]
        if hidden is not None:
            scores.masked_fill_(hidden, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(lat.dtype)
        o = _bmm_fp32(p, lat[..., :self.rank]).to(lat.dtype)  # [B, H*T, rank]
        out = torch.einsum("bhtc,hvc->bthv", o.view(B, H, T, self.rank), w_uv)  # [B, T, H, v]
        return out.reshape(B, T, H * self.vd)


def hidden_keys(positions: torch.Tensor, L: int, H: int, masks: dict) -> torch.Tensor:
    """[B, H*T, L] bool: the cache positions each folded query (head-major) may not see, folded_causal_mask
    inverted; built once per step and kept in `masks` for the step's other layers."""
    key = ("hidden", H, L)
    hidden = masks.get(key)
    if hidden is None:
        hidden = masks[key] = ~folded_causal_mask(positions, L, H, None, {})[:, 0]
    return hidden


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32 at least: cuBLAS writes fp32 from bf16 / fp16 operands on CUDA;
    elsewhere 16-bit operands are widened first; fp32 and fp64 stay as they are."""
    if a.dtype not in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())
