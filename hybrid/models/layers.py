"""Layers every supported family shares: RMSNorm, grouped-query attention over the static KV cache (with
per-layer sliding windows and gpt-oss's attention sinks), and the gated (SwiGLU) MLP. Weights are plain tensors created empty (no init pass: a 60 GB model must
not be initialised and then overwritten) and filled by the loader or `init_random_`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybrid import gpu_kernels
from hybrid.models.config import ModelConfig
from hybrid.models.qweight import QWeight, linear
from hybrid.models.rope import apply_rotary


# SDPA backends in priority order, cuDNN last: on the GPU box (torch 2.11, H200) SDPA picked cuDNN attention
# for the masked decode path and spent ~5.3 ms of host time per call building a plan for each new KV length
# (torch.profiler of eager decode, bench.hybrid_e2e --trace): 42 ms per step of an 8-layer model. Flash and
# memory-efficient kernels have no per-shape plans; at decode sizes attention's GPU time is microseconds.
# Captured decode keeps torch's own choice (its plan is built once, at capture; graph decode of the same
# model was ~20% slower with the memory-efficient kernel: 87 vs 109 tok/s at batch 1 in one session).
_SDPA_CAUSAL = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
_SDPA_MASKED = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # flash takes no mask; cuDNN: see above
# a prompt's later pass (rows ending at the last key): flash for a causal bias aligned to it, masks as above
_SDPA_TAIL = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(x: torch.Tensor, fresh: bool, tail: bool = False):
    """The SDPA backend choice for one forward step (entered once per step, not per layer: entering costs
    tens of microseconds of host time). CUDA only: on the CPU torch's own choice (its flash kernel takes
    masks, the memory-efficient one does not exist there)."""
    if not x.is_cuda or torch.cuda.is_current_stream_capturing():  # captured: one plan, built at capture
        return contextlib.nullcontext()
    return sdpa_kernel(_SDPA_CAUSAL if fresh else _SDPA_TAIL if tail else _SDPA_MASKED, set_priority=True)


def param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # One fused kernel instead of eight: decode is kernel-count bound (each costs a few us
            # even inside a graph). It rounds once where the reference rounds twice (<= 1 bf16 ulp).
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        # Normalise in fp32, scale in the activation dtype: the order the reference implementation
        # uses, so bf16 outputs round the same way.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, self(h + delta)): the residual add and this norm, one fused kernel where the fused
        decode kernels are on (hybrid.gpu_kernels; the same roundings)."""
        if gpu_kernels.fused_enabled(h):
            from hybrid.gpu_kernels.norm import add_rms_norm

            return add_rms_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); dense layers and Qwen2-MoE's shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = param(intermediate, hidden)  # [F, D]
        self.up_proj = param(intermediate, hidden)  # [F, D]
        self.down_proj = param(hidden, intermediate)  # [D, F]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return linear(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj), self.down_proj)


def decode_linear(x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
    """The fused decode path's dense projections, x [B, K]: one row through the decode GEMV
    (hybrid.gpu_kernels.gemv), more rows through F.linear: at one row the GEMV beat cuBLAS on the GPU box (whose
    o_proj runs as a split-K GEMM plus a reduce kernel), at eight rows it lost (BENCHMARKS.md, Choices behind
    the defaults). A quantized weight (QWeight) goes through qweight.linear, whose GEMV reads its bytes."""
    if isinstance(w, QWeight):
        return linear(x, w, b)
    if x.shape[0] == 1:
        from hybrid.gpu_kernels.gemv import linear_small, linear_small_supported

        if linear_small_supported(x, w, b):
            return linear_small(x, w, b, checked=True)
    return F.linear(x, w, b)


class Linear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, bias: bool):
        super().__init__()
        self.weight = param(fan_out, fan_in)
        self.bias = param(fan_out) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# The most bytes one attention call over the cache may take beyond its inputs and output: its boolean mask and the
# additive form SDPA makes of it (grouped-query heads folded into the query axis: rep x queries x keys), gpt-oss's fp32
# scores, MLA's keys and values expanded per head. A long pass over a long cache is split into calls of at most this
# (query blocks; MLA: head groups), so what a prefill pass holds stops growing with the context; a decode step (one
# query a row) is never split. placement.memory.context_bytes prices the same bound.
ATTENTION_BLOCK_BYTES = 256 << 20


def query_block(T: int, per_query: int) -> int:
    """Queries per attention call when each holds `per_query` bytes (ATTENTION_BLOCK_BYTES; at least one)."""
    return max(1, min(T, ATTENTION_BLOCK_BYTES // max(1, per_query)))


TAIL = "tail"  # a step's masks key: its rows end at the last key without gaps (MoETransformer.forward's tail)


def folded_causal_mask(positions: torch.Tensor, L: int, rep: int, window: int | None, masks: dict) -> torch.Tensor:
    """[B, 1, rep*T, L] bool: query t (its `rep` heads folded into the query axis, head-major) sees cache
    positions <= its own (and inside the sliding window). Built once per step and shape, kept in `masks`."""
    key = (window, rep, L)
    mask = masks.get(key)
    if mask is None:
        B, T = positions.shape
        qpos = positions.clamp(min=0)[:, None, :, None]  # [B, 1, T, 1]; padding attends key 0
        kpos = torch.arange(L, device=positions.device)[None, None, None, :]  # [1, 1, 1, L]
        mask = kpos <= qpos  # [B, 1, T, L]
        if window is not None:
            mask = mask & (kpos > qpos - window)
        mask = masks[key] = mask[:, :, None].expand(B, 1, rep, T, L).reshape(B, 1, rep * T, L)
    return mask


class Attention(nn.Module):
    """Grouped-query attention that writes K/V into a static cache and reads it back.

    forward(x [B, T, D], cos/sin [B, T, hd], positions [B, T], slots [B], cache, ...) -> [B, T, D].
    Position -1 marks padding: its K/V go to the cache's spare column (index max_context), which no
    query ever attends to, so padding writes nothing visible and the shapes stay static (CUDA graphs).
    Every path attends to K/V as the cache stores them (an fp8 cache's rounding included: StaticKVCache).
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layer, self.H, self.Hkv, self.hd = layer, H, Hkv, hd
        self.q_proj = Linear(D, H * hd, cfg.qkv_bias)
        self.k_proj = Linear(D, Hkv * hd, cfg.qkv_bias)
        self.v_proj = Linear(D, Hkv * hd, cfg.qkv_bias)
        self.o_proj = Linear(H * hd, D, cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(H * hd, cfg.rms_norm_eps), RMSNorm(Hkv * hd, cfg.rms_norm_eps)
        self.clip = cfg.clip_qkv
        self.window = cfg.window_of(layer)
        self.sinks = param(H) if cfg.attention_sinks else None  # [H] gpt-oss: sink logit per head
        self.scale = hd ** -0.5
        self._fused = None  # (qkv weight, bias, the three weights' addresses) once fused by _qkv

    def forward(self, x, cos, sin, positions, slots, cache, kv_len: int | None, fresh: bool, masks: dict):
        """masks: per forward step, shared by the layers: the attention mask built by the first layer that
        needs it is reused by the others (the same positions and cache length; fewer kernels per layer).
        The caller picks the SDPA backends for the step (sdpa_backends)."""
        B, T, _ = x.shape
        if T == 1 and not fresh and self.qk_norm != "full" and gpu_kernels.fused_enabled(x):
            fused = self._fuse_qkv(x)
            if fused is not None:
                out = self._decode_fused(x, fused, cos, sin, positions, slots, cache, kv_len)  # [B, 1, H*hd]
                return decode_linear(out.view(B, -1), self.o_proj.weight, self.o_proj.bias).view(B, 1, -1)
        q, k, v = self._qkv(x)  # [B, T, H*hd], [B, T, Hkv*hd] x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(B, T, self.H, self.hd)
        k = k.view(B, T, self.Hkv, self.hd)
        v = v.view(B, T, self.Hkv, self.hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        # one rotation over q and k together: 6 kernels instead of 10 (decode is kernel-count bound)
        qk = apply_rotary(torch.cat((q, k), dim=2), cos, sin)  # [B, T, H + Hkv, hd]
        q, k = qk[:, :, :self.H], qk[:, :, self.H:]
        cache.write(self.layer, slots, positions, k, v, step=masks)
        if fresh:  # attends to this step's K/V: as the cache holds them (an fp8 cache rounds them)
            k, v = cache.as_stored(k, v)
        return self.o_proj(self._attend(q, k, v, positions, slots, cache, kv_len, fresh, masks))

    def _qkv(self, x):
        """q, k, v from one GEMM over the three weights laid back to back (two kernel launches fewer per layer
        in decode graphs, whose per-layer floor is launch-bound)."""
        fused = self._fuse_qkv(x)
        if fused is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        w, b = fused
        return linear(x, w, b).split([self.H * self.hd, self.Hkv * self.hd, self.Hkv * self.hd], dim=-1)

    def _fuse_qkv(self, x):
        """(weight, bias) of q/k/v laid back to back, or None. The first call outside a graph capture moves the
        three weights (and biases) into one block and leaves the parameters as views of it, so the memory is
        not doubled and the loaded values stay where the parameters are."""
        mods = (self.q_proj, self.k_proj, self.v_proj)
        if self._fused is not None and self._fused[2] != tuple(m.weight.data_ptr() for m in mods):
            self._fused = None  # a weight was moved or replaced since: fuse again from the parameters
        if self._fused is None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            quant = [isinstance(m.weight, QWeight) for m in mods]
            if any(quant):
                w = QWeight.cat([m.weight for m in mods]) if all(quant) else None
                if w is None:
                    return None  # parts in different formats: three projections, unfused
            else:
                w = torch.cat([m.weight.detach() for m in mods])
            b = torch.cat([m.bias.detach() for m in mods]) if self.q_proj.bias is not None else None
            o = 0
            for m in mods:
                n = m.weight.shape[0]
                if isinstance(w, QWeight):
                    m.weight.point_at_(w, o)
                else:
                    m.weight.data = w[o:o + n]
                if b is not None:
                    m.bias.data = b[o:o + n]
                o += n
            self._fused = (w, b, tuple(m.weight.data_ptr() for m in mods))  # where the views must stay
        return None if self._fused is None else self._fused[:2]

    def _decode_fused(self, x, fused, cos, sin, positions, slots, cache, kv_len):
        """One new token per row through the fused kernels (hybrid.gpu_kernels.attention): the q/k/v GEMM, then
        norms + rotary + cache write in one kernel, then attention over each row's slot -> [B, 1, H*hd]."""
        from hybrid.gpu_kernels.attention import decode_attention, qk_rope_write

        B = x.shape[0]
        w, b = fused
        qkv = decode_linear(x.reshape(B, -1), w, b)  # [B, (H + 2 Hkv) hd]
        norm = self.qk_norm == "head"
        pos = positions.reshape(B).contiguous()
        kc, vc = cache.k[self.layer], cache.v[self.layer]  # [S, C + 1, Hkv, hd]
        q = qk_rope_write(qkv, cos, sin, self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                          self.q_norm.eps if norm else 0.0, self.clip, kc, vc, slots, pos, self.H, self.Hkv)
        L = cache.max_context if kv_len is None else min(kv_len, cache.max_context)
        out = decode_attention(q, kc, vc, slots, pos, L, self.scale, self.window, self.sinks)
        return out.view(B, 1, self.H * self.hd)

    def _attend(self, q, k, v, positions, slots, cache, kv_len, fresh, masks):
        """q [B, T, H, hd], k, v [B, T, Hkv, hd] (this step's, already in the cache) -> [B, T, H*hd]."""
        B, T = q.shape[:2]
        if self.sinks is not None:
            return self._attend_sinks(q, k, v, positions, slots, cache, kv_len, fresh, masks)
        if fresh:
            # Whole prompts starting at position 0 with no padding: the new K/V are all there is to
            # see, so causal attention over them (flash kernels) replaces reading the cache back.
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                scale=self.scale, enable_gqa=self.H != self.Hkv)
        else:
            kc, vc = (t.transpose(1, 2) for t in cache.read(self.layer, slots, kv_len))  # [B, Hkv, L, hd] each
            # Grouped-query attention without copying K/V per query head: the `rep` query heads that
            # share a K/V head are folded into the query-length axis, [B, Hkv, rep*T, hd]. (SDPA's
            # GQA flag rules out the masked memory-efficient kernel, and expanding K/V to H heads
            # would write rep times the cache on every step.) A long pass goes in query blocks whose
            # folded masks take at most ATTENTION_BLOCK_BYTES each.
            rep = self.H // self.Hkv
            L = kc.shape[2]  # a block's folded mask and SDPA's additive form of it
            return self._blocks(q, positions, L, masks, B * rep * L * (1 + q.element_size()),
                                lambda qg, mask: F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask,
                                                                                scale=self.scale))
        return out.transpose(1, 2).reshape(B, T, self.H * self.hd)

    def _blocks(self, q, positions, L: int, masks: dict, per_query: int, attend):
        """attend(qg [B, Hkv, rep*t, hd], mask [B, 1, rep*t, L]) -> [B, Hkv, rep*t, hd] over query blocks of q
        [B, T, H, hd], each query taking `per_query` bytes of the call's temporaries (ATTENTION_BLOCK_BYTES a
        block); one block (every decode step) keeps its mask in `masks` for the step's other layers.
        -> [B, T, H*hd]."""
        B, T = q.shape[:2]
        rep = self.H // self.Hkv
        c = query_block(T, per_query)
        out = q.new_empty(B, T, self.H * self.hd) if c < T else None
        for t0 in range(0, T, c):
            qb = q[:, t0:t0 + c]
            t = qb.shape[1]
            qg = qb.reshape(B, t, self.Hkv, rep, self.hd).permute(0, 2, 3, 1, 4).reshape(B, self.Hkv, rep * t, self.hd)
            mask = folded_causal_mask(positions[:, t0:t0 + c], L, rep, self.window, masks if c >= T else {})
            o = attend(qg, mask).view(B, self.Hkv, rep, t, self.hd).permute(0, 3, 1, 2, 4).reshape(B, t, -1)
            if out is None:
                return o
            out[:, t0:t0 + c] = o
        return out

    def _attend_sinks(self, q, k, v, positions, slots, cache, kv_len, fresh, masks):
        """Attention with a sink logit per head (sink_attention) over the cache (or, fresh, this step's keys,
        which are then all there is), the query heads folded as in _attend."""
        if fresh:
            kc, vc = k.transpose(1, 2), v.transpose(1, 2)  # key j is position j: whole prompts from 0
        else:
            kc, vc = (t.transpose(1, 2) for t in cache.read(self.layer, slots, kv_len))  # [B, Hkv, L, hd]
        B, rep, L = q.shape[0], self.H // self.Hkv, kc.shape[2]  # a block's folded mask and its scores
        return self._blocks(q, positions, L, masks, B * rep * L * (1 + self.Hkv * SINK_SCORE_BYTES),
                            lambda qg, mask: sink_attention(qg, kc, vc, mask, self.sinks, self.scale, rep))


# Scores of one sink_attention chunk: [B, Hkv, rep * chunk, L] values at most (ATTENTION_BLOCK_BYTES), each held as
# SINK_SCORE_BYTES at the most: the product in the inputs' dtype and in fp32 (then the probabilities, in place), the
# negated mask, or the fp32 probabilities and their cast to the values' dtype.
SINK_SCORE_BYTES = 7
SINK_CHUNK_VALUES = ATTENTION_BLOCK_BYTES // SINK_SCORE_BYTES


def sink_attention(qg, kc, vc, mask, sinks, scale: float, rep: int, chunk_values: int = SINK_CHUNK_VALUES):
    """gpt-oss's attention: softmax over the keys' scores and one more logit per head (the sink, whose value is
    zero), i.e. out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h)).

    qg [B, Hkv, rep*T, hd] (query head h = kv head * rep + r folded into the query axis, head-major), kc, vc
    [B, Hkv, L, hd], mask bool [B, 1, rep*T, L], sinks [H] -> [B, Hkv, rep*T, hd]. Scores and softmax in fp32;
    the queries are taken in chunks so that no more than `chunk_values` scores exist at once (long prefills).
    No host sync (CUDA-graph decode)."""
    B, Hkv, RT, hd = qg.shape
    L, T = kc.shape[2], RT // rep
    c = max(1, min(T, chunk_values // max(1, B * Hkv * rep * L)))
    q5, m5 = qg.view(B, Hkv, rep, T, hd), mask.view(B, 1, rep, T, L)
    sink = sinks.float().view(1, Hkv, rep, 1)  # [1, Hkv, rep, 1]
    kt = kc.transpose(-1, -2)  # [B, Hkv, hd, L]
    outs = []
    for t0 in range(0, T, c):
        qc = q5[:, :, :, t0:t0 + c]
        tc = qc.shape[3]
        s = torch.matmul(qc.reshape(B, Hkv, rep * tc, hd), kt).float().mul_(scale).view(B, Hkv, rep, tc, L)
        s = s.masked_fill_(~m5[:, :, :, t0:t0 + tc], float("-inf"))
        top = torch.maximum(s.amax(-1), sink)  # [B, Hkv, rep, tc]
        p = s.sub_(top[..., None]).exp_()  # in place: the scores' memory holds the probabilities
        p = p.div_((p.sum(-1) + torch.exp(sink - top))[..., None])
        o = torch.matmul(p.to(vc.dtype).view(B, Hkv, rep * tc, L), vc)  # [B, Hkv, rep*tc, hd]
        outs.append(o.view(B, Hkv, rep, tc, hd))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.reshape(B, Hkv, RT, hd)
