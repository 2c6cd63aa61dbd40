"""The decoder stack shared by all families: embeddings, N x (attention, MoE or dense MLP), norm, head.

MoETransformer.forward(input_ids [B, T], positions [B, T], slots [B], cache, ...) -> logits
  - positions: absolute position of each token in its sequence; -1 marks padding (writes nothing,
    its logits are garbage). Rows are right-padded: valid tokens first.
  - slots: the KV-cache slot each row reads and writes; K/V are written at (slot, position) and each
    token attends to its slot's positions <= its own (a causal mask over the cache).
  - last_only: return only each row's last valid position, logits [B, V] instead of [B, T, V].
  - kv_len: how many cache positions to attend over (eager callers pass max position + 1 to save
    work; None = the whole cache, which is what the captured decode graphs use).
  - fresh: every row is a whole prompt from position 0 with no padding (prefill fast path).
Logits come back in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.models.config import ModelConfig
from hybrid.models.layers import TAIL, Attention, GatedMLP, RMSNorm, param, sdpa_backends
from hybrid.models.mla import MLAttention
from hybrid.models.moe import MoEBlock, StackedExperts
from hybrid.models.qweight import QWeight, embedding, linear, quantize_rows
from hybrid.models.rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, experts: nn.Module | None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer) if cfg.mla is None else MLAttention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = MoEBlock(cfg, experts) if cfg.moe_layers[layer] else None
        self.mlp = None if cfg.moe_layers[layer] else GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size)

    def forward(self, h, pending, cos, sin, positions, slots, cache, kv_len, fresh, masks):
        """-> (h, this layer's MLP output): the caller adds the output (the next layer's input norm does it in
        the same kernel, add_norm; the model's last layer's is added before the final norm)."""
        if pending is None:
            x = self.attn_norm(h)
        else:
            h, x = self.attn_norm.add_norm(h, pending)
        a = self.attn(x, cos, sin, positions, slots, cache, kv_len, fresh, masks)
        B, T, D = h.shape  # the MLP takes [T, D] (T = the batch's tokens)
        h, x = self.mlp_norm.add_norm(h, a)
        ffn = self.moe if self.moe is not None else self.mlp
        return h, ffn(x.reshape(B * T, D)).view(B, T, D)


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_device: torch.device | str | None = None,
                 build_experts: bool = True):
        """Parameters are created empty on the current default device. Experts are created on
        `expert_device` (default: the same) unless build_experts=False, in which case every
        `layers[i].moe.experts` is None until the loader installs an executor."""
        super().__init__()
        self.cfg = cfg
        self.embed = param(cfg.vocab_size, cfg.hidden_size)  # [V, D]
        layers = []
        for i in range(cfg.num_layers):
            experts = None
            if cfg.moe_layers[i] and build_experts:
                experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size,
                                         device=expert_device, fn=cfg.expert_fn)
            layers.append(DecoderLayer(cfg, i, experts))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else param(cfg.vocab_size, cfg.hidden_size)  # [V, D]
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the final norm's (norms are never quantized, hybrid.models.gpu_weights)."""
        return self.norm.weight.dtype

    def forward(self, input_ids, positions, slots, cache, last_only: bool = False,
                kv_len: int | None = None, fresh: bool = False, tail: bool = False) -> torch.Tensor:
        """tail: every row's positions run without a gap or padding to kv_len - 1 (one prompt's later prefill
        pass, Engine.prefill), so a pass over the cache may attend causally aligned to the last key instead of
        through a mask (MLA's expanded passes: flash kernels take that, not a mask)."""
        B, T = input_ids.shape
        window = self.cfg.smallest_window
        if fresh and window is not None and T > window and not self.cfg.attention_sinks:
            fresh = False  # the fast path has no window; take the masked path (sink attention masks either way)
        h = embedding(input_ids, self.embed, self.dtype)  # [B, T, D]
        cos, sin = self.rotary(positions, h.dtype)  # [B, T, hd] each
        masks = {TAIL: True} if tail and not fresh else {}  # this step's attention masks, built once for the layers
        pending = None  # the last layer's MLP output, not yet added to h
        with sdpa_backends(h, fresh, TAIL in masks):
            for layer in self.layers:
                h, pending = layer(h, pending, cos, sin, positions, slots, cache, kv_len, fresh, masks)
        if pending is not None:
            h = h + pending
        if last_only:
            last = ((positions >= 0).sum(1) - 1).clamp(min=0)  # [B]
            h = h[torch.arange(B, device=h.device), last]  # [B, D]
        h = self.norm(h)
        head = self.embed if self.lm_head is None else self.lm_head
        return linear(h, head).float()  # [B, (T,) V]


@torch.no_grad()
def init_random_(model: MoETransformer, seed: int = 0, std: float = 0.02) -> MoETransformer:
    """Fills every weight in place: normals(0, std) for matrices, ones for norm scales, zeros for
    biases. Generated on each tensor's own device (fast on a GPU; nothing crosses PCIe)."""
    gens: dict[str, torch.Generator] = {}
    for name, w in model.named_modules():
        if isinstance(w, QWeight):  # quantized from normals made in row chunks (no full-size float copy)
            dev = w.device
            if str(dev) not in gens:
                gens[str(dev)] = torch.Generator(device=dev).manual_seed(seed)
            _init_quantized_(w, std, gens[str(dev)])
    for name, p in model.named_parameters():
        dev = p.device
        if str(dev) not in gens:
            gens[str(dev)] = torch.Generator(device=dev).manual_seed(seed)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gens[str(dev)])
    return model


def _init_quantized_(w: QWeight, std: float, gen: torch.Generator, chunk_values: int = 2**26) -> None:
    """Random normals quantized into w, a slice of rows at a time (whole 128-row blocks, as fp8 needs)."""
    step = max(128, chunk_values // max(1, w.k) // 128 * 128)
    for r in range(0, w.n, step):
        q, s = quantize_rows(torch.randn(min(step, w.n - r), w.k, device=w.device, generator=gen) * std, w.kind, w.group)
        w.q[r:r + q.shape[0]] = q
        s0 = r // 128 if w.kind == "fp8" else r
        w.scale[s0:s0 + s.shape[0]] = s
