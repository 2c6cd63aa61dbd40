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

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import gpu_kernels
from hybrid.gpu_kernels.l2_warm import BUDGET, L2Warmer, l2_bytes, warm_policy, within_budget
from hybrid.models.config import ModelConfig
from hybrid.models.layers import Attention, GatedMLP, RMSNorm, param, sdpa_backends
from hybrid.models.mla import MLAttention
from hybrid.models.moe import MoEBlock, StackedExperts
from hybrid.models.rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, experts: nn.Module | None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer) if cfg.mla is None else MLAttention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = MoEBlock(cfg, experts) if cfg.moe_layers[layer] else None
        self.mlp = None if cfg.moe_layers[layer] else GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size)

    def forward(self, h, pending, cos, sin, positions, slots, cache, kv_len, fresh, masks, warm=None):
        """-> (h, this layer's MLP output): the caller adds the output (the next layer's input norm does it in
        the same kernel, add_norm; the model's last layer's is added before the final norm).
        warm: None, or a callable the MoE block runs once its router has run (the model's L2 warming of the next
        layer's weights while this layer waits for its CPU lane; MoETransformer.warm_plan)."""
        if pending is None:
            x = self.attn_norm(h)
        else:
            h, x = self.attn_norm.add_norm(h, pending)
        h, x = self.mlp_norm.add_norm(h, self.attn(x, cos, sin, positions, slots, cache, kv_len, fresh, masks))
        B, T, D = h.shape
        if self.moe is None:
            return h, self.mlp(x.reshape(B * T, D)).view(B, T, D)
        return h, self.moe(x.reshape(B * T, D), after_route=warm).view(B, T, D)  # [T, D]: T = the batch's tokens

    def decode_weights(self) -> list[torch.Tensor]:
        """The big tensors a decode step of this layer reads before its experts, in the order it reads them: q, k,
        v (views of one block once fused), o_proj, the router. Empty for attention kinds that do not list theirs
        (MLA: its projections are far larger than an L2)."""
        attn = self.attn
        if not isinstance(attn, Attention):
            return []
        out = [m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
        return out + ([self.moe.router] if self.moe is not None else [])


def plan_warm(layers, budget_bytes: int) -> list[list[torch.Tensor]]:
    """Per layer: the next layer's decode_weights that fit budget_bytes (a prefix, in reading order) where the
    layer's experts wait for the CPU (HybridExperts.waits_for_cpu), else nothing."""
    plan = []
    for i, layer in enumerate(layers):
        waits = layer.moe is not None and getattr(layer.moe.experts, "waits_for_cpu", False)
        plan.append(within_budget(layers[i + 1].decode_weights(), budget_bytes) if waits and i + 1 < len(layers)
                    else [])
    return plan


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
        self._warmer = L2Warmer()  # its side stream, made by the first warming

    def warm_plan(self, h: torch.Tensor, fresh: bool) -> tuple[list[list[torch.Tensor]], str]:
        """-> (per layer, the tensors to warm into L2 while that layer waits for its CPU lane: the next layer's
        decode_weights, as many as fit BUDGET of the L2 (gpu_kernels.l2_warm); the touches' load policy). Empty lists where nothing is
        warmed: prefill (more than 8 tokens, or fresh prompts), no CUDA or fused kernels, HYBRID_L2_WARM=0, the
        last layer, and layers that do not wait for the CPU (no cold expert, expert deferral, dense MLP): there
        the touch would compete with GPU work for HBM instead of filling idle time."""
        none = [[]] * len(self.layers), ""
        if fresh or not h.is_cuda or h.shape[0] * h.shape[1] > 8 or not gpu_kernels.fused_enabled(h):
            return none
        policy = warm_policy()
        if policy is None:
            return none
        return plan_warm(self.layers, int(BUDGET * l2_bytes(h.device))), policy

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, input_ids, positions, slots, cache, last_only: bool = False,
                kv_len: int | None = None, fresh: bool = False) -> torch.Tensor:
        B, T = input_ids.shape
        window = self.cfg.smallest_window
        if fresh and window is not None and T > window and not self.cfg.attention_sinks:
            fresh = False  # the fast path has no window; take the masked path (sink attention masks either way)
        h = F.embedding(input_ids, self.embed)  # [B, T, D]
        cos, sin = self.rotary(positions, h.dtype)  # [B, T, hd] each
        masks = {}  # attention masks of this step, built once and shared by the layers
        pending = None  # the last layer's MLP output, not yet added to h
        plan, policy = self.warm_plan(h, fresh)
        with sdpa_backends(h, fresh):
            for i, layer in enumerate(self.layers):
                self._warmer.join()  # this layer's weights, warmed while the previous one waited, before its reads
                warm = None
                if plan[i]:
                    warm = functools.partial(self._warmer.start, plan[i], policy)
                h, pending = layer(h, pending, cos, sin, positions, slots, cache, kv_len, fresh, masks, warm)
        self._warmer.join()
        if pending is not None:
            h = h + pending
        if last_only:
            last = ((positions >= 0).sum(1) - 1).clamp(min=0)  # [B]
            h = h[torch.arange(B, device=h.device), last]  # [B, D]
        h = self.norm(h)
        head = self.embed if self.lm_head is None else self.lm_head
        return F.linear(h, head).float()  # [B, (T,) V]


@torch.no_grad()
def init_random_(model: MoETransformer, seed: int = 0, std: float = 0.02) -> MoETransformer:
    """Fills every weight in place: normals(0, std) for matrices, ones for norm scales, zeros for
    biases. Generated on each tensor's own device (fast on a GPU; nothing crosses PCIe)."""
    gens: dict[str, torch.Generator] = {}
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
