"""GGUF metadata -> the config.json a Hugging Face checkpoint of the same model would carry.

The output is parsed by the family's own parse_config (hybrid.models.families), so every config check stays in
one place. The keys and their defaults are the ones llama.cpp reads for each architecture (src/llama-model.cpp,
src/models/<arch>.cpp): where a key is optional, a missing key means what it means to llama.cpp (e.g. no
expert groups, no leading dense layers), not what the Hugging Face class would default to. A few things the
metadata does not say are read from which tensors the file holds (a tensor's presence, never a file name):
tied embeddings (no output.weight), attention biases, QK-norm, the dense layers of Qwen-MoE models.

Architectures (general.architecture -> model_type): qwen3moe -> qwen3_moe, qwen2moe -> qwen2_moe, llama with
experts -> mixtral, deepseek2 -> deepseek_v3 (DeepSeek-V3 / R1 / Kimi-K2: MLA, sigmoid router), glm4moe ->
glm4_moe, gpt-oss -> gpt_oss.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from hybrid.models.errors import ModelLoadError

# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values (gguf.ExpertGatingFuncType)
GATING_SOFTMAX, GATING_SIGMOID = 1, 2
YARN_LOG_MUL_SCALE = 0.1  # the converter stores 0.1 * mscale_all_dim as rope.scaling.yarn_log_multiplier


class Meta:
    """The metadata of one file, read with the architecture prefix; a missing required key is one line
    naming the key and the file."""

    def __init__(self, metadata: dict[str, Any], arch: str, origin: str):
        self.metadata, self.arch, self.origin = metadata, arch, origin

    def key(self, name: str) -> str:
        return name if name.startswith(("tokenizer.", "general.")) else f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        return self.metadata.get(self.key(name)) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.metadata.get(self.key(name))
        return default if value is None else value

    def req(self, name: str) -> Any:
        if not self.has(name):
            raise ModelLoadError(f"{self.origin}: missing metadata key {self.key(name)!r} (required for {self.arch})")
        return self.metadata[self.key(name)]

    def number(self, name: str, default: Any = None, kind: type = int) -> Any:
        """A scalar number; a per-layer array is accepted when all its entries are equal (llama.cpp's
        get_key_or_arr), since our config has one value for every layer."""
        value = self.get(name, default) if default is not None else self.req(name)
        if isinstance(value, list):
            if not value or any(v != value[0] for v in value):
                raise ModelLoadError(f"{self.origin}: {self.key(name)} differs between layers ({value[:8]}...); "
                                     "per-layer sizes are not supported")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ModelLoadError(f"{self.origin}: {self.key(name)} must be a number, got {value!r}")
        if kind is int and value != int(value):
            raise ModelLoadError(f"{self.origin}: {self.key(name)} must be an integer, got {value!r}")
        return kind(value)


class Tensors:
    """Which tensors the file holds, for what the metadata leaves out."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes

    def has(self, name: str) -> bool:
        return name in self.shapes


def _vocab_size(m: Meta, t: Tensors) -> int:
    """{arch}.vocab_size, else the tokenizer's token count, else the embedding's rows (llama.cpp's order)."""
    if m.has("vocab_size"):
        return m.number("vocab_size")
    tokens = m.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    if t.has("token_embd.weight"):
        return t.shapes["token_embd.weight"][0]
    raise ModelLoadError(f"{m.origin}: no {m.key('vocab_size')}, tokenizer.ggml.tokens or token_embd.weight "
                         "to size the vocabulary")


def _token_ids(m: Meta) -> dict:
    """bos and eos ids; eos includes the end-of-turn / end-of-message ids llama.cpp also stops on."""
    eos = [m.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    bos = m.get("tokenizer.ggml.bos_token_id")
    return {"bos_token_id": None if bos is None else int(bos), "eos_token_id": eos or None}


def rope_parameters(m: Meta, truncate: bool = True, partial_rotary_factor: float | None = None) -> dict:
    """rope.freq_base and rope.scaling.* -> transformers' rope_parameters. YaRN's attention factor: llama.cpp's
    (0.1 ln s + 1), or with a yarn_log_multiplier (DeepSeek) mscale == mscale_all_dim == multiplier / 0.1
    (llama.cpp assumes the two equal, as DeepSeek's configs have them), times rope.scaling.attn_factor."""
    theta = m.number("rope.freq_base", 10000.0, float)
    kind = m.get("rope.scaling.type", "none")
    factor = m.get("rope.scaling.factor", m.get("rope.scale_linear"))
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if partial_rotary_factor is not None:
        out["partial_rotary_factor"] = partial_rotary_factor
    attn = m.number("rope.scaling.attn_factor", 1.0, float)
    if kind in ("none", "linear") and factor in (None, 0, 1):
        if attn != 1.0:
            raise ModelLoadError(f"{m.origin}: {m.key('rope.scaling.attn_factor')} {attn} without YaRN is not "
                                 "supported")
        return out  # llama.cpp: a linear factor of 0 or 1 is no scaling
    if kind == "linear":
        return dict(out, rope_type="linear", factor=float(factor))
    if kind != "yarn":
        raise ModelLoadError(f"{m.origin}: rope scaling {kind!r} is not supported (supported: none, linear, yarn)")
    s = m.number("rope.scaling.factor", kind=float)
    orig = m.number("rope.scaling.original_context_length", m.number("context_length"))
    out.update(rope_type="yarn", factor=s, original_max_position_embeddings=orig, truncate=truncate,
               beta_fast=m.number("rope.scaling.yarn_beta_fast", 32.0, float),
               beta_slow=m.number("rope.scaling.yarn_beta_slow", 1.0, float))
    log_mul = m.number("rope.scaling.yarn_log_multiplier", 0.0, float)
    if log_mul:
        ms = log_mul / YARN_LOG_MUL_SCALE
        out.update(mscale=ms, mscale_all_dim=ms)
    if attn != 1.0:
        base = 1.0 if log_mul else (0.1 * math.log(s) + 1.0 if s > 1 else 1.0)
        out["attention_factor"] = base * attn
    return out


def _common(m: Meta, t: Tensors, num_layers: int) -> dict:
    """What every architecture reads the same way."""
    hidden = m.number("embedding_length")
    heads = m.number("attention.head_count")
    if heads < 1:
        raise ModelLoadError(f"{m.origin}: {m.key('attention.head_count')} must be positive, got {heads}")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": m.number("attention.head_count_kv", heads),
        "head_dim": m.number("attention.key_length", hidden // heads),
        "rms_norm_eps": m.number("attention.layer_norm_rms_epsilon", kind=float),
        "max_position_embeddings": m.number("context_length"),
        "vocab_size": _vocab_size(m, t),
        "tie_word_embeddings": not t.has("output.weight"),
        "hidden_act": "silu",
        **_token_ids(m),
    }


def _layers(m: Meta) -> int:
    """Decoder layers: block_count counts the multi-token-prediction layers too (nextn_predict_layers)."""
    return m.number("block_count") - m.number("nextn_predict_layers", 0)


def _full_rotary(m: Meta, head_dim: int) -> None:
    rot = m.number("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ModelLoadError(f"{m.origin}: {m.key('rope.dimension_count')} {rot} differs from the head dim {head_dim}; "
                             f"partial rotary is not supported for {m.arch}")


def _expert_ff(m: Meta) -> int:
    """llama.cpp: expert_feed_forward_length, else feed_forward_length / expert_used_count."""
    if m.has("expert_feed_forward_length"):
        return m.number("expert_feed_forward_length")
    return m.number("feed_forward_length") // m.number("expert_used_count")


def _norm_topk(m: Meta, default: bool) -> bool:
    return bool(m.get("expert_weights_norm", default))


def _qwen(m: Meta, t: Tensors) -> dict:
    """qwen3moe / qwen2moe: llama.cpp normalises the top-k weights for Qwen3 and not for Qwen2, unless
    expert_weights_norm says otherwise; a layer without a router (ffn_gate_inp) is a dense MLP layer."""
    L = _layers(m)
    raw = _common(m, t, L)
    _full_rotary(m, raw["head_dim"])
    qwen3 = m.arch == "qwen3moe"
    raw.update(
        model_type="qwen3_moe" if qwen3 else "qwen2_moe",
        num_experts=m.number("expert_count"),
        num_experts_per_tok=m.number("expert_used_count"),
        moe_intermediate_size=_expert_ff(m),
        intermediate_size=m.number("feed_forward_length", 0),
        norm_topk_prob=_norm_topk(m, qwen3),
        mlp_only_layers=[i for i in range(L) if not t.has(f"blk.{i}.ffn_gate_inp.weight")],
        use_sliding_window=False,
        rope_parameters=rope_parameters(m),
    )
    if qwen3:
        raw["attention_bias"] = t.has("blk.0.attn_q.bias")
    else:
        raw["qkv_bias"] = t.has("blk.0.attn_q.bias")
        raw["shared_expert_intermediate_size"] = m.number("expert_shared_feed_forward_length",
                                                          m.number("feed_forward_length", 0))
    return raw


def _llama(m: Meta, t: Tensors) -> dict:
    """llama with experts: Mixtral. Dense llama checkpoints are not MoE models."""
    if m.number("expert_count", 0) == 0:
        raise ModelLoadError(f"{m.origin}: a llama model without experts (expert_count 0) is dense; "
                             "only MoE models (Mixtral) are supported")
    if t.has("rope_freqs.weight"):
        raise ModelLoadError(f"{m.origin}: rope_freqs.weight (per-frequency rope factors, Llama 3 rope scaling) "
                             "is not supported")
    raw = _common(m, t, _layers(m))
    _full_rotary(m, raw["head_dim"])
    raw.update(
        model_type="mixtral",
        num_local_experts=m.number("expert_count"),
        num_experts_per_tok=m.number("expert_used_count"),
        intermediate_size=m.number("feed_forward_length"),  # llama.cpp's llama experts are n_ff wide
        sliding_window=m.get("attention.sliding_window"),
        rope_parameters=rope_parameters(m),
    )
    return raw


def _router_groups(m: Meta) -> dict:
    return {"n_group": m.number("expert_group_count", 1) or 1,
            "topk_group": m.number("expert_group_used_count", 1) or 1}


def _gating(m: Meta, default: int) -> str:
    func = m.number("expert_gating_func", default) or default
    if func not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise ModelLoadError(f"{m.origin}: {m.key('expert_gating_func')} {func} is not softmax (1) or sigmoid (2)")
    return "sigmoid" if func == GATING_SIGMOID else "softmax"


def _deepseek2(m: Meta, t: Tensors) -> dict:
    """deepseek2 (DeepSeek-V3 / R1, Kimi-K2). MLA sizes: a file converted for llama.cpp's absorbed MLA says
    key_length_mla / value_length_mla (key_length there is the latent's); an older one key_length /
    value_length. The rope rows are interleaved pairs (llama.cpp's NORM rope), as DeepSeek publishes them."""
    L = _layers(m)
    raw = _common(m, t, L)
    heads = raw["num_attention_heads"]
    rope_dim = m.number("rope.dimension_count")
    if m.has("attention.key_length_mla"):
        key, value = m.number("attention.key_length_mla"), m.number("attention.value_length_mla")
    else:
        key, value = m.number("attention.key_length"), m.number("attention.value_length")
    q_lora = m.number("attention.q_lora_rank", 0)
    scoring = _gating(m, GATING_SOFTMAX)  # llama.cpp: files without the key are DeepSeek-V2's softmax
    raw.update(
        model_type="deepseek_v3",
        num_key_value_heads=heads,
        head_dim=rope_dim,
        n_routed_experts=m.number("expert_count"),
        num_experts_per_tok=m.number("expert_used_count"),
        moe_intermediate_size=m.number("expert_feed_forward_length"),
        intermediate_size=m.number("feed_forward_length", 0),
        n_shared_experts=m.number("expert_shared_count", 0),
        first_k_dense_replace=m.number("leading_dense_block_count", 0),
        routed_scaling_factor=m.number("expert_weights_scale", 1.0, float) or 1.0,
        norm_topk_prob=_norm_topk(m, False),
        scoring_func=scoring,
        topk_method="noaux_tc" if scoring == "sigmoid" else "greedy",
        q_lora_rank=q_lora or None,
        kv_lora_rank=m.number("attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key - rope_dim,
        v_head_dim=value,
        rope_interleave=True,
        attention_bias=t.has("blk.0.attn_q_a.bias") or t.has("blk.0.attn_q.bias"),
        rope_parameters=rope_parameters(m),
        **_router_groups(m),
    )
    return raw


def _glm4moe(m: Meta, t: Tensors) -> dict:
    """glm4moe (GLM-4.5 / 4.6 / 4.7, -Air): rope.dimension_count is head_dim * partial_rotary_factor."""
    L = _layers(m)
    raw = _common(m, t, L)
    head_dim = raw["head_dim"]
    rot = m.number("rope.dimension_count", head_dim)
    if _gating(m, GATING_SIGMOID) != "sigmoid":
        raise ModelLoadError(f"{m.origin}: glm4moe with a softmax router is not supported (GLM-4.5's is sigmoid)")
    raw.update(
        model_type="glm4_moe",
        n_routed_experts=m.number("expert_count"),
        num_experts_per_tok=m.number("expert_used_count"),
        moe_intermediate_size=m.number("expert_feed_forward_length"),
        intermediate_size=m.number("feed_forward_length", 0),
        n_shared_experts=m.number("expert_shared_count"),
        first_k_dense_replace=m.number("leading_dense_block_count", 0),
        routed_scaling_factor=m.number("expert_weights_scale", 1.0, float) or 1.0,
        norm_topk_prob=_norm_topk(m, False),
        use_qk_norm=t.has("blk.0.attn_q_norm.weight"),
        attention_bias=t.has("blk.0.attn_q.bias"),
        rope_parameters=rope_parameters(m, partial_rotary_factor=rot / head_dim),
        **_router_groups(m),
    )
    return raw


def _gpt_oss(m: Meta, t: Tensors) -> dict:
    """gpt-oss: sliding-window layers by attention.sliding_window_pattern (a period, default 2: even layers
    sliding, as llama.cpp's set_swa_pattern; or a per-layer list), YaRN not truncated (the published config's
    truncate: false), and llama.cpp's fixed SwiGLU constants (alpha 1.702, limit 7.0: the file has no key)."""
    L = _layers(m)
    raw = _common(m, t, L)
    _full_rotary(m, raw["head_dim"])
    pattern = m.get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) != L:
            raise ModelLoadError(f"{m.origin}: {m.key('attention.sliding_window_pattern')} lists {len(pattern)} "
                                 f"layers, the model has {L}")
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(L)]
    raw.update(
        model_type="gpt_oss",
        num_local_experts=m.number("expert_count"),
        num_experts_per_tok=m.number("expert_used_count"),
        intermediate_size=m.number("expert_feed_forward_length"),
        sliding_window=m.number("attention.sliding_window"),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        attention_bias=t.has("blk.0.attn_q.bias"),
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        rope_parameters=rope_parameters(m, truncate=False),
    )
    return raw


ARCHITECTURES: dict[str, Callable[[Meta, Tensors], dict]] = {
    "qwen3moe": _qwen, "qwen2moe": _qwen, "llama": _llama, "deepseek2": _deepseek2, "glm4moe": _glm4moe,
    "gpt-oss": _gpt_oss,
}


def hf_config(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], origin: str) -> dict:
    """The Hugging Face config.json dict of the model a GGUF file holds (see the module docstring)."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{origin}: unsupported GGUF architecture {arch!r} (general.architecture); "
                             f"supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch](Meta(metadata, arch, origin), Tensors(shapes))
