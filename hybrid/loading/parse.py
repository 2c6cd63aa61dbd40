"""Parse: the command-line flags of every command that opens a model, and the frozen config built from them.

The CLI's defaults come from the config dataclasses (RuntimeConfig, HybridConfig) and their checks are the
only ones: a bad value fails here, in one line, before a checkpoint is opened.

Declaring the flags imports neither torch nor the runtime (`hybrid --help` and `hybrid <cmd> --help` answer at
once): torch, HybridConfig and RuntimeConfig are imported by the functions that build the configs.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace

from cpu_kernels.dtypes import NAMES as CPU_DTYPES  # the one table of CPU dtypes
from hybrid.errors import UsageError
from placement.hardware import FALLBACK_PROFILE
from placement.memory import KV_DTYPES
from placement.replace import REPLACE_MODES

# --dtype names -> torch attribute names (the torch.dtype is looked up when a config is built, not at import)
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
          "float16": "float16", "fp16": "float16"}
GPU_DTYPE_CHOICES = ("auto", "bf16", "int8", "int4", "fp8")  # placement.gpu_dtypes.CHOICES (test_gpu_weights)
# RuntimeConfig.max_context, which cannot be read without importing the runtime (and torch) from here;
# tests/test_cli_help_fast.py holds the two equal
MAX_CONTEXT_DEFAULT = 4096


@dataclass(frozen=True)
class SessionConfig:
    """Everything open_session needs, checked: the checkpoint (None: the demo), where and in what dtype it runs,
    how the engine runs it, and how the hybrid layer holds its experts (None: all on the model's device)."""

    model: str | None
    device: torch.device  # annotations stay strings (__future__): torch is not imported to declare them
    dtype: torch.dtype
    runtime: RuntimeConfig
    hybrid: HybridConfig | None = None
    gpu_dtype: str = "auto"  # --gpu-dtype as asked (placement.gpu_dtypes.CHOICES)
    gpu_dtypes: dict | None = None  # what each non-expert part got (check_before_load fills it in)
    prefill_chunk_asked: bool = False  # --prefill-chunk given: kept; else a plan's, or fitted to --gpu-budget


def add_max_context_argument(p) -> None:
    """--max-context and --kv-dtype, declared once for every command that sizes a KV cache (the defaults are
    RuntimeConfig's; --kv-dtype's None: a plan's, else bf16)."""
    p.add_argument("--max-context", type=int, default=MAX_CONTEXT_DEFAULT,
                   help="KV-cache positions per sequence, prompt + generated (default %(default)s)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="KV-cache values: bf16 (default: the model's dtype) or fp8 (float8 e4m3 with a scale of 1.0, "
                   "half the bytes; values beyond +-448 saturate; needs compute capability 8.9+ on a GPU). With "
                   "--plan, default: the plan's")


def add_model_arguments(p) -> None:
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (config.json, *.safetensors, "
                   "tokenizer.json). Default: a small built-in demo model trained on Shakespeare's plays.")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on the GPU, float32 on the CPU")
    add_max_context_argument(p)
    p.add_argument("--gpu-dtype", default="auto", choices=GPU_DTYPE_CHOICES,
                   help="dtype of the weights on the GPU (attention, shared and dense MLPs, embedding, head): bf16, "
                   "fp8 (128x128 blocks; an FP8 checkpoint's own bytes), int8 or int4 (per 128 inputs); an explicit "
                   "dtype also holds the resident experts in it (fp8: int8), about 1.9x / 3.8x as many in the same "
                   "VRAM; auto (default) keeps bf16 unless --gpu-budget needs fewer bytes, then steps the largest "
                   "non-expert parts down first, residents staying bf16 (DESIGN.md, GPU weights)")
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="prompt tokens per prefill pass: a longer prompt is prefilled in passes of N tokens, which "
                   "bounds the activations' VRAM (default 8192; under --gpu-budget the largest of 8192, 4096, ..., 512 "
                   "whose activations take at most a sixteenth of the budget; with --plan, the plan's)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs for decode (always eager on the CPU)")
    p.add_argument("--no-decode-ahead", action="store_true",
                   help="greedy decode waits for each step's tokens before queueing the next (by default, with CUDA "
                        "graphs, step n+1 is queued fed on the GPU before the host reads step n's tokens; same tokens)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (by default a KV slot given back keeps its tokens' K/V and a later "
                   "prompt starting the same way prefills only the rest; the same tokens either way)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, help="seed for sampling (reproducible output)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    add_hybrid_arguments(p)


def add_hybrid_arguments(p) -> None:
    g = p.add_argument_group("hybrid experts (cold experts on the CPU; any of these turns it on)")
    g.add_argument("--gpu-experts", type=int, metavar="N",
                   help="resident experts per MoE layer, chosen by routing counts of a short calibration run")
    g.add_argument("--gpu-budget", metavar="SIZE", help="VRAM for the whole model (24GiB, 24000MB or bytes); "
                   "resident experts get what the rest leaves")
    g.add_argument("--schedule", default=None, help="cold-expert split per batch: cost (default: the calibrated "
                   "cost model), cpu (llama.cpp -ot exps=CPU), ship (always ship weights), threshold:N")
    g.add_argument("--cpu-dtype", default=None, choices=CPU_DTYPES, help="dtype of the CPU-resident experts "
                   "(default bf16, and mxfp4 for MXFP4 checkpoints: 4-bit e2m1 + one exponent per 32 values, "
                   "gpt-oss's published format, kept as published; bf16/int8/int4 convert them. q8_0: int8 in "
                   "blocks of 32 with an fp16 scale each, llama.cpp's Q8_0, 8.5 bits a weight; q4_0: 4-bit values in "
                   "blocks of 32 with an fp16 scale each, llama.cpp's Q4_0, 4.5 bits; q4_k: llama.cpp's Q4_K, "
                   "4.5 bits; q5_k: Q5_K, 5.5 bits; q6_k: Q6_K, 6.56 bits; q2_k: Q2_K, 2.63 bits; q3_k: Q3_K, 3.44 "
                   "bits; iq4_xs: IQ4_XS, 4.25 bits; iq2_xxs: IQ2_XXS, 2.06 bits; iq3_xxs: IQ3_XXS, 3.06 bits; iq3_s: "
                   "IQ3_S, 3.44 bits; iq1_s: IQ1_S, 1.56 bits; iq1_m: IQ1_M, 1.75 bits; iq3_xxs, iq3_s, iq1_s and "
                   "iq1_m hold a GGUF file's blocks only (no quantizer from other weights; iq2_xxs's "
                   "rounds to the nearest codebook entry). A GGUF file: the "
                   "format nearest its expert blocks, its blocks as they are for Q4_0 (q4_0; int4 in groups of 32 "
                   "holds them too), Q8_0 (q8_0), Q4_K (q4_k), Q5_K (q5_k), Q6_K (q6_k), Q2_K (q2_k), Q3_K (q3_k), "
                   "IQ4_XS (iq4_xs), IQ2_XXS (iq2_xxs), IQ3_XXS (iq3_xxs), IQ3_S (iq3_s), IQ1_S (iq1_s), IQ1_M (iq1_m) and MXFP4 (mxfp4). A layer's down keeps its "
                   "own type where a format holds it (a Q4_K_M file's Q6_K downs as q6_k, a UD-IQ1_S file's IQ2_XXS "
                   "or Q4_K downs beside its IQ1_S gates and ups as iq2_xxs or q4_k); IQ2_XS and IQ2_S (q2_k), TQ2_0 "
                   "and TQ1_0 (iq2_xxs) are de-quantized and re-quantized: no format holds them)")
    g.add_argument("--cpu-threads", type=int, help="CPU executor threads (default: all this process may use)")
    g.add_argument("--profile", help="hardware profile for the scheduler (default: this machine's calibrated "
                   f"profile, else the built-in {FALLBACK_PROFILE})")
    g.add_argument("--plan", metavar="FILE", help="placement plan written by `hybrid plan --out` (resident experts "
                   "per layer, CPU dtype); replaces --gpu-experts / --gpu-budget")
    g.add_argument("--defer-experts", type=int, default=None, metavar="N",
                   help="expert deferral, experimental (changes the model's output; off by default): each token's N lowest-ranked "
                   "routed experts of a layer are added to the next layer's output, so that in decode graphs their "
                   "CPU work overlaps the next layer's attention (KTransformers' Expert Deferral)")
    g.add_argument("--replace", choices=REPLACE_MODES, default=None, help="online: move experts into VRAM as "
                   "routing shifts, when the copy pays for itself (DESIGN.md, Placement); decodes eagerly (default off)")
    g.add_argument("--int4-group", type=int, choices=(32, 64, 128), default=None, metavar="N",
                   help="--cpu-dtype int4: inputs per scale, 32, 64 or 128 (default 128; smaller is more precise "
                   "and a little larger)")
    g.add_argument("--no-cache", dest="packed_cache", action="store_false",
                   help="neither read nor write the packed-expert cache ($HYBRID_CACHE/packed; `hybrid cache list`): "
                   "by default a restart copies the CPU executor's packed experts back instead of converting the "
                   "checkpoint's again")


def parse_bytes(text: str) -> int:
    """'24GiB', '24000MB', '1.5TB', '123' -> bytes (binary for KiB/MiB/GiB/TiB, decimal for KB/MB/GB/TB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise UsageError(f"cannot read {text!r} as a size (examples: 24GiB, 24000MB, 25769803776)")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(value * scale)


def resolve_device(name: str):
    """--device as a torch.device; 'auto' is cuda where there is one."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    return dev


def runtime_config_from_args(args, max_batch: int, device):
    """The engine's config; RuntimeConfig's own check of --max-context is the only one."""
    from hybrid.runtime.config import RuntimeConfig

    ahead = False if getattr(args, "no_decode_ahead", False) else None  # None: the engine's default (on with graphs)
    try:
        return RuntimeConfig(max_batch=max_batch, max_context=args.max_context,
                             eager=args.eager or device.type != "cuda", decode_ahead=ahead,
                             prefix_cache=not getattr(args, "no_prefix_cache", False),
                             kv_dtype=getattr(args, "kv_dtype", None) or "bf16",
                             **({"prefill_chunk": args.prefill_chunk} if getattr(args, "prefill_chunk", None) else {}))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def hybrid_config_from_args(args):
    """None when no hybrid flag was given (all experts on the model's device). Every flag of the group turns it
    on, as its title says: --cpu-threads or --profile alone must not be dropped without a word."""
    flags = ("gpu_experts", "gpu_budget", "schedule", "cpu_dtype", "cpu_threads", "profile", "plan", "replace",
             "defer_experts", "int4_group")
    if all(getattr(args, f, None) is None for f in flags):
        return None
    from hybrid.offload.config import HybridConfig

    plan, cpu_dtype = None, args.cpu_dtype
    if getattr(args, "plan", None) is not None:
        from placement.plan_file import load_plan

        plan = load_plan(args.plan)
        planned = plan.settings.get("cpu_dtype", "bf16")
        if cpu_dtype is not None and cpu_dtype != planned:
            raise UsageError(f"--cpu-dtype {cpu_dtype} differs from the plan's {planned}; make a new plan with "
                             f"`hybrid plan --cpu-dtype {cpu_dtype}` or drop --cpu-dtype")
        cpu_dtype = planned
    chosen, group = cpu_dtype is not None, getattr(args, "int4_group", None)
    planned_group = plan.settings.get("int4_group") if plan is not None else None
    if planned_group is not None:
        if group is not None and group != planned_group:
            raise UsageError(f"--int4-group {group} differs from the plan's {planned_group}; make a new plan with "
                             f"`hybrid plan --int4-group {group}` or drop --int4-group")
        group = planned_group
    fmt = None if chosen else gguf_cpu_format(getattr(args, "model", None))
    layer_formats = fmt is not None and not fmt.only  # a file of mixed types: each layer in its own blocks' format
    if fmt is not None:  # chosen for the user from the file's blocks: checkpoint_cpu_dtype keeps it
        chosen, cpu_dtype = True, fmt.dtype
        group = (group or fmt.group) if cpu_dtype == "int4" else group
        import logging

        name = f"int4 group {group}" if cpu_dtype == "int4" else cpu_dtype
        how = ("the file's blocks as they are" if fmt.exact and (cpu_dtype != "int4" or group == fmt.group)
               else "re-quantized from the file's values")
        logging.getLogger("hybrid.offload").warning(
            "GGUF file whose experts are %s %s: the CPU experts default to %s, %s%s (--cpu-dtype chooses one for "
            "all)", "all" if fmt.only else "mostly", fmt.follows, name, how,
            "" if fmt.only else "; layers of other types keep formats of their own where one holds their blocks")
    return HybridConfig(gpu_experts=args.gpu_experts,
                        gpu_budget=parse_bytes(args.gpu_budget) if args.gpu_budget else None,
                        schedule=args.schedule or "cost", cpu_dtype=cpu_dtype or "bf16",
                        cpu_dtype_chosen=chosen, layer_formats=layer_formats,
                        cpu_threads=getattr(args, "cpu_threads", None), profile=getattr(args, "profile", None),
                        plan=plan, replace=getattr(args, "replace", None) or "off",
                        defer_experts=getattr(args, "defer_experts", None) or 0,
                        packed_cache=getattr(args, "packed_cache", True),
                        cpu_group=group or HybridConfig.cpu_group,
                        # the plan's VRAM includes its staging: slots x experts per slot
                        staging_slots=int(plan.settings.get("staging_slots", HybridConfig.staging_slots))
                        if plan is not None else HybridConfig.staging_slots,
                        ship_chunk=int(plan.settings.get("ship_chunk", HybridConfig.ship_chunk))
                        if plan is not None else HybridConfig.ship_chunk)


def gguf_cpu_format(model: str | None):
    """The CPU format a GGUF file's experts default to when no --cpu-dtype is given (hybrid.models.gguf.repack
    DefaultFormat: the executor's format nearest the type of most of its expert bytes; q4_0 for Q4_0 and mxfp4 for
    MXFP4 hold the file's values exactly), or None (not a GGUF file, or one that cannot be read,
    which the load then names: bf16, as for any checkpoint)."""
    from hybrid.models.gguf import is_gguf

    if not model or not is_gguf(model):
        return None
    from hybrid.models.checkpoints import open_cached
    from hybrid.models.errors import ModelLoadError
    from hybrid.models.gguf.repack import default_format

    try:
        return default_format(open_cached(model))
    except ModelLoadError:
        return None


def session_config_from_args(args, max_batch: int = 1) -> SessionConfig:
    """Every flag checked, in the order the user reads them: device, dtype, context, then the hybrid flags."""
    import torch

    device = resolve_device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else (torch.bfloat16 if device.type == "cuda"
                                                                    else torch.float32)
    runtime = runtime_config_from_args(args, max_batch, device)
    hybrid = hybrid_config_from_args(args)
    return SessionConfig(model=args.model or None, device=device, dtype=dtype,
                         runtime=with_planned_kv_dtype(runtime, hybrid, getattr(args, "kv_dtype", None)),
                         hybrid=hybrid, gpu_dtype=getattr(args, "gpu_dtype", None) or "auto",
                         prefill_chunk_asked=getattr(args, "prefill_chunk", None) is not None)


def with_planned_kv_dtype(runtime, hybrid, asked: str | None):
    """A plan's KV dtype when --kv-dtype is not given (the plan priced its KV cache in it); a --kv-dtype that
    differs from the one a plan records is refused, as --cpu-dtype is. Plans without the field: the flag's."""
    planned = hybrid.plan.settings.get("kv_dtype") if hybrid is not None and hybrid.plan is not None else None
    if planned is None or asked == planned:
        return runtime
    if asked is not None:
        raise UsageError(f"--kv-dtype {asked} differs from the plan's {planned}; make a new plan with "
                         f"`hybrid plan --kv-dtype {asked}` or drop --kv-dtype")
    return replace(runtime, kv_dtype=planned)


def with_pricing_profile(config: SessionConfig, log=lambda m: print(m, file=sys.stderr)) -> SessionConfig:
    """The hybrid layer's profile resolved once by placement.hardware.pricing_profile, the rule every command
    shares (a profile calibrated without a GPU keeps its CPU figures and borrows only the GPU ones), its note
    in the log; the resolved profile travels in HybridConfig.profile."""
    if config.hybrid is None:
        return config
    from placement.hardware import pricing_profile

    hw = pricing_profile(config.hybrid.profile, note=lambda line: log(f"hybrid: {line}"))
    return replace(config, hybrid=replace(config.hybrid, profile=hw))


def with_ship_staging(config: SessionConfig, cfg) -> SessionConfig:
    """Under --gpu-budget without a plan, the ship lane's staging `hybrid plan` would choose for the same model,
    budget, context, batch, dtypes and profile (placement.planner.choose_staging, the one rule): the bytes it
    does not take go to resident experts (hybrid.loading.place counts the staging actually built). Needs the
    resolved profile (with_pricing_profile) and the GPU dtypes (check_before_load). A plan's staging is the
    plan's; --gpu-experts N (no budget to trade against) keeps HybridConfig's default."""
    h = config.hybrid
    if h is None or h.plan is not None or h.gpu_budget is None:
        return config
    import torch

    from cpu_kernels.topology import Topology
    from placement.hardware import pricing_profile
    from placement.memory import MemorySettings
    from placement.planner import choose_staging

    gb = torch.empty((), dtype=config.dtype).element_size()
    if gb not in (2, 4):  # float64 exactness runs: the planner prices 2- and 4-byte GPU dtypes only
        return config
    try:
        nodes = tuple(len(n) for n in Topology.discover().limit(h.cpu_threads).nodes)  # as `hybrid plan` counts
    except ValueError as exc:
        raise UsageError(f"--cpu-threads: {exc}") from None
    s = MemorySettings(max_context=config.runtime.max_context, max_batch=config.runtime.max_batch,
                       cpu_dtype=h.cpu_dtype, gpu_dtype_bytes=gb, node_threads=nodes, group=h.cpu_group,
                       gpu_dtypes=config.gpu_dtypes or {}, kv_dtype=config.runtime.kv_dtype,
                       prefill_chunk=config.runtime.prefill_chunk)
    slots, chunk = choose_staging(cfg, None, pricing_profile(h.profile), s, h.gpu_budget)
    return replace(config, hybrid=replace(h, staging_slots=slots, ship_chunk=chunk))


def sampling_from_args(args):
    from hybrid.runtime.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
