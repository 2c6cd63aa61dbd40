"""Tiny random Hugging Face MoE checkpoints for the equality tests (transformers is a test-only
dependency). Every weight is re-drawn (norm scales around 1, biases non-zero) so a swapped or
mis-mapped tensor changes the output; the defaults (norms = 1, biases = 0) would hide such bugs."""

from __future__ import annotations

from pathlib import Path

import json

import torch

VOCAB = 256

# model_type -> (config class name, model class name, config kwargs). Each covers its family's quirks:
# Qwen3 with QK-norm and YaRN; Qwen2 with shared expert, q/k/v biases, a dense layer and tied
# embeddings; Mixtral with a sliding window; OLMoE with full-width QK-norm and clip_qkv.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, moe_intermediate_size=32, intermediate_size=96, head_dim=16, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, moe_intermediate_size=32, intermediate_size=96, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, intermediate_size=32, sliding_window=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_experts=8, intermediate_size=32, clip_qkv=1.0, norm_topk_prob=False)),
    # DeepSeek-V3: MLA with a q bottleneck, YaRN with mscale (softmax-scale correction), groups of experts
    # (n_group 4, topk_group 2), one shared expert, a dense first layer; more variants in DEEPSEEK_VARIANTS.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
        kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_key_value_heads=4, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 64, "mscale": 0.707,
                                                "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
    # GLM-4.5: partial rotary (half of a 24-dim head, which is not hidden / heads), per-head QK-norm, q/k/v
    # biases, groups of experts (n_group 2, topk_group 1), one shared expert, a dense first layer, scaling 2.5;
    # more variants in GLM_VARIANTS.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1, head_dim=24,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        use_qk_norm=True, attention_bias=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # gpt-oss: sinks, sliding layers alternating with full ones (sliding first, window 4), YaRN (not truncated),
    # q/k/v/o biases, router bias, expert biases and a clamped SwiGLU whose limit the tiny weights reach;
    # more variants in GPT_OSS_VARIANTS.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=8, intermediate_size=32, head_dim=16, sliding_window=4, swiglu_limit=0.25,
        swiglu_alpha=1.702, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "truncate": False})),
}

# gpt-oss variants beyond FAMILIES["gpt_oss"]: overrides of its kwargs.
GPT_OSS_VARIANTS = {
    # every layer full attention, plain rope, tied head, no attention biases, the published SwiGLU constants
    "all_full_tied": dict(layer_types=["full_attention"] * 3, tie_word_embeddings=True, attention_bias=False,
                          swiglu_limit=7.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # full first, then two sliding layers of window 3, top-3 of 16 experts, 4 layers, truncated YaRN
    "full_first_window3": dict(layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                            "full_attention"], num_hidden_layers=4, sliding_window=3,
                               num_local_experts=16, num_experts_per_tok=3, swiglu_alpha=1.2,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                "original_max_position_embeddings": 16, "truncate": True}),
    # the window wider than every prompt (the sliding layers see everything), one kv head
    "wide_window_mqa": dict(sliding_window=64, num_key_value_heads=1),
}

# GLM-4.5 family variants beyond FAMILIES["glm4_moe"]: overrides of its kwargs.
GLM_VARIANTS = {
    # GLM-4.5-Air style (no QK-norm), whole-head rotary, no biases, all layers MoE, one group, no
    # renormalisation, tied head
    "air_full_rotary_tied": dict(use_qk_norm=False, attention_bias=False, first_k_dense_replace=0, n_group=1,
                                 topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
                                 tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 1.0}),
    # 16 experts in 4 groups of which 2 eligible, top-4, two shared experts, two dense layers, YaRN over the
    # partial rotary dims, head_dim = hidden / heads
    "groups_yarn": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=2,
                        first_k_dense_replace=2, num_hidden_layers=4, head_dim=16,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5}),
}

# DeepSeek-V3 family variants beyond FAMILIES["deepseek_v3"]: overrides of its kwargs.
DEEPSEEK_VARIANTS = {
    # no q bottleneck (V2-Lite style), all layers MoE, one group, no renormalisation, tied head, plain rope
    "no_q_lora_tied": dict(q_lora_rank=None, first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False,
                           tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           routed_scaling_factor=1.0),
    # Kimi-K2's router shape (one group), two shared experts, rope not interleaved, 16 experts in 8 groups of 2
    "groups_of_two": dict(n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=4, n_shared_experts=2,
                          rope_interleave=False, first_k_dense_replace=2, num_hidden_layers=4),
}


def _oracle_swiglu_constants(cfg) -> None:
    """Older transformers (5.17, the GPU box's) hard-code gpt-oss's SwiGLU alpha 1.702 and limit 7.0 instead of
    reading config.swiglu_alpha / swiglu_limit as later ones do: the config then takes the oracle's constants,
    so that both sides compute the same function (ours reads the config, as the published checkpoints need)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    probe = GptOssExperts(cfg)
    cfg.swiglu_alpha, cfg.swiglu_limit = float(probe.alpha), float(probe.limit)


def hf_config(model_type: str, **overrides):
    import transformers

    cfg_cls, _, kw = FAMILIES[model_type]
    kw = dict(kw)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw = {**common, **kw} if model_type == "deepseek_v3" else {**kw, **common}  # MLA: kv heads = heads
    kw.update(overrides)
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg._attn_implementation = "eager"
    if model_type == "gpt_oss":
        _oracle_swiglu_constants(cfg)
    return cfg


@torch.no_grad()
def randomize_(model, seed: int = 0, std: float = 0.08) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(std * noise)


@torch.no_grad()
def make_checkpoint(model_type: str, out: Path, seed: int = 0, extra: dict[str, float] | None = None,
                    bf16_values: bool = False, **overrides):
    """Saves a tiny random model with save_pretrained; returns the (fp32, eval) transformers model.
    extra: name suffix -> std: the parameters and buffers whose names end so are then drawn N(0, std^2) from a
    generator seeded seed + 100 (buffers randomize_ leaves at zero, e.g. GLM's e_score_correction_bias; tensors
    that must be large to matter, e.g. gpt-oss's sinks). bf16_values: every parameter and every `extra` tensor
    rounded to a bf16 value (kept fp32), so the CPU executor's bf16 packing is exact."""
    import transformers

    _, model_cls, _ = FAMILIES[model_type]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(hf_config(model_type, **overrides)).eval()
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    drawn = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        std = next((v for k, v in (extra or {}).items() if name.endswith(k)), None)
        if std is not None:
            t.copy_(std * torch.randn(t.shape, generator=g))
            drawn.append(t)
    if bf16_values:
        for t in [*model.parameters(), *drawn]:
            t.copy_(t.to(torch.bfloat16).float())
    model.save_pretrained(str(out))
    return model


def edited_checkpoint(path, tmp_path, name, config=None, tensors=None):
    """A copy of the checkpoint at `path` with config.json fields and tensors replaced."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((path / "config.json").read_text())
    raw.update(config or {})
    t = load_file(str(path / "model.safetensors"))
    for k, fn in (tensors or {}).items():
        t = {n: (fn(v) if n.endswith(k) else v) for n, v in t.items()}
    out = tmp_path / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    save_file(t, str(out / "model.safetensors"))
    return out


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32 logits of the transformers model for one unpadded sequence."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, recomputing the whole sequence each step (no cache: the plainest reference)."""
    ids = list(ids)
    out = []
    for _ in range(n):
        t = int(hf_logits(model, ids)[-1].argmax())
        ids.append(t)
        out.append(t)
    return out


def deepseek_raw(**overrides) -> dict:
    """config.json of the tiny DeepSeek-V3 (FAMILIES["deepseek_v3"] + overrides) as a plain dict, for
    hybrid.models.writer (checkpoints written by our writer rather than by save_pretrained)."""
    raw = hf_config("deepseek_v3", **overrides).to_dict()
    raw.pop("quantization_config", None)
    return raw


def batched_logits(engine, prompts, slots):
    """Logits of a right-padded batch prefill of `prompts` into fresh `slots` of `engine` (then marks the
    slots' lengths, so decode steps can follow)."""
    import torch

    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.full((B, T), -1, dtype=torch.long)
    for b, p in enumerate(prompts):  # right padding
        ids[b, :len(p)] = torch.tensor(p)
        pos[b, :len(p)] = torch.arange(len(p))
    for _ in slots:
        engine.allocate_slot()
    out = engine.forward(ids, pos, torch.tensor(slots))
    for b, p in enumerate(prompts):
        engine.lengths[slots[b]] = len(p)
    return out


def single_logits(model, ids: list[int]) -> "torch.Tensor":
    """[len(ids), V] logits of our model for one sequence prefilled into slot 0 of a fresh engine."""
    from hybrid.runtime import Engine

    return Engine(model, max_batch=1, max_context=16).forward(torch.tensor([ids]), torch.arange(len(ids))[None],
                                                              torch.tensor([0]))[0]


def engine_greedy(model, prompts, n: int = 10) -> list[list[int]]:
    """n greedy tokens for each prompt from one batched, eager generate() of our model."""
    from hybrid.runtime import Engine
    from hybrid.runtime.sampling import SamplingParams

    eng = Engine(model, None, max_batch=4, max_context=64, eager=True)
    outs = eng.generate(list(prompts), max_new_tokens=n, sampling=SamplingParams(temperature=0), stop_token_ids=[])
    return [o.token_ids for o in outs]


def reference_tokens_of(path, hf, prompts, n: int = 10) -> list[list[int]]:
    """engine_greedy of the checkpoint at `path` (loaded fp32), asserted equal to transformers' `hf` greedy
    tokens: the reference the hybrid-strategy checks compare with."""
    from hybrid.models import load_model

    tokens = engine_greedy(load_model(path, progress=False), prompts, n)
    assert tokens == [hf_greedy(hf, p, n) for p in prompts]
    return tokens


def check_logits_and_greedy(model, hf, prompts, n_generate: int, name) -> None:
    """Our model against the transformers model `hf`: a right-padded batch prefill of `prompts` and three
    batched decode steps in fp32 within 1e-4, then the first n_generate prompts' 12 greedy tokens identical."""
    from hybrid.runtime import Engine

    engine = Engine(model, max_batch=4, max_context=48)
    slots = [2, 0, 3]
    logits = batched_logits(engine, list(prompts), slots)
    for b, p in enumerate(prompts):
        assert (logits[b, :len(p)] - hf_logits(hf, p)).abs().max().item() <= 1e-4, (name, b)
    seqs = [list(p) for p in prompts]
    for step in range(3):  # batched decode steps over the KV cache
        nxt = [(13 * step + 29 * b + 1) % VOCAB for b in range(len(seqs))]
        out = engine.decode_step(slots, nxt)
        for b in range(len(seqs)):
            seqs[b].append(nxt[b])
            assert (out[b] - hf_logits(hf, seqs[b])[-1]).abs().max().item() <= 1e-4, (name, b, step)
    results = Engine(model, max_batch=2, max_context=48).generate(list(prompts[:n_generate]), max_new_tokens=12,
                                                                  stop_token_ids=[])
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(hf, p, 12), name


def check_topk_router(ref_cls, cfg, k: int):
    """Our select_experts against transformers' top-k router `ref_cls(cfg)` (random weights and score
    bias, 50 tokens): the same experts, weights within 1e-6. Returns (logits, ours: ModelConfig, bias,
    sorted expert ids) for further checks."""
    from hybrid.models.families import family_for
    from hybrid.models.moe import select_experts

    E = cfg.n_routed_experts
    ref = ref_cls(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(E, cfg.hidden_size, generator=g))
        ref.e_score_correction_bias.copy_(torch.randn(E, generator=g))
    x = torch.randn(50, cfg.hidden_size, generator=g)
    ours = family_for(cfg.to_dict()).parse_config(cfg.to_dict())
    _, w_ref, ids_ref = ref(x)
    logits = x @ ref.weight.t()
    ids, w = select_experts(logits, ours.router, k, ours.norm_topk_prob, ref.e_score_correction_bias)
    order_ref, order = ids_ref.sort(-1), ids.sort(-1)
    assert torch.equal(order_ref.values, order.values)
    assert torch.allclose(w_ref.gather(1, order_ref.indices), w.gather(1, order.indices), atol=1e-6)
    return logits, ours, ref.e_score_correction_bias, order.values


def check_hybrid_strategies(path, greedy, reference_tokens, schedule: str, n_resident: int, moe_layers: int = 2,
                            cpu_isa: str = "ref", cpu_dtype: str = "bf16") -> None:
    """The hybrid layer over the checkpoint at `path` (CPU reference executor, fp32, n_resident experts
    per layer placed from a profile run) gives `reference_tokens` under greedy(model); `moe_layers` MoE layers
    (DeepSeek / GLM: 2, the dense first layer has none)."""
    from hybrid.loading.place import place_resident
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig
    from hybrid.runtime import Engine

    hcfg = HybridConfig(gpu_experts=n_resident, schedule=schedule, cpu_isa=cpu_isa, profile="ktransformers-paper-amx",
                        cpu_dtype=cpu_dtype)
    model, off = load_hybrid(path, "cpu", torch.float32, hcfg, progress=False)
    eng = Engine(model, None, max_batch=1, max_context=128, eager=True)
    slot = eng.allocate_slot()
    place_resident(model, off, hcfg, lambda t: eng.prefill(slot, t), list(range(3, 200, 3)), fixed_vram_bytes=0)
    assert len(off.layers) == model.cfg.num_moe_layers == moe_layers  # a dense layer has no hybrid experts
    assert greedy(model) == reference_tokens
    assert all(len(layer.resident_ids) == n_resident for layer in off.layers)


def cuda_bf16_errors(path, hf, prompt):
    """Our model from `path` in bf16 on CUDA and transformers' `hf` cast to bf16, each against `hf`'s fp32 logits
    for one prompt: (our max error, transformers' max error, our model). `hf` is left in fp32."""
    from hybrid.models import load_model
    from hybrid.runtime import Engine

    truth = hf_logits(hf, prompt)
    hf_bf16 = hf_logits(hf.to(torch.bfloat16), prompt)
    hf.float()
    model = load_model(path, device="cuda", dtype=torch.bfloat16, progress=False)
    ours = Engine(model, max_batch=1, max_context=32, eager=True).forward(
        torch.tensor([prompt]), torch.arange(len(prompt))[None], torch.tensor([0]))[0].cpu()
    return (ours - truth).abs().max().item(), (hf_bf16 - truth).abs().max().item(), model


def generated_tokens(model, prompts, eager: bool):
    """16 greedy tokens per prompt from one batched generate() (eager, or CUDA-graph decode); (tokens, engine)."""
    from hybrid.runtime import Engine

    eng = Engine(model, max_batch=4, max_context=64, eager=eager)
    return [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, stop_token_ids=[])], eng


def eager_and_graph_tokens(model, prompts):
    """generated_tokens of `model` eager and with CUDA-graph decode: (eager tokens, graph tokens, the graph
    engine); asserts that the graphs were really captured."""
    eager, _ = generated_tokens(model, prompts, True)
    graphs, eng = generated_tokens(model, prompts, False)
    assert eng.graphs is not None and eng.graphs.graphs  # really captured
    return eager, graphs, eng


def demo_shaped_checkpoint(path: Path, seed: int) -> Path:
    """The demo's architecture cut to 2 layers and a 256-token vocabulary (random weights, std 0.1) with the
    demo's byte-level BPE tokenizer at that size: a small checkpoint the CLI and planner tests load whole."""
    import contextlib
    import io

    from hybrid.models.presets import hf_config
    from hybrid.models.writer import write_random_checkpoint
    from hybrid.runtime.demo import build_tokenizer

    cfg = hf_config("demo")
    cfg.update(vocab_size=VOCAB, num_hidden_layers=2, eos_token_id=None, pad_token_id=None)
    path = write_random_checkpoint(path, cfg, seed=seed, std=0.1)
    with contextlib.redirect_stdout(io.StringIO()):  # building the tokenizer prints the Zen of Python
        build_tokenizer(path, vocab_size=VOCAB)
    return path



def json_bpe_tokenizer():
    """A byte-level BPE tokenizer of 300 tokens (not a multiple of 32) trained on a little JSON and text, with an
    <eos> special token: what the constrained-decoding tests match grammars over."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ['{"name": "ada", "age": 36, "tags": ["x", "y"]}', "plain words and numbers 123 456"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok
