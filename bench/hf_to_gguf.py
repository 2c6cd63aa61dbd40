"""A miniature llama.cpp convert_hf_to_gguf.py: a transformers MoE model written as the GGUF file llama.cpp's
converter writes (its metadata keys, tensor names, the llama q/k row permutation, the split MLA kv_b, stacked
experts), for the tests that compare hybrid's GGUF loader with transformers and for bench.quality's gguf:TYPE
settings, which measure what a GGUF type costs on a trained checkpoint.

    python -m bench.hf_to_gguf DIR OUT.gguf [--type f32|f16|bf16|q8_0|q4_0] [--whole]

convert() writes a checkpoint folder (config.json, model.safetensors, tokenizer.json) as one GGUF file: its weight
matrices in the chosen type, everything llama.cpp's quantizer leaves alone in F32 (KEEP_F32), and the byte-level
BPE tokenizer as the converter's GPT-2 vocabulary. Families whose checkpoints hold one matrix per expert (STREAMED)
are read a tensor at a time (Checkpoint: one layer's expert stack is the most held), so a real-width layer of 256
DeepSeek-V3 experts converts on a machine that could not hold the model in float32; the rest load the transformers
model whole. For the K-quants, llama.cpp's llama-quantize makes them from a bf16 file written here.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "deepseek_v3": "deepseek2",
        "glm4_moe": "glm4moe", "gpt_oss": "gpt-oss"}

ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "q_norm": "attn_q_norm",
        "k_norm": "attn_k_norm", "q_a_proj": "attn_q_a", "q_b_proj": "attn_q_b", "q_a_layernorm": "attn_q_a_norm",
        "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm"}


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute: half-split rope rows -> interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expert_stacks(model_type: str, sd, i: int) -> dict[str, Callable[[], torch.Tensor]]:
    """A layer's experts as the converter writes them: GGUF name -> a function making [E, F, D] / [E, D, F] (+
    gpt-oss biases), so that a streamed conversion holds one stack at a time."""
    p = f"model.layers.{i}.mlp.experts."
    if model_type == "gpt_oss":  # [E, D, 2F] interleaved, down [E, F, D]
        out = {"ffn_gate_exps.weight": lambda: sd[p + "gate_up_proj"].transpose(-1, -2)[:, ::2],
               "ffn_up_exps.weight": lambda: sd[p + "gate_up_proj"].transpose(-1, -2)[:, 1::2],
               "ffn_down_exps.weight": lambda: sd[p + "down_proj"].transpose(-1, -2),
               "ffn_gate_exps.bias": lambda: sd[p + "gate_up_proj_bias"][:, ::2],
               "ffn_up_exps.bias": lambda: sd[p + "gate_up_proj_bias"][:, 1::2],
               "ffn_down_exps.bias": lambda: sd[p + "down_proj_bias"]}
    else:  # [E, 2F, D]: gate rows, then up rows
        def half(second: bool):
            gate_up = sd[p + "gate_up_proj"]
            F_ = gate_up.shape[1] // 2
            return gate_up[:, F_:] if second else gate_up[:, :F_]
        out = {"ffn_gate_exps.weight": lambda: half(False), "ffn_up_exps.weight": lambda: half(True),
               "ffn_down_exps.weight": lambda: sd[p + "down_proj"]}
    return {f"blk.{i}.{k}": (lambda f=f: f().contiguous()) for k, f in out.items()}


def set_expert_stacks(model_type: str, hf, i: int, stacks: dict[str, torch.Tensor]) -> None:
    """The inverse of expert_stacks into the transformers model (for its run on de-quantized experts)."""
    ex = hf.model.layers[i].mlp.experts
    g, u, d = (stacks[f"blk.{i}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down"))
    with torch.no_grad():
        if model_type == "gpt_oss":
            gu = torch.empty(g.shape[0], 2 * g.shape[1], g.shape[2])
            gu[:, ::2], gu[:, 1::2] = g, u
            ex.gate_up_proj.copy_(gu.transpose(-1, -2))
            ex.down_proj.copy_(d.transpose(-1, -2))
        else:
            ex.gate_up_proj.copy_(torch.cat([g, u], dim=1))
            ex.down_proj.copy_(d)


def gguf_tensors(model_type: str, hf, legacy_kv_b: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the transformers model under its GGUF name, transformed as the converter does."""
    return {n: f() for n, f in gguf_sources(model_type, hf.config, hf.state_dict(), legacy_kv_b).items()}


def gguf_sources(model_type: str, cfg, sd, legacy_kv_b: bool = False,
                 as_stored: bool = False) -> dict[str, Callable[[], torch.Tensor]]:
    """GGUF name -> a function making that tensor (float32, contiguous) from `sd`, a state dict under transformers'
    names (a transformers model's, or a checkpoint read lazily: Checkpoint), in the converter's order.
    as_stored: in sd's dtype (contiguous), not float32."""
    post = "post_attention_norm" if model_type in ("glm4_moe", "gpt_oss") else "ffn_norm"
    out = {"token_embd.weight": lambda: sd["model.embed_tokens.weight"],
           "output_norm.weight": lambda: sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = lambda: sd["lm_head.weight"]

    def take(n):
        return lambda: sd[n]

    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = take(p + "input_layernorm.weight")
        out[b + post + ".weight"] = take(p + "post_attention_layernorm.weight")
        for n in sorted(k for k in sd.keys() if k.startswith(p + "self_attn.")):  # one order whatever sd's is
            mod, _, kind = n[len(p + "self_attn."):].partition(".")
            if mod == "sinks":
                out[b + "attn_sinks.weight"] = take(n)
            elif mod == "kv_b_proj":
                if legacy_kv_b:
                    out[b + "attn_kv_b.weight"] = take(n)
                else:  # the converter's split for absorbed MLA: k_b [H, rank, nope] (transposed), v_b [H, v, rank]
                    H, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim

                    def kv_b(n=n, k=True):
                        t = sd[n]
                        k_b, v_b = t.view(H, nope + v, t.shape[-1]).split([nope, v], dim=1)
                        return k_b.transpose(1, 2) if k else v_b
                    out[b + "attn_k_b.weight"], out[b + "attn_v_b.weight"] = kv_b, (lambda n=n: kv_b(n, False))
            elif model_type == "mixtral" and mod in ("q_proj", "k_proj"):
                heads = cfg.num_attention_heads if mod == "q_proj" else cfg.num_key_value_heads
                out[f"{b}{ATTN[mod]}.{kind}"] = lambda n=n, heads=heads: llama_permute(sd[n], heads)
            else:
                out[f"{b}{ATTN[mod]}.{kind}"] = take(n)
        mlp = p + "mlp."
        if mlp + "gate_proj.weight" in sd:  # a dense layer
            for w in ("gate", "up", "down"):
                out[f"{b}ffn_{w}.weight"] = take(f"{mlp}{w}_proj.weight")
            continue
        router = "router" if model_type == "gpt_oss" else "gate"
        out[b + "ffn_gate_inp.weight"] = take(f"{mlp}{router}.weight")
        if model_type == "gpt_oss":
            out[b + "ffn_gate_inp.bias"] = take(mlp + "router.bias")
        if mlp + "gate.e_score_correction_bias" in sd:
            out[b + "exp_probs_b.bias"] = take(mlp + "gate.e_score_correction_bias")
        for shared in ("shared_expert", "shared_experts"):
            for w in ("gate", "up", "down"):
                if f"{mlp}{shared}.{w}_proj.weight" in sd:
                    out[f"{b}ffn_{w}_shexp.weight"] = take(f"{mlp}{shared}.{w}_proj.weight")
        if mlp + "shared_expert_gate.weight" in sd:
            out[b + "ffn_gate_inp_shexp.weight"] = take(mlp + "shared_expert_gate.weight")
        out.update(expert_stacks(model_type, sd, i))
    if as_stored:
        return {n: (lambda f=f: f().detach().contiguous()) for n, f in out.items()}
    return {n: (lambda f=f: f().detach().float().contiguous()) for n, f in out.items()}


def add_metadata(w, model_type: str, cfg, extra_layers: int = 0, legacy_mla: bool = False) -> None:
    """The converter's set_gguf_parameters for each architecture (extra_layers: multi-token-prediction layers
    counted in block_count, as nextn_predict_layers; legacy_mla: DeepSeek as converted before llama.cpp's absorbed
    MLA)."""
    rope = cfg.rope_parameters
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers + extra_layers)
    if extra_layers:
        w.add_nextn_predict_layers(extra_layers)
    w.add_head_count(cfg.num_attention_heads)
    mla = model_type == "deepseek_v3" and not legacy_mla
    w.add_head_count_kv(1 if mla else cfg.num_key_value_heads)  # absorbed MLA: one latent "head"
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "intermediate_size", None):
        w.add_feed_forward_length(cfg.intermediate_size)
    if model_type != "deepseek_v3" and getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if model_type in ("qwen3_moe", "qwen2_moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if model_type == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    elif model_type == "mixtral":
        w.add_vocab_size(cfg.vocab_size)
        w.add_expert_count(cfg.num_local_experts)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_sliding_window(cfg.sliding_window)
    elif model_type in ("deepseek_v3", "glm4_moe"):
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        if model_type == "glm4_moe":
            w.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.5)))
        else:
            _deepseek_metadata(w, cfg, rope, legacy_mla)
    else:  # gpt_oss
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)


def _deepseek_metadata(w, cfg, rope, legacy: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters: MLA as MQA over the latent (head_count_kv 1, key/value lengths of the
    latent), the per-head sizes as *_mla (legacy: the per-head sizes as key/value lengths), YaRN's mscale_all_dim
    as 0.1 * it."""
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if legacy:
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    else:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_gguf(path, model_type: str, hf, expert_type=Q.F32, tensors=None, split_max_tensors: int = 0,
               extra=None, legacy_kv_b: bool = False, extra_layers: int = 0, arch=None,
               types=None) -> dict[str, np.ndarray]:
    """Writes the GGUF of `hf` at `path`; returns the bytes written for each quantized tensor (by name).
    tensors: name -> tensor replacements (None drops one); extra(writer): more metadata; arch: another
    general.architecture; types: name -> the type of that tensor (gguf-py's quantizer; expert stacks default to
    expert_type, the rest to F32)."""
    ts = gguf_tensors(model_type, hf, legacy_kv_b)
    ts.update(tensors or {})
    w = gguf.GGUFWriter(str(path), arch or ARCH[model_type], split_max_tensors=split_max_tensors)
    add_metadata(w, model_type, hf.config, extra_layers, legacy_kv_b)
    if extra is not None:
        extra(w)
    written = {}
    for name, t in ts.items():
        if t is None:
            continue
        arr = t.numpy()
        qtype = (types or {}).get(name, expert_type if "_exps.weight" in name else Q.F32)
        if qtype != Q.F32:
            q = gguf.quants.quantize(arr, qtype)
            written[name] = q
            w.add_tensor(name, q, raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


# -- a checkpoint folder as a GGUF file of one type ------------------------------------------------------------
TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}  # gguf-py quantizes these
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
# Tensors llama.cpp's quantizer keeps in F32 whatever the file type: norms, routers, score biases, sinks.
KEEP_F32 = ("_norm.", "ffn_gate_inp", "exp_probs_b", "attn_sinks")
NORMAL, CONTROL, USER_DEFINED, UNUSED = (int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL),
                                         int(gguf.TokenType.USER_DEFINED), int(gguf.TokenType.UNUSED))


def gguf_type(name: str) -> Q:
    """'q8_0' -> Q.Q8_0; a ValueError naming the supported types for anything else."""
    if name not in TYPES:
        raise ValueError(f"GGUF type {name!r} is not supported (supported: {', '.join(TYPES)})")
    return TYPES[name]


def tensor_type(name: str, shape: tuple[int, ...], qtype: Q) -> Q:
    """The type a tensor is written in: `qtype` for weight matrices (and expert stacks), F32 for 1-D tensors,
    biases, norms and routers (as llama.cpp's quantizer leaves them) and for a matrix whose rows are not whole
    blocks of `qtype`."""
    if len(shape) < 2 or not name.endswith(".weight") or any(k in name for k in KEEP_F32):
        return Q.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else Q.F32


def add_tensor(w, name: str, arr: np.ndarray, qtype: Q) -> None:
    """One tensor into the writer, quantized by gguf-py unless F32."""
    if qtype == Q.F32:
        w.add_tensor(name, arr)
    else:
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _ids(value) -> list[int]:
    """A config's token id entry (None, an int or a list) as a list."""
    return [] if value is None else [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _named(vocab: dict, token) -> int | None:
    """The id of a tokenizer_config token entry (a string or an AddedToken dict), or None."""
    text = token.get("content") if isinstance(token, dict) else token
    return vocab.get(text) if text else None


def check_byte_level(spec: dict, origin: str) -> None:
    """A ValueError unless tokenizer.json is a GPT-2 byte-level BPE (no normalizer, a ByteLevel pre-tokenizer
    with its regex): the only tokenizer written here, as llama.cpp's pre-tokenizer "gpt-2"."""
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    if (model.get("type") != "BPE" or spec.get("normalizer") or pre.get("type") != "ByteLevel"
            or not pre.get("use_regex", True) or pre.get("add_prefix_space")):
        raise ValueError(f"{origin}: only a GPT-2 byte-level BPE tokenizer (a ByteLevel pre-tokenizer with its "
                         "regex, no normalizer) can be written as GGUF here")


def special_ids(model_dir: Path, vocab: dict, tok_config: dict) -> dict:
    """eos, eot, bos and pad ids as llama.cpp's SpecialVocab finds them (tokenizer_config's tokens first, then
    config.json's ids). The end-of-sequence ids of generation_config / config.json that are not the eos become
    the eot id, so a GGUF reader stops on the same ids as transformers."""
    config, gen = _json(model_dir / "config.json"), _json(model_dir / "generation_config.json")
    stops = list(dict.fromkeys(_ids(gen.get("eos_token_id")) + _ids(config.get("eos_token_id"))))
    eos = _named(vocab, tok_config.get("eos_token"))
    eos = eos if eos is not None else (stops[0] if stops else None)
    others = [s for s in stops if s != eos]

    def pick(which: str) -> int | None:
        named = _named(vocab, tok_config.get(f"{which}_token"))
        return named if named is not None else next(iter(_ids(config.get(f"{which}_token_id"))), None)
    return {"eos": eos, "eot": others[0] if others else None, "bos": pick("bos"), "pad": pick("pad")}


def tokenizer_metadata(model_dir: str | Path, vocab_size: int) -> dict:
    """What the converter's _set_vocab_gpt2 writes for the folder's byte-level BPE: tokens in id order (padded
    with [PADn] UNUSED tokens up to the model's rows), types (special added tokens CONTROL, other added tokens
    USER_DEFINED, the rest NORMAL), merges as 'a b' strings, special ids, add_bos_token, the chat template."""
    from tokenizers import Tokenizer

    d = Path(model_dir)
    spec = _json(d / "tokenizer.json")
    check_byte_level(spec, str(d / "tokenizer.json"))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError(f"{d / 'tokenizer.json'}: token ids are not 0..{len(tokens) - 1}")
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    types = [CONTROL if added.get(t) else USER_DEFINED if t in added else NORMAL for t in tokens]
    pad = range(len(tokens), vocab_size)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    tok_config = _json(d / "tokenizer_config.json")
    return {"tokens": tokens + [f"[PAD{i}]" for i in pad], "types": types + [UNUSED] * len(pad), "merges": merges,
            "ids": special_ids(d, vocab, tok_config), "add_bos": bool(tok_config.get("add_bos_token", False)),
            "chat_template": tok_config.get("chat_template")}


def add_tokenizer(w, meta: dict) -> None:
    """tokenizer.ggml.* and tokenizer.chat_template of tokenizer_metadata's dict."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["types"])
    w.add_token_merges(meta["merges"])
    adders = {"eos": w.add_eos_token_id, "eot": w.add_eot_token_id, "bos": w.add_bos_token_id,
              "pad": w.add_pad_token_id}
    for which, token_id in meta["ids"].items():
        if token_id is not None:
            adders[which](token_id)
    w.add_add_bos_token(meta["add_bos"])
    if meta["chat_template"]:
        w.add_chat_template(meta["chat_template"])


def load_hf(model_dir: str | Path):
    """The folder's transformers model in float32 (the helpers above read its state dict and config)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


# families whose checkpoints keep one matrix per expert (experts.E.{gate,up,down}_proj.weight) under the names
# transformers uses for the rest, which Checkpoint reads without transformers
STREAMED = ("qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")


class Checkpoint(Mapping):
    """A safetensors checkpoint folder as transformers' state dict, read lazily (memory-mapped): a layer's
    per-expert matrices appear as the fused stacks transformers makes (experts.gate_up_proj [E, 2F, D], gate rows
    first; experts.down_proj [E, D, F]), built when asked for (the last one kept, as a layer's gate and up are
    asked for in turn). meta: tensors on the meta device (shapes and dtypes only, nothing read)."""

    def __init__(self, model_dir: str | Path, meta: bool = False):
        from safetensors import safe_open

        d = Path(model_dir)
        index = _json(d / "model.safetensors.index.json").get("weight_map")
        files = sorted(set(index.values())) if index else [p.name for p in sorted(d.glob("*.safetensors"))]
        self._open = {f: safe_open(str(d / f), "pt") for f in files}
        where = index or {k: f for f, h in self._open.items() for k in h.keys()}
        quantized = [k for k in where if k.endswith(("_scale_inv", "_blocks", "_scales"))]
        if quantized:
            raise ValueError(f"{d}: quantized tensors ({quantized[0]}, ...) are read through transformers, not here")
        self._where, self._meta, self._fused, self._last = {}, meta, {}, (None, None)
        for k, f in where.items():
            m = EXPERT.fullmatch(k)
            if m is None:
                self._where[k] = f
                continue
            prefix, e, w = m.groups()
            parts = self._fused.setdefault(prefix + ("down_proj" if w == "down" else "gate_up_proj"), {})
            parts[(int(e), w)] = (k, f)
        for name, parts in self._fused.items():  # -> per expert, its (name, file) pairs in stacking order
            n = 1 + max(e for e, _ in parts)
            kinds = ("down",) if name.endswith("down_proj") else ("gate", "up")
            if set(parts) != {(e, w) for e in range(n) for w in kinds}:
                raise ValueError(f"{d}: {name.rpartition('.')[0]}: some experts' matrices are missing")
            self._fused[name] = [[parts[(e, w)] for w in kinds] for e in range(n)]

    def keys(self):
        return list(self._where) + list(self._fused)

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self._where) + len(self._fused)

    def __contains__(self, name) -> bool:
        return name in self._where or name in self._fused

    def _read(self, name: str, f: str) -> torch.Tensor:
        h = self._open[f]
        if self._meta:
            sl = h.get_slice(name)
            return torch.empty(sl.get_shape(), dtype=_DTYPES[sl.get_dtype()], device="meta")
        return h.get_tensor(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._where:
            return self._read(name, self._where[name])
        if name not in self._fused:
            raise KeyError(name)
        if self._last[0] == name:
            return self._last[1]
        self._last = (None, None)  # the previous stack freed before the next is built
        stack = torch.stack([torch.cat([self._read(*m) for m in expert]) for expert in self._fused[name]])
        self._last = (name, stack)
        return stack


@functools.cache
def stored_form(qtype: Q) -> np.dtype:
    """The numpy dtype gguf-py's quantize gives for `qtype` (uint8 bytes for the block types)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return np.float32 if qtype == Q.F32 else gguf.quants.quantize(np.zeros((1, block), np.float32), qtype).dtype


def stored(t: torch.Tensor, qtype: Q) -> np.ndarray:
    """A tensor as `qtype`'s bytes: bf16 values as they are for BF16 (what rounding their float32 would give),
    anything else through float32 and gguf-py's quantize."""
    if qtype == Q.BF16 and t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    arr = t.float().contiguous().numpy()
    return arr if qtype == Q.F32 else gguf.quants.quantize(arr, qtype)


def convert(model_dir: str | Path, out_path: str | Path, qtype: str = "f32", stream: bool | None = None,
            progress: bool = False) -> Path:
    """Writes the checkpoint folder `model_dir` as the GGUF file `out_path` with its weight matrices in `qtype`
    (TYPES; see tensor_type for what stays F32) and its tokenizer; returns out_path.
    stream: read the safetensors one tensor (or one layer's expert stack) at a time and write as it goes, so that
    the memory needed is one stack, not the model in float32 (None: where the family's checkpoint allows it,
    STREAMED, unquantized); otherwise the transformers model is loaded whole. Both write the same bytes."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(model_dir))
    _check_family(cfg, model_dir)
    if stream is None:
        stream = cfg.model_type in STREAMED and getattr(cfg, "quantization_config", None) is None
    if stream:
        sd, meta = Checkpoint(model_dir), Checkpoint(model_dir, meta=True)
    else:
        hf = load_hf(model_dir)
        cfg, sd = hf.config, hf.state_dict()
        meta = {k: torch.empty_like(v, device="meta") for k, v in sd.items()}
    return write_file(out_path, cfg, sd, meta, qtype, model_dir, Path(model_dir).resolve().name, progress)


def _check_family(cfg, origin) -> None:
    if cfg.model_type not in ARCH:
        raise ValueError(f"{origin}: model_type {cfg.model_type!r} has no GGUF architecture here (supported: "
                         f"{', '.join(sorted(ARCH))})")


def write_file(out_path: str | Path, cfg, sd, meta, qtype: str, tokenizer_dir: str | Path, name: str,
               progress: bool = False) -> Path:
    """Writes the GGUF file `out_path` from `sd` (transformers' names -> tensors, read as the file is written, one
    tensor or expert stack at a time) whose shapes `meta` gives without computing anything: `qtype`'s weight
    matrices, the folder `tokenizer_dir`'s tokenizer; `progress`: a bar over the bytes written."""
    from tqdm import tqdm

    qt = gguf_type(qtype)
    model_type = cfg.model_type
    sources = gguf_sources(model_type, cfg, sd, as_stored=True)
    shapes = {n: tuple(f().shape) for n, f in gguf_sources(model_type, cfg, meta).items()}  # nothing computed
    E = next(getattr(cfg, a) for a in ("num_experts", "n_routed_experts", "num_local_experts") if hasattr(cfg, a))
    short = [n for n, shape in shapes.items() if "_exps." in n and shape[0] != E]
    if short:
        raise ValueError(f"{name}: {short[0]} holds {shapes[short[0]][0]} experts, config.json says {E}")
    w = gguf.GGUFWriter(str(out_path), ARCH[model_type])
    w.add_name(name)
    w.add_file_type(FILE_TYPES[qtype])
    add_metadata(w, model_type, cfg)
    add_tokenizer(w, tokenizer_metadata(tokenizer_dir, cfg.vocab_size))
    types = {n: tensor_type(n, shape, qt) for n, shape in shapes.items()}
    for n, shape in shapes.items():
        form = np.dtype(stored_form(types[n]))
        if form == np.uint8:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, types[n])
            w.add_tensor_info(n, byte_shape, form, int(np.prod(byte_shape)), raw_dtype=types[n])
        else:
            w.add_tensor_info(n, shape, form, int(np.prod(shape)) * form.itemsize,
                              raw_dtype=None if types[n] == Q.F32 else types[n])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with tqdm(total=sum(ti.nbytes for ti in w.tensors[0].values()), desc=f"writing {Path(out_path).name}", unit="B",
              unit_scale=True, disable=not progress) as bar:
        for n, f in sources.items():
            arr = stored(f(), types[n])
            w.write_tensor_data(arr)
            bar.update(arr.nbytes)
    w.close()
    return Path(out_path)


class RandomWeights(Mapping):
    """A transformers model's state dict with random weights drawn when a tensor is asked for (norms 1, biases and
    score biases 0, the rest N(0, std) in bf16, one generator seeded per name, so a tensor asked for twice is the
    same; the last one kept, as a layer's gate and up are read from one stack in turn): what a GGUF of a
    preset's shape needs, with no checkpoint on disk first. meta: the model's tensors on the meta device."""

    def __init__(self, meta: dict, std: float = 0.02, seed: int = 0, device: str = "cpu"):
        self._meta, self._std, self._seed, self._device, self._last = meta, std, seed, device, (None, None)

    def keys(self):
        return self._meta.keys()

    def __iter__(self):
        return iter(self._meta)

    def __len__(self):
        return len(self._meta)

    def __contains__(self, name) -> bool:
        return name in self._meta

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last[0] == name:
            return self._last[1]
        self._last = (None, None)
        shape = tuple(self._meta[name].shape)
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith("bias"):
            t = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16)
            g = torch.Generator(device=self._device).manual_seed(self._seed + zlib.crc32(name.encode()))
            rows = t.view(-1, shape[-1]) if t.dim() > 1 else t.view(1, -1)
            step = max(1, (1 << 26) // rows.shape[1])  # 64 Mi values (256 MiB of fp32) drawn at a time
            for a in range(0, rows.shape[0], step):
                chunk = torch.empty((min(step, rows.shape[0] - a), rows.shape[1]), device=self._device)
                rows[a:a + len(chunk)] = chunk.normal_(0.0, self._std, generator=g).to(torch.bfloat16).cpu()
        self._last = (name, t)
        return t


def write_random(raw_config: dict, out_path: str | Path, write_tokenizer: Callable[[str, int], object],
                 qtype: str = "bf16", seed: int = 0, device: str = "cpu", progress: bool = False) -> Path:
    """The GGUF file of a config (a preset's config.json, cut as bench.make_checkpoint cuts it) with random weights
    (RandomWeights) and the tokenizer write_tokenizer(folder, vocab_size) writes (make_checkpoint's generic byte-level
    BPE), streamed: one tensor or expert stack in memory at a time, nothing else on disk. llama.cpp's llama-quantize
    makes the K-quants from it."""
    import tempfile

    import transformers

    cfg = transformers.AutoConfig.for_model(**raw_config)
    _check_family(cfg, "config")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    meta = dict(model.state_dict())
    with tempfile.TemporaryDirectory() as tok:
        write_tokenizer(tok, cfg.vocab_size)
        return write_file(out_path, cfg, RandomWeights(meta, seed=seed, device=device), meta, qtype, tok,
                          Path(out_path).stem, progress)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="checkpoint folder (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--type", default="f32", choices=sorted(TYPES), help="the weight matrices' type (default f32)")
    p.add_argument("--whole", action="store_true", help="load the transformers model whole instead of streaming "
                   "the safetensors (the same bytes; streaming holds one layer's expert stack at a time)")
    a = p.parse_args(argv)
    path = convert(a.model, a.out, a.type, stream=False if a.whole else None, progress=True)
    print(f"{path}: {a.type}, {path.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
