"""config.json contents of the public models the benchmarks imitate (shapes only; from each model's
published config.json), plus a small "demo" shape for tests. `hf_config(name, layers=N)` returns a copy, optionally
with fewer layers (disk and time on the GPU box)."""

from __future__ import annotations

import copy

# deepseek-ai/DeepSeek-V3 (R1 and V3.1 share the shapes): MLA, 256 routed experts in 8 groups, top-8 from
# 4 groups, 1 shared expert, the first 3 layers dense, YaRN x40; published weights block-FP8 (not part of
# a preset: `make_checkpoint --fp8` writes them so). Its 1 multi-token-prediction layer is not modelled.
_DEEPSEEK_V3: dict = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
        "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096, "clip_qkv": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": None, "eos_token_id": 50279,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v3": _DEEPSEEK_V3,
    # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture with 384 routed experts, 64 heads, one group, one
    # dense layer, a 163840 vocabulary and YaRN x32 over rope_theta 50000; published weights block-FP8.
    "kimi-k2": {
        **_DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "max_position_embeddings": 131072, "rope_theta": 50000.0,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "bos_token_id": 163584, "eos_token_id": 163585, "num_nextn_predict_layers": 0,
    },
    # zai-org/GLM-4.5 (4.6 and 4.7 share the shapes; 4.6's context is 202752): 355B total / 32B active, 160 routed
    # experts top-8 in one group, 1 shared expert, the first 3 layers dense, half of each 128-dim head rotated,
    # QK-norm, q/k/v biases. Its 1 multi-token-prediction layer (model.layers.92) is not modelled.
    "glm-4.5": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552,
        "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
        "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3, "use_qk_norm": True,
        "attention_bias": True, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
        "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "torch_dtype": "bfloat16",
    },
    # openai/gpt-oss-120b: 116.8B total / 5.1B active, 128 experts top-4 in all 36 layers, 64 query heads of 64 with
    # 8 kv heads, sliding window 128 on every other layer (sliding first), attention sinks, YaRN x32, biases
    # everywhere, clamped SwiGLU (limit 7). Published experts are MXFP4 (not part of the preset:
    # `make_checkpoint --mxfp4` writes them so and adds the quantization_config).
    "gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 18, "sliding_window": 128,
        "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "initial_context_length": 4096,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9, "tie_word_embeddings": False, "eos_token_id": 200002,
        "pad_token_id": 199999, "torch_dtype": "bfloat16",
    },
    # A small real Qwen3-MoE config for random checkpoints in tests and benches, small enough to write in a second
    # on 2 cores. (The built-in demo, hybrid/runtime/demo_model, is a trained model of its own smaller shape.)
    "demo": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 1088,
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16,
        "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    },
}



# How OpenAI's gpt-oss config.json declares its MXFP4 experts (what `make_checkpoint --mxfp4` writes).
MXFP4_QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
# How DeepSeek-V3 / Kimi-K2 declare their block-FP8 weights (hybrid.models.fp8).
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Presets whose published weights are quantized, so that `hybrid plan --preset` prices what a user's download
# loads as: gpt-oss's MXFP4 experts stay mxfp4 on the CPU; an FP8 checkpoint's experts are de-quantized into
# --cpu-dtype, and its GPU weights may keep their FP8 bytes (placement.gpu_dtypes' ladders).
PUBLISHED_EXPERT_QUANTIZATION = {"gpt-oss-120b": MXFP4_QUANTIZATION, "deepseek-v3": FP8_QUANTIZATION,
                                 "kimi-k2": FP8_QUANTIZATION}


def published_config(name: str) -> dict:
    """hf_config(name) as the published config.json has it, with its experts' quantization_config."""
    cfg = hf_config(name)
    if name in PUBLISHED_EXPERT_QUANTIZATION:
        cfg["quantization_config"] = copy.deepcopy(PUBLISHED_EXPERT_QUANTIZATION[name])
    return cfg


def hf_config(name: str, layers: int | None = None) -> dict:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    cfg = copy.deepcopy(PRESETS[name])
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"layers must be in 1..{cfg['num_hidden_layers']}, got {layers}")
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:  # gpt-oss: one entry per layer
            cfg["layer_types"] = cfg["layer_types"][:layers]
    return cfg
