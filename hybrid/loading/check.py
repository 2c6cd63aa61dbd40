"""Check: the refusals made before any weight is read, each one line (UsageError), and the warnings about a
tokenizer that does not fit its model.

config.json is read against the safetensors headers, then the KV cache's size against free memory, then the
whole process's DRAM against what this machine has (hybrid.loading.dram), then a plan against the model it was
made for and a --gpu-budget against the non-expert weights + KV cache (placement.memory computes these from
config.json alone): minutes of loading never end in a refusal, nor in the OOM killer.
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
    from hybrid.models.checkpoints import check_checkpoint, read_config
    from hybrid.offload.config import checkpoint_cpu_dtype
    from hybrid.runtime.engine import check_kv_cache_fits

    rt = config.runtime
    cfg = check_checkpoint(model_dir)
    raw = read_config(model_dir)[2]
    if config.hybrid is not None:
        config = replace(config, hybrid=checkpoint_cpu_dtype(config.hybrid, raw))
    config = with_prefill_chunk(cfg, config)
    config = replace(config, gpu_dtypes=gpu_dtypes_for(cfg, raw, config))
    check_kv_cache_fits(cfg, rt.max_batch, rt.max_context, config.dtype, config.device, rt.kv_dtype)
    check_dram(cfg, config)
    if config.hybrid is not None:
        check_placement(model_dir, config.hybrid, rt.max_context, rt.max_batch, config.dtype, config.gpu_dtypes,
                        rt.kv_dtype)
    return cfg, config


SMALLER_CPU_DTYPES = ("bf16", "int8", "int4")  # what --cpu-dtype can shrink the experts to, largest first


def gguf_expert_dtypes(model: str | None, cpu_dtype: str, group: int, own: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A GGUF file's layers whose down, and whose gate and up, the load puts in a dtype of their own (`own`: a file of
    mixed types loaded in its own formats; hybrid.models.gguf.repack.own_dtypes): what the DRAM
    check and `hybrid plan` price beside the load's format. ((), ()) for any other checkpoint."""
    from hybrid.models.gguf import is_gguf

    if not model or not is_gguf(model):
        return (), ()
    from hybrid.models.checkpoints import open_cached
    from hybrid.models.gguf.repack import cpu_format, own_dtypes

    return own_dtypes(open_cached(model), cpu_format(cpu_dtype, group), own)


def check_dram(cfg, config: SessionConfig, available: tuple[int, str] | None = None) -> None:
    """The process's DRAM for this model, device and dtypes against what this machine has; above it, one line
    that names the parts, the memory available and what to change."""
    from hybrid.loading.dram import available_dram, check_dram_fits, model_dram

    dtype_bytes = torch.empty((), dtype=config.dtype).element_size()
    if dtype_bytes not in (2, 4):  # float64 exactness runs (the server's) are for small models
        return
    on_cpu, rt = config.device.type != "cuda", config.runtime
    cpu_dtype = config.hybrid.cpu_dtype if config.hybrid is not None else None
    downs, layers = gguf_expert_dtypes(config.model, cpu_dtype, config.hybrid.cpu_group,
                                       config.hybrid.layer_formats) if cpu_dtype else ((), ())
    need = model_dram(cfg, on_cpu, dtype_bytes, cpu_dtype, rt.max_context, rt.max_batch, downs, layers,
                      views=reads_in_place(config, cpu_dtype))
    available = available or available_dram()
    if need.total <= available[0]:
        return
    what = f"the model ({cfg.num_layers} layers{', no CUDA device: all of it on the CPU' if on_cpu else ''})"
    check_dram_fits(need, what, dram_change(cfg, config, need, available[0]), available)


def reads_in_place(config: SessionConfig, cpu_dtype: str | None) -> bool:
    """Whether the compiled packer will convert the experts from the memory-mapped checkpoint (no layer staged)."""
    from hybrid.offload.build import packs_views

    isa = config.hybrid.cpu_isa if config.hybrid is not None else None
    return cpu_dtype is not None and config.model is not None and packs_views(config.model, cpu_dtype, isa)


def dram_change(cfg, config: SessionConfig, need, available: int) -> str:
    """What to change, most effective first: the first smaller --cpu-dtype that fits (said with its need), bf16
    compute on the CPU when halving the fp32 non-expert weights makes it fit, a lower --max-context when the KV
    cache is a large part, fewer layers."""
    from hybrid.loading.dram import gib, model_dram

    dtype_bytes = torch.empty((), dtype=config.dtype).element_size()
    on_cpu, rt = config.device.type != "cuda", config.runtime
    current = config.hybrid.cpu_dtype if config.hybrid is not None else None
    order = SMALLER_CPU_DTYPES
    smaller = order if current is None else order[order.index(current) + 1:] if current in order else ()
    options = []
    for dt in smaller:
        total = model_dram(cfg, on_cpu, dtype_bytes, dt, rt.max_context, rt.max_batch,
                           views=reads_in_place(config, dt)).total
        if total <= available:
            options.append(f"--cpu-dtype {dt} (experts packed for the CPU executor: about {gib(total)})")
            break
    if on_cpu and dtype_bytes == 4:  # the non-expert weights are in DRAM, in fp32
        weights = dict(need.parts)["non-expert weights"]
        half = model_dram(cfg, on_cpu, 2, current, rt.max_context, rt.max_batch,
                          views=reads_in_place(config, current)).total
        if half <= available:
            options.append(f"--dtype bf16 (the non-expert weights, {gib(weights)} in fp32 on the CPU, halved: about "
                           f"{gib(half)} in all)")
    kv = dict(need.parts).get("KV cache", 0)
    if kv > need.total // 10:
        options.append(f"a lower --max-context (the KV cache is {gib(kv)} at {rt.max_context} x {rt.max_batch})")
    options.append("a checkpoint with fewer layers (python -m bench.make_checkpoint --layers N)")
    return "use " + ", or ".join(options)


def without_cpu_residents(config: SessionConfig, log) -> SessionConfig:
    """Resident experts are copies of hot experts in VRAM. Without CUDA they would be second copies in DRAM of
    experts the CPU executor already holds, which only cost memory: none are made, and the log says so (a plan's
    residents are skipped by hybrid.loading.place)."""
    h = config.hybrid
    if h is None or config.device.type == "cuda":
        return config
    asked = [flag for flag, given in ((f"--gpu-experts {h.gpu_experts}", bool(h.gpu_experts)),
                                      ("--gpu-budget", h.gpu_budget is not None),
                                      ("--plan's resident experts", h.plan is not None)) if given]
    if not asked:
        return config
    log(f"hybrid: no CUDA device: {' and '.join(asked)} makes no resident experts here (they need a GPU; on the "
        "CPU they would be second copies in DRAM of experts the CPU executor holds); every expert runs from that one "
        "copy")
    if h.plan is not None:
        return config
    return replace(config, hybrid=replace(h, gpu_experts=0, gpu_budget=None))


def with_prefill_chunk(cfg, config: SessionConfig) -> SessionConfig:
    """The engine's prefill pass when --prefill-chunk was not given: a plan's, or under --gpu-budget the one
    `hybrid plan` would fit (placement.memory.fit_prefill_chunk), so that the activations the budget counts are
    the ones the engine makes; else RuntimeConfig's default."""
    h = config.hybrid
    if config.prefill_chunk_asked or h is None or (h.plan is None and h.gpu_budget is None):
        return config
    from placement.memory import MemorySettings, fit_prefill_chunk

    rt = config.runtime
    gb = torch.empty((), dtype=config.dtype).element_size()
    if h.plan is not None:
        chunk = h.plan.settings.get("prefill_chunk", rt.prefill_chunk)
    elif gb not in (2, 4):  # float64 exactness runs: the planner prices 2- and 4-byte GPU dtypes only
        return config
    else:
        s = MemorySettings(max_context=rt.max_context, max_batch=rt.max_batch, gpu_dtype_bytes=gb,
                           staging_slots=h.staging_slots, ship_chunk=h.ship_chunk)
        chunk = fit_prefill_chunk(cfg, s, h.gpu_budget)
    return replace(config, runtime=replace(rt, prefill_chunk=chunk))


def gpu_dtypes_for(cfg, raw: dict, config: SessionConfig) -> dict | None:
    """The non-expert parts' GPU dtypes (placement.gpu_dtypes.choose: --gpu-dtype, auto under --gpu-budget), or
    a plan's; None when every part stays in the compute dtype."""
    from placement.gpu_dtypes import checkpoint_kind, choose, uniform
    from placement.memory import MemorySettings

    hcfg, rt = config.hybrid, config.runtime
    planned = hcfg.plan.settings.get("gpu_dtypes") if hcfg is not None and hcfg.plan is not None else None
    if planned and config.gpu_dtype == "auto":
        dtypes = dict(planned)
    elif planned and any(k != uniform(config.gpu_dtype).get(p, k) for p, k in planned.items()):
        raise UsageError(f"--gpu-dtype {config.gpu_dtype} differs from the plan's GPU dtypes ({planned}); make a new "
                         f"plan with `hybrid plan --gpu-dtype {config.gpu_dtype}` or drop --gpu-dtype")
    else:
        s = MemorySettings(max_context=rt.max_context, max_batch=rt.max_batch,
                           cpu_dtype=hcfg.cpu_dtype if hcfg is not None else "bf16",
                           gpu_dtype_bytes=torch.empty((), dtype=config.dtype).element_size(),
                           staging_slots=hcfg.staging_slots if hcfg is not None else 1, kv_dtype=rt.kv_dtype,
                           prefill_chunk=rt.prefill_chunk)
        dtypes = choose(cfg, s, hcfg.gpu_budget if hcfg is not None else None, config.gpu_dtype, checkpoint_kind(raw))
    return None if all(k == "bf16" for k in dtypes.values()) else dtypes


def check_placement(model_dir, hcfg, max_context: int, max_batch: int, dtype, gpu_dtypes: dict | None = None,
                    kv_dtype: str = "bf16") -> None:
    """Fail before any weight is read: a plan made for another model, or a --gpu-budget below the
    non-expert weights + KV cache."""
    from hybrid.models import ModelLoadError
    from hybrid.models.checkpoints import read_config

    try:
        _, cfg, _ = read_config(model_dir)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    if hcfg.plan is not None:
        hcfg.plan.check_model(cfg, origin="--plan")
    if hcfg.gpu_budget is not None:
        from placement.memory import MemorySettings, breakdown, gib

        mem = breakdown(cfg, MemorySettings(max_context=max_context, max_batch=max_batch, cpu_dtype=hcfg.cpu_dtype,
                                            gpu_dtype_bytes=torch.empty((), dtype=dtype).element_size(), reserve=0,
                                            gpu_dtypes=gpu_dtypes or {}, kv_dtype=kv_dtype))
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
    if tokenizer_vocab < 0.9 * model_vocab:  # embedding rows rounded up to a multiple of 64 stay within 10%
        log(f"warning: the model has {model_vocab} token ids but its tokenizer only {tokenizer_vocab}; generated ids "
            f">= {tokenizer_vocab} have no text and are dropped from the output (a tokenizer from another model?)")


def eager_for_online_replace(config: SessionConfig, log) -> SessionConfig:
    """Online re-placement changes residency between calls, which captured decode graphs cannot follow."""
    if config.hybrid is None or config.hybrid.replace != "online" or config.runtime.eager:
        return config
    log("hybrid: --replace online changes residency between calls, which decode graphs cannot: decoding eagerly")
    return replace(config, runtime=replace(config.runtime, eager=True))
