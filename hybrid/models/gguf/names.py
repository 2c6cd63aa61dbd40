"""Which GGUF tensors make each of our parameters, and the transforms llama.cpp's converter
(convert_hf_to_gguf.py) applied that loading undoes.

Names are llama.cpp's (gguf-py constants.py TENSOR_NAMES, src/llama-arch.cpp): `token_embd`, `output`,
`output_norm`, `blk.N.attn_{norm,q,k,v,output,q_norm,k_norm,sinks}`, `blk.N.ffn_{norm,gate,up,down}` (dense),
`blk.N.ffn_gate_inp` (router, + `.bias` for gpt-oss), `blk.N.exp_probs_b.bias` (the sigmoid router's score
bias), `blk.N.ffn_{gate,up,down}_shexp` (shared experts) and `ffn_gate_inp_shexp` (Qwen2-MoE's shared-expert
gate), `blk.N.ffn_{gate,up,down}_exps` (all experts of a layer stacked, [E, F, D] / [E, D, F] in torch order;
or gate and up fused as `ffn_gate_up_exps` [E, 2F, D]), MLA's `attn_q_a`, `attn_q_a_norm`, `attn_q_b`,
`attn_kv_a_mqa`, `attn_kv_a_norm` and `attn_kv_b` or its split `attn_k_b` / `attn_v_b`. GLM-4.5 and gpt-oss
call the post-attention norm `post_attention_norm`.

Transforms undone here:
- llama (Mixtral): the converter permutes the rows of q and k (weights and biases) per head from the
  half-split rope layout to interleaved pairs (LlamaModel.permute: reshape(H, 2, hd/2, ...).swapaxes(1, 2));
  the inverse is reshape(H, hd/2, 2, ...).swapaxes(1, 2).
- deepseek2: kv_b_proj [H * (nope + v), rank] is stored split for the absorbed MLA: attn_k_b [H, rank, nope]
  (each head's key rows transposed) and attn_v_b [H, v, rank]; they are joined back.
- gpt-oss: the interleaved gate_up of the Hugging Face checkpoint is stored as separate gate and up stacks,
  down transposed to [E, D, F], the biases split the same way: our StackedExperts layout as it is.
Dims of size 1 may differ (a [1, D] gate may be stored as [D]); the values are reshaped to ours.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from hybrid.models.config import ModelConfig

# our parameter name (layer as {i}) -> GGUF tensor name
NAMES = {
    "embed": "token_embd.weight",
    "lm_head": "output.weight",
    "norm.weight": "output_norm.weight",
    "layers.{i}.attn_norm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.mlp_norm.weight": "blk.{i}.ffn_norm.weight",
    **{f"layers.{{i}}.attn.{p}_proj.{t}": f"blk.{{i}}.attn_{g}.{t}"
       for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"), ("q_a", "q_a"), ("q_b", "q_b"),
                    ("kv_a", "kv_a_mqa"), ("kv_b", "kv_b")) for t in ("weight", "bias")},
    "layers.{i}.attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.attn.q_a_norm.weight": "blk.{i}.attn_q_a_norm.weight",
    "layers.{i}.attn.kv_a_norm.weight": "blk.{i}.attn_kv_a_norm.weight",
    "layers.{i}.attn.sinks": "blk.{i}.attn_sinks.weight",
    **{f"layers.{{i}}.mlp.{p}_proj": f"blk.{{i}}.ffn_{p}.weight" for p in ("gate", "up", "down")},
    "layers.{i}.moe.router": "blk.{i}.ffn_gate_inp.weight",
    "layers.{i}.moe.router_bias": "blk.{i}.ffn_gate_inp.bias",
    "layers.{i}.moe.score_bias": "blk.{i}.exp_probs_b.bias",
    **{f"layers.{{i}}.moe.shared.{p}_proj": f"blk.{{i}}.ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    "layers.{i}.moe.shared_gate": "blk.{i}.ffn_gate_inp_shexp.weight",
}
POST_NORM = {"glm4moe": "blk.{i}.post_attention_norm.weight", "gpt-oss": "blk.{i}.post_attention_norm.weight"}
EXPERTS = {"w_gate": "blk.{i}.ffn_gate_exps.weight", "w_up": "blk.{i}.ffn_up_exps.weight",
           "w_down": "blk.{i}.ffn_down_exps.weight"}
FUSED_GATE_UP = "blk.{i}.ffn_gate_up_exps.weight"
EXPERT_BIASES = {"gate": "blk.{i}.ffn_gate_exps.bias", "up": "blk.{i}.ffn_up_exps.bias",
                 "down": "blk.{i}.ffn_down_exps.bias"}
K_B, V_B = "blk.{i}.attn_k_b.weight", "blk.{i}.attn_v_b.weight"
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
_BLK = re.compile(r"^blk\.(\d+)\.")


def _first(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


@dataclass(frozen=True)
class Source:
    """How one of our tensors is made: the GGUF tensors it reads (`names`, each expected with `shapes[k]`,
    torch order, dims of size 1 aside) and `build(float32 tensors in that order) -> our values` (reshaped to our
    shape afterwards)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    build: Callable[[list[torch.Tensor]], torch.Tensor] = _first


def is_plain(source: Source) -> bool:
    """Whether the Source is one GGUF tensor taken as it is (no transform)."""
    return len(source.names) == 1 and source.build is _first


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's LlamaModel.permute: rows of each head from interleaved rope pairs back to the
    half-split layout (weights [H*hd, D] or biases [H*hd])."""
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """attn_k_b [H, rank, nope] and attn_v_b [H, v, rank] -> kv_b_proj [H * (nope + v), rank]."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])


def template(name: str) -> tuple[str, int | None]:
    m = _LAYER.match(name)
    return (f"layers.{{i}}.{m.group(2)}", int(m.group(1))) if m else (name, None)


def gguf_layer(name: str) -> int | None:
    m = _BLK.match(name)
    return int(m.group(1)) if m else None


def param_source(arch: str, cfg: ModelConfig, name: str, shape: tuple[int, ...], have) -> Source:
    """The Source of our parameter `name` of `shape`; `have(gguf name) -> bool` says what the file holds.
    KeyError for a parameter no GGUF name is known for (a programming error, not a file's)."""
    key, layer = template(name)
    stored = (POST_NORM.get(arch, NAMES[key]) if key == "layers.{i}.mlp_norm.weight" else NAMES[key]).format(i=layer)
    if arch == "llama" and key.startswith(("layers.{i}.attn.q_proj.", "layers.{i}.attn.k_proj.")):
        heads = cfg.num_heads if ".q_proj." in key else cfg.num_kv_heads
        return Source((stored,), (shape,), lambda ts, h=heads: unpermute_rope_rows(ts[0], h))
    if key == "layers.{i}.attn.kv_b_proj.weight" and have(K_B.format(i=layer)):
        m, H = cfg.mla, cfg.num_heads
        shapes = ((H, m.kv_lora_rank, m.qk_nope_head_dim), (H, m.v_head_dim, m.kv_lora_rank))
        return Source((K_B.format(i=layer), V_B.format(i=layer)), shapes, lambda ts: join_kv_b(*ts))
    return Source((stored,), (shape,))


@dataclass(frozen=True)
class ExpertTensor:
    """One GGUF tensor of a layer's experts: `which` is w_gate / w_up / w_down, gate_up (fused: gate rows, then
    up rows) or a bias (gate / up / down); `shape` in torch order."""

    name: str
    which: str
    shape: tuple[int, ...]


def expert_tensors(cfg: ModelConfig, layer: int, have) -> list[ExpertTensor]:
    """The GGUF tensors holding MoE layer `layer`'s experts (and their biases, gpt-oss)."""
    E, F_, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    fused = FUSED_GATE_UP.format(i=layer)
    if have(fused) and not have(EXPERTS["w_gate"].format(i=layer)):
        out = [ExpertTensor(fused, "gate_up", (E, 2 * F_, D))]
    else:
        out = [ExpertTensor(EXPERTS[w].format(i=layer), w, s) for w, s in
               (("w_gate", (E, F_, D)), ("w_up", (E, F_, D)))]
    out.append(ExpertTensor(EXPERTS["w_down"].format(i=layer), "w_down", (E, D, F_)))
    if cfg.expert_fn.bias:
        out += [ExpertTensor(EXPERT_BIASES[b].format(i=layer), b, (E, n)) for b, n in
                (("gate", F_), ("up", F_), ("down", D))]
    return out


def skipped(name: str, cfg: ModelConfig, have, mtp_layers: int = 0) -> str | None:
    """Why a GGUF tensor is deliberately not loaded (None: it must be used): the `mtp_layers` multi-token-
    prediction layers after the decoder's (nextn_predict_layers), and a legacy attn_kv_b kept beside its split
    form."""
    layer = gguf_layer(name)
    if layer is not None and cfg.num_layers <= layer < cfg.num_layers + mtp_layers:
        return "multi-token-prediction layer (index >= the decoder's layer count; speculative decoding, not used)"
    if layer is not None and name == f"blk.{layer}.attn_kv_b.weight" and have(K_B.format(i=layer)):
        return "attn_kv_b beside attn_k_b / attn_v_b (the same weights; the split form is read)"
    return None


def same_shape(found: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Shapes equal once dims of size 1 are dropped (llama.cpp compares ne with trailing 1s ignored)."""
    return tuple(d for d in found if d != 1) == tuple(d for d in expected if d != 1)
