"""Check: the refusals made before any weight is read, each one line (UsageError), and the warnings about a
tokenizer that does not fit its model.

config.json is read against the safetensors headers, then the KV cache's size against free memory, then a
plan against the model it was made for and a --gpu-budget against the non-expert weights + KV cache
(placement.memory computes both from config.json alone): minutes of loading never end in a refusal.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hybrid.errors import UsageError
from hybrid.loading.parse import SessionConfig


def check_before_load(model_dir: str, config: SessionConfig):
    """Every check that needs only config.json and the headers; returns the model's config and the session
    config with the checkpoint's defaults filled in (the CPU experts' dtype), so that what is checked is
    what is loaded."""
    from hybrid.models.loader import check_checkpoint, read_config
    from hybrid.offload.config import checkpoint_cpu_dtype
    from hybrid.runtime.engine import check_kv_cache_fits

    rt = config.runtime
    cfg = check_checkpoint(model_dir)
    if config.hybrid is not None:
        config = replace(config, hybrid=checkpoint_cpu_dtype(config.hybrid, read_config(model_dir)[2]))
    check_kv_cache_fits(cfg, rt.max_batch, rt.max_context, config.dtype, config.device)
    if config.hybrid is not None:
        check_placement(model_dir, config.hybrid, rt.max_context, rt.max_batch, config.dtype)
    return cfg, config


def check_placement(model_dir, hcfg, max_context: int, max_batch: int, dtype) -> None:
    """Fail before any weight is read: a plan made for another model, or a --gpu-budget below the
    non-expert weights + KV cache."""
    from hybrid.models import ModelLoadError
    from hybrid.models.loader import read_config

    try:
        _, cfg, _ = read_config(model_dir)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    if hcfg.plan is not None:
        hcfg.plan.check_model(cfg, origin="--plan")
    if hcfg.gpu_budget is not None:
        from placement.memory import MemorySettings, breakdown, gib

        mem = breakdown(cfg, MemorySettings(max_context=max_context, max_batch=max_batch, cpu_dtype=hcfg.cpu_dtype,
                                            gpu_dtype_bytes=torch.empty((), dtype=dtype).element_size(), reserve=0))
        need = mem.non_expert + mem.kv_cache
        if need > hcfg.gpu_budget:
            raise UsageError(f"--gpu-budget {gib(hcfg.gpu_budget)} is below the non-expert weights and KV cache alone "
                             f"({gib(need)}: weights {gib(mem.non_expert)}, KV {gib(mem.kv_cache)} for --max-context "
                             f"{max_context} x {max_batch}); raise --gpu-budget or lower --max-context")


def warn_vocab_mismatch(model_vocab: int, tokenizer_vocab: int, log) -> None:
    """Real checkpoints pad the embedding a little past the tokenizer (Qwen3: 151936 vs 151669 ids) and never
    generate the padding; a model whose vocabulary is much larger than its tokenizer's (a random checkpoint
    of a real shape with a small tokenizer) generates ids that decode to nothing: empty text, silently."""
    if tokenizer_vocab > model_vocab:  # a prompt could encode to ids the embedding does not have
        log(f"warning: the tokenizer has {tokenizer_vocab} token ids but the model only {model_vocab}: a prompt "
            "that encodes to the extra ids cannot run (not this model's tokenizer?)")
    if tokenizer_vocab < 0.9 * model_vocab:  # the demo pads its vocabulary up to a multiple of 64
        log(f"warning: the model has {model_vocab} token ids but its tokenizer only {tokenizer_vocab}; generated ids "
            f">= {tokenizer_vocab} have no text and are dropped from the output (a tokenizer from another model?)")


def eager_for_online_replace(config: SessionConfig, log) -> SessionConfig:
    """Online re-placement changes residency between calls, which captured decode graphs cannot follow."""
    if config.hybrid is None or config.hybrid.replace != "online" or config.runtime.eager:
        return config
    log("hybrid: --replace online changes residency between calls, which decode graphs cannot: decoding eagerly")
    return replace(config, runtime=replace(config.runtime, eager=True))
