"""`hybrid plan`: which experts live in VRAM under a GPU and a DRAM budget, and what that buys.

Reads only the checkpoint's config.json and safetensors headers (no weight is loaded), the routing statistics
of `hybrid profile-routing` (uniform without them) and a hardware profile; prints the memory breakdown, the
resident experts per layer, the NUMA split of the experts, predicted tokens/s and load time
(placement/load_time.py), and writes the plan file that `generate`, `chat` and `serve` take with --plan. See
placement/planner.py.
"""

from __future__ import annotations

import json
import sys

from cpu_kernels.dtypes import NAMES as CPU_DTYPE_NAMES
from hybrid.errors import UsageError
from placement.hardware import FALLBACK_PROFILE


def register(subparsers) -> None:
    from hybrid.loading.parse import add_max_context_argument
    from placement.memory import DEFAULT_RESERVE, MemorySettings
    from placement.planner import DEFAULT_PREFILL_TOKENS, STAGING_TOLERANCE

    d = MemorySettings()
    p = subparsers.add_parser("plan", help="plan expert placement for VRAM/DRAM budgets",
                              description="Choose the resident (VRAM) experts per layer for the given budgets, "
                              "by predicted decode time saved per byte across layers; report memory, NUMA split "
                              "and predicted tokens/s. Fails before loading anything if the budgets cannot work.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="checkpoint directory (only config.json and the safetensors "
                     "headers are read); default: the demo")
    # the preset names are not listed here: reading them imports the model package and torch (slow --help)
    src.add_argument("--preset", help="plan for a published model's config without its checkpoint (README, Models, "
                     "lists them, e.g. qwen3-235b-a22b; an unknown name lists them too)")
    p.add_argument("--gpu-budget", required=True, metavar="SIZE", help="VRAM for everything (24GiB, 24000MB, bytes)")
    p.add_argument("--cpu-budget", required=True, metavar="SIZE", help="DRAM for the experts and pinned buffers")
    p.add_argument("--stats", metavar="FILE", help="routing statistics from `hybrid profile-routing` (default: uniform)")
    p.add_argument("--profile", help="hardware profile (built-in name or JSON from `hybrid calibrate`; default: this "
                   f"machine's calibrated one, else the built-in {FALLBACK_PROFILE}; one calibrated without a GPU "
                   f"borrows {FALLBACK_PROFILE}'s GPU figures)")
    add_max_context_argument(p)
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="sequences decoded together (default %(default)s)")
    p.add_argument("--cpu-dtype", default=None, choices=CPU_DTYPE_NAMES,
                   help="dtype of the experts in DRAM (default: what `hybrid generate` loads, bf16 where every expert "
                   "fits --cpu-budget so (else the most precise of int8 and int4 that fits, said on stderr; `hybrid "
                   "generate --plan` then loads that), or mxfp4 for "
                   "checkpoints published in MXFP4 such as gpt-oss, or for a GGUF file the format nearest its expert "
                   "blocks, see `hybrid generate --help`; mxfp4: 0.53125 bytes a weight, q8_0 1.0625, q4_0 0.5625, q4_k 0.5625, q5_k 0.6875, q6_k 0.8203, q2_k 0.3281, q3_k 0.4297, iq4_xs 0.5312, iq2_xxs 0.2578, iq3_xxs 0.3828, iq3_s 0.4297, iq1_s 0.1953, iq1_m 0.2188)")
    p.add_argument("--int4-group", type=int, choices=(32, 64, 128), default=None, metavar="N",
                   help="values per int4 scale when --cpu-dtype is int4: 32, 64 or 128 (default 128; in groups of 32 "
                   "a GGUF file's Q4_0 blocks are kept as they are, as q4_0 keeps them at 4.5 bits); the plan records "
                   "it for --plan")
    p.add_argument("--gpu-dtype", default="auto", choices=("auto", "bf16", "int8", "int4", "fp8"),
                   help="dtype of the weights on the GPU (default auto: the most precise per non-expert part that "
                   "leaves a quarter of --gpu-budget for resident experts, which stay bf16; an FP8 checkpoint steps "
                   "to its own fp8 bytes first; int8 / int4 / fp8 also hold the resident experts as int8 / int4 / "
                   "int8, more of them in the budget; see placement/gpu_dtypes.py)")
    p.add_argument("--staging-slots", type=int, metavar="N", help="ship-lane staging slots (default: chosen with "
                   f"--ship-chunk as the smallest staging whose predicted prefill is within {STAGING_TOLERANCE:.0%}% "
                   "of the fastest, the rest of the budget going to resident experts; given either one, the other "
                   f"defaults to {d.staging_slots} slots / {d.ship_chunk} experts)")
    p.add_argument("--ship-chunk", type=int, metavar="N", help="experts per staging slot, shipped and run as one "
                   "grouped GEMM (default: chosen, see --staging-slots)")
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="prompt tokens per prefill pass, whose activations the plan counts (default: the largest of "
                   "8192, 4096, ..., 512 whose activations take at most a sixteenth of --gpu-budget; the plan records "
                   "it for --plan)")
    p.add_argument("--reserve", default=str(DEFAULT_RESERVE), metavar="SIZE",
                   help="VRAM kept for the CUDA context, workspaces and allocator slack (default 1GiB: an H100 with CUDA 13 "
                        "used 570-900 MiB beyond the modeled tensors)")
    p.add_argument("--numa-threads", metavar="N,N,...", help="threads per NUMA node of the CPU executor (default: this "
                   "machine's topology; give it to plan for another box)")
    p.add_argument("--cpu-threads", type=int, help="CPU executor threads on this machine (default: all)")
    p.add_argument("--prefill-tokens", type=int, default=DEFAULT_PREFILL_TOKENS,
                   help="prompt length the prefill prediction is priced at (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", metavar="FILE", help="write the plan file (for --plan)")
    p.set_defaults(func=run)


def node_threads(args) -> tuple[int, ...]:
    if args.numa_threads:
        try:
            out = tuple(int(x) for x in args.numa_threads.split(","))
        except ValueError:
            raise UsageError(f"--numa-threads: expected e.g. 8,8, got {args.numa_threads!r}") from None
        return out
    from cpu_kernels.topology import Topology

    try:
        topo = Topology.discover().limit(args.cpu_threads)
    except ValueError as exc:
        raise UsageError(f"--cpu-threads: {exc}") from None
    return tuple(len(n) for n in topo.nodes)


def build_plan(args):
    """The plan for the command line's model, budgets and settings. The GPU dtypes are chosen first, with the
    staging given or the default one (as the runtime chooses them before it knows its staging); then, unless
    --staging-slots or --ship-chunk is given, the ship lane's staging (placement.planner.choose_staging), whose
    bytes left over go to resident experts."""
    from dataclasses import replace

    from hybrid.models.checkpoints import read_config
    from hybrid.loading.parse import parse_bytes
    from placement.hardware import pricing_profile
    from placement.memory import MemorySettings
    from placement.planner import PlanSettings, choose_staging, plan
    from placement.routing_stats import load_stats

    # settings and budgets first: a bad value fails before the checkpoint is even opened
    d = MemorySettings()
    mem = MemorySettings(max_context=args.max_context, max_batch=args.max_batch, cpu_dtype=args.cpu_dtype or "bf16",
                         group=args.int4_group or d.group,
                         staging_slots=d.staging_slots if args.staging_slots is None else args.staging_slots,
                         ship_chunk=d.ship_chunk if args.ship_chunk is None else args.ship_chunk,
                         reserve=parse_bytes(args.reserve), node_threads=node_threads(args),
                         kv_dtype=args.kv_dtype or "bf16",
                         **({"prefill_chunk": args.prefill_chunk} if args.prefill_chunk is not None else {}))
    settings = PlanSettings(gpu_budget=parse_bytes(args.gpu_budget), cpu_budget=parse_bytes(args.cpu_budget),
                            memory=mem, prefill_tokens=args.prefill_tokens)
    model_dir = args.model
    if args.preset:
        from hybrid.models.families import family_for
        from hybrid.models.presets import published_config

        try:
            raw = published_config(args.preset)
        except KeyError as exc:
            raise UsageError(str(exc.args[0])) from None
        cfg, model_dir = family_for(raw).parse_config(raw), f"preset {args.preset}"
    else:
        if not model_dir:
            from hybrid.runtime.demo import demo_checkpoint

            model_dir = str(demo_checkpoint())
        _, cfg, raw = read_config(model_dir)
    fmt = None
    if args.cpu_dtype is None:  # the dtype the runtime would load, so that the plan prices the same bytes
        from hybrid.loading.parse import gguf_cpu_format
        from hybrid.offload.config import default_cpu_dtype

        fmt = None if args.preset else gguf_cpu_format(model_dir)  # a GGUF file's: the format nearest its blocks
        if fmt is not None:
            mem = replace(mem, cpu_dtype=fmt.dtype, group=(args.int4_group or fmt.group) if fmt.dtype == "int4"
                          else mem.group)
        else:
            mem = replace(mem, cpu_dtype=default_cpu_dtype(raw))
            if mem.cpu_dtype == "bf16":  # bf16 where it fits the DRAM budget, else the most precise dtype that does
                from placement.planner import fit_cpu_dtype

                fitted, why = fit_cpu_dtype(cfg, replace(settings, memory=mem))
                if why is not None:
                    print(f"note: {why}", file=sys.stderr)
                    mem = replace(mem, cpu_dtype=fitted)
        settings = replace(settings, memory=mem)
    if not args.preset:  # a GGUF file's layers whose down (or gate and up) the load puts in a dtype of their own
        from hybrid.loading.check import gguf_expert_dtypes

        own = fmt is not None and not fmt.only  # a mixed file in its own formats, as the runtime loads it
        downs, layers = gguf_expert_dtypes(model_dir, mem.cpu_dtype, mem.group, own)
        mem = replace(mem, down_dtypes=downs, layer_dtypes=layers)
    from placement.gpu_dtypes import checkpoint_kind, choose
    from placement.memory import fit_prefill_chunk

    if args.prefill_chunk is None:
        mem = replace(mem, prefill_chunk=fit_prefill_chunk(cfg, mem, settings.gpu_budget))
    mem = replace(mem, gpu_dtypes=choose(cfg, mem, settings.gpu_budget, args.gpu_dtype, checkpoint_kind(raw)))
    settings = replace(settings, memory=mem)
    stats = load_stats(args.stats) if args.stats else None
    hw = pricing_profile(args.profile, note=lambda line: print(f"note: {line}", file=sys.stderr))
    if args.staging_slots is None and args.ship_chunk is None:
        slots, chunk = choose_staging(cfg, stats, hw, mem, settings.gpu_budget, settings.prefill_tokens)
        settings = replace(settings, memory=replace(mem, staging_slots=slots, ship_chunk=chunk))
    p = plan(cfg, stats, hw, settings)
    return p, model_dir, hw, load_prediction(cfg, raw, None if args.preset else model_dir, p, hw)


def load_prediction(cfg, raw: dict, model_dir, p, hw):
    """placement.load_time's first-load and packed-cache times for the plan's CPU dtype: the checkpoint's bytes
    from its safetensors headers, or from config.json's sizes for a preset (or headers that cannot be read)."""
    from pathlib import Path

    from hybrid.models.errors import ModelLoadError
    from hybrid.models.loader import checkpoint_index
    from placement.load_time import config_checkpoint_bytes, file_checkpoint_bytes, predict_load

    ckpt = None
    if model_dir is not None:
        try:
            ckpt = file_checkpoint_bytes(checkpoint_index(Path(model_dir)), cfg.num_layers)
        except (ModelLoadError, OSError):
            pass
    ckpt = ckpt or config_checkpoint_bytes(cfg, raw)
    return predict_load(cfg, ckpt, p.memory["cpu"]["experts"], p.settings["cpu_dtype"], hw)


def prediction_basis(hw, cuda: bool | None = None) -> dict:
    """Whose GPU the predicted tokens/s describe: the profile's GPU and link figures, which on a
    machine without CUDA are a hypothetical GPU, never this machine."""
    from hybrid.runtime.device_role import is_cuda

    cuda = is_cuda(None) if cuda is None else cuda
    figures = (f"C_G {hw.gpu_flops / 1e12:.0f} TFLOP/s, HBM {hw.hbm_bw / 1e9:.0f} GB/s, link {hw.link_bw / 1e9:.0f} GB/s, "
               f"DRAM {hw.dram_bw / 1e9:.0f} GB/s")
    source = "built-in" if hw.source != "calibrated" else "calibrated"
    donor = hw.machine.get("gpu_figures_from")  # a CPU-only calibration: only its CPU figures are this machine's
    whose = (f"the built-in {donor}'s GPU figures (profile {hw.name}: CPU calibrated without a GPU)" if donor
             else f"profile {hw.name}'s ({source}) GPU figures")
    if donor:
        source = f"calibrated CPU, built-in {donor} GPU"
    if cuda:
        note = f"assumes {whose}: {figures}"
    else:
        note = f"HYPOTHETICAL: this machine has no CUDA device; the prediction assumes {whose}: {figures}"
    return {"profile": hw.name, "profile_source": source, "cuda_device_here": cuda, "hypothetical": not cuda,
            "note": note}


def run(args) -> int:
    p, model_dir, hw, load = build_plan(args)
    basis = prediction_basis(hw)
    if args.out:
        p.save(args.out)
    if args.json:
        print(json.dumps({**p.to_json(), "prediction_basis": basis, "load_time": load.to_json()}))
        return 0
    text = describe(p, model_dir)
    if basis["hypothetical"]:
        text = text.replace("\npredicted: ", "\npredicted on a hypothetical GPU: ")
    print(text)
    print(f"  ({basis['note']})")
    print(load.line())
    if args.out:
        print(f"plan written to {args.out} (use: hybrid generate --model "
              f"{'DIR' if args.preset else model_dir} --plan {args.out})")
    return 0


def kv_note(model: dict, settings: dict | None = None) -> str:
    """The attention kind's cache per token (MLA keeps only the latent and the rope key)."""
    if "kv_bytes_per_token" not in model:  # a plan written before the field existed
        return ""
    kind = {"mla": "MLA latent + rope key", "gqa": "K + V"}.get(model.get("attention"), model.get("attention"))
    dtype = (settings or {}).get("kv_dtype")  # plans before --kv-dtype: the compute dtype, unnamed
    return f"; {kind}{' ' + dtype if dtype else ''}: {model['kv_bytes_per_token'] / 1024:.1f} KiB per token"


def gpu_weights_line(p) -> list[str]:
    """Each non-expert part's GPU dtype and bytes (plans written before GPU dtypes existed: nothing)."""
    from placement.gpu_dtypes import describe as describe_dtypes

    dtypes, parts = p.settings.get("gpu_dtypes"), p.memory["gpu"].get("non_expert_parts")
    if not dtypes or not parts:
        return []
    return [f"GPU weights: {describe_dtypes(dtypes, parts)}, other (norms, routers, biases) {parts['other'] / 2**20:.1f} MiB"]


def activations_note(g: dict, settings: dict) -> str:
    """', prefill activations 812.0 MiB (passes of 2048 tokens)' (plans made before they were counted: nothing)."""
    if "prefill_activations" not in g:
        return ""
    from placement.memory import gib

    return f", prefill activations {gib(g['prefill_activations'])} (passes of {settings.get('prefill_chunk')} tokens)"


def resident_note(settings: dict) -> str:
    """' in int4': the resident experts' dtype where they are quantized (hybrid.offload.resident)."""
    from placement.gpu_dtypes import resident_kind

    kind = resident_kind(settings.get("gpu_dtypes"))
    return "" if kind == "bf16" else f" in {kind}"


def staging_note(settings: dict) -> str:
    """' (2 slots x 1 expert)': the ship lane's staging as the plan sized it (older plans: its bytes only)."""
    slots, chunk = settings.get("staging_slots"), settings.get("ship_chunk")
    if slots is None or chunk is None:
        return ""
    return f" ({slots} slot{'s' * (slots != 1)} x {chunk} expert{'s' * (chunk != 1)})"


def own_formats_note(settings: dict) -> str:
    """A GGUF file's layers whose gates and ups, or downs, the load keeps in CPU dtypes other than the plan's (each
    priced in its own): "; own formats: gates and ups q2_k x1, downs q6_k x2"."""
    from collections import Counter

    parts = []
    for key, what in (("layer_dtypes", "gates and ups"), ("down_dtypes", "downs")):
        counts = Counter(settings.get(key) or ())
        if counts:
            parts.append(f"{what} " + ", ".join(f"{d} x{n}" for d, n in sorted(counts.items())))
    return "; own formats: " + ", ".join(parts) if parts else ""


def describe(p, model_dir: str) -> str:
    from placement.memory import gib

    g, c = p.memory["gpu"], p.memory["cpu"]
    counts = [len(lp.resident_experts) for lp in p.layers]
    lines = [
        f"model {model_dir}: {len(p.layers)} MoE layers x {p.model['num_experts']} experts, profile "
        f"{p.settings['profile']}, CPU dtype {p.settings['cpu_dtype']}, stats {p.settings['stats'].get('kind', 'file')}",
        f"GPU  {gib(p.gpu_bytes)} of {gib(p.gpu_budget_bytes)}: non-expert {gib(g['non_expert'])}, KV cache "
        f"{gib(g['kv_cache'])} ({p.settings['max_batch']} x {p.settings['max_context']}{kv_note(p.model, p.settings)}), staging {gib(g['staging'])}{staging_note(p.settings)}, "
        f"graph buffers {gib(g['graph_buffers'])}{activations_note(g, p.settings)}, reserve {gib(g['reserve'])}, "
        f"resident experts "
        f"{gib(g['resident_experts'])} ({sum(counts)} x {g['per_resident_expert'] / 2**20:.1f} MiB"
        f"{resident_note(p.settings)})",
        *gpu_weights_line(p),
        f"DRAM {gib(p.cpu_bytes)} of {gib(p.cpu_budget_bytes)}: experts {gib(c['experts'])} (cold "
        f"{gib(c['cold_experts'])}{own_formats_note(p.settings)}), pinned buffers {gib(c['pinned_buffers'])}",
        "resident experts per layer: " + " ".join(f"{lp.layer}:{len(lp.resident_experts)}" for lp in p.layers),
        "NUMA: " + "; ".join(f"node {n['node']} ({n['threads']} threads) F[{n['f_start']}:{n['f_end']}] "
                             f"{gib(n['bytes'])}" for n in p.numa),
        f"predicted: decode {p.predicted_decode_tokens_per_s:.1f} tokens/s at batch {p.settings['max_batch']}, "
        f"prefill {p.predicted_prefill_tokens_per_s:.0f} tokens/s ({p.settings['prefill_tokens']}-token prompt)",
    ]
    return "\n".join(lines)
