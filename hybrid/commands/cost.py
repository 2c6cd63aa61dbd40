"""`hybrid cost`: price one expert on the CPU path vs the ship-weights path, per token count.

`hybrid cost active` gives the batch-level expectation: distinct experts touched and weight bytes read.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from hybrid.errors import UsageError
from placement import cost_model as cm
from placement.hardware import BUILTIN_PROFILES, FALLBACK_PROFILE, default_profile_path, pricing_profile, resolve_profile

DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
GPU_OVERRIDES = ("gpu_flops", "hbm_bw", "link_bw", "alpha")


def parse_tokens(text: str) -> list[int]:
    """'1,128,4096' -> [1, 128, 4096]; every entry a positive integer."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise UsageError(f"--tokens: {part!r} is not an integer (expected e.g. 1,128,4096)") from None
        if value < 1:
            raise UsageError(f"--tokens: token counts must be >= 1, got {value}")
        out.append(value)
    if not out:
        raise UsageError("--tokens: empty list")
    return out


def add_profile_args(p) -> None:
    p.add_argument("--profile", help=f"built-in profile ({', '.join(BUILTIN_PROFILES)}) or a JSON file from "
                   f"`hybrid calibrate`; default: this machine's calibrated profile ({default_profile_path()}) "
                   f"if present, else {FALLBACK_PROFILE}; one calibrated without a GPU borrows {FALLBACK_PROFILE}'s "
                   "GPU figures unless --gpu-flops --hbm-bw --link-bw --alpha give them")
    p.add_argument("--cpu-kernel", help="CPU kernel kind to price (a key of the profile's cpu_flops, or 'auto' "
                   "= the fastest at each m); default: the profile's")
    p.add_argument("--cpu-flops", type=float, help="override C_C, FLOP/s (replaces the profile's CPU kernels)")
    p.add_argument("--dram-bw", type=float, help="override B_D, bytes/s")
    p.add_argument("--gpu-flops", type=float, help="override C_G, FLOP/s")
    p.add_argument("--hbm-bw", type=float, help="override B_H, bytes/s")
    p.add_argument("--link-bw", type=float, help="override B_L (host<->GPU), bytes/s")
    p.add_argument("--alpha", type=float, help="override alpha, seconds per transfer")


def add_shape_args(p) -> None:
    p.add_argument("--shape", default="qwen3-235b-a22b",
                   help=f"expert shape preset ({', '.join(cm.PRESETS)}); default %(default)s")
    p.add_argument("--expert-params", type=int, help="override P_e (parameters of one expert)")
    p.add_argument("--hidden", type=int, help="override h (hidden width D)")
    p.add_argument("--intermediate", type=int, help="override F (expert intermediate width)")
    p.add_argument("--bytes-per-weight", type=float, help="override bytes per weight (2 bf16, 1 int8, ...)")
    p.add_argument("--act-bytes", type=float, help="override b (bytes per activation element on the link)")


def profile_from_args(args):
    """placement.hardware.pricing_profile, as every command resolves it, with the command line's overrides; when
    the overrides give every GPU figure, a profile without GPU figures borrows none."""
    gpu_given = all(getattr(args, k) is not None for k in GPU_OVERRIDES)
    if gpu_given and (args.profile is not None or default_profile_path().exists()):
        hw = resolve_profile(args.profile)
    else:
        hw = pricing_profile(args.profile, note=lambda line: print(f"note: {line}", file=sys.stderr),
                             say_fallback=False)  # the output's first line names the profile
    if args.cpu_flops is not None:
        kind = args.cpu_kernel if args.cpu_kernel not in (None, "auto") else "override"
        hw = replace(hw, cpu_flops={kind: args.cpu_flops}, cpu_curves={}, cpu_kernel=kind)
    elif args.cpu_kernel is not None:
        hw = replace(hw, cpu_kernel=args.cpu_kernel)
    fields = {"dram_bw": args.dram_bw, "gpu_flops": args.gpu_flops, "hbm_bw": args.hbm_bw,
              "link_bw": args.link_bw, "alpha": args.alpha}
    return replace(hw, **{k: v for k, v in fields.items() if v is not None})


def shape_from_args(args):
    return cm.get_shape(args.shape).with_overrides(
        params=args.expert_params, hidden=args.hidden, intermediate=args.intermediate,
        bytes_per_weight=args.bytes_per_weight, act_bytes=args.act_bytes)


def run_cost(args) -> int:
    hw = profile_from_args(args)
    shape = shape_from_args(args)
    tokens = parse_tokens(args.tokens)
    if args.experts < 1:
        raise UsageError(f"--experts must be >= 1, got {args.experts}")
    n = args.experts
    tc = cm.t_cpu(shape, hw, tokens) * n
    tg = cm.t_gpu(shape, hw, tokens) * n
    knee = cm.knee_tokens(shape, hw)
    cross = cm.crossover_tokens(shape, hw)
    if args.json:
        print(json.dumps({
            "profile": hw.name, "cpu_kernel": hw.cpu_kernel, "shape": shape.name,
            "expert_params": shape.params, "expert_bytes": shape.weight_bytes, "hidden": shape.hidden,
            "experts": n, "knee_tokens": knee, "crossover_tokens": cross,
            "t_cpu_ms": {str(m): float(t) * 1e3 for m, t in zip(tokens, tc)},
            "t_gpu_ms": {str(m): float(t) * 1e3 for m, t in zip(tokens, tg)},
            "winner": {str(m): ("gpu" if g < c else "cpu") for m, c, g in zip(tokens, tc, tg)},
        }, indent=2))
        return 0
    print(f"profile {hw.name} (CPU kernel {hw.cpu_kernel}); shape {shape.name}: P_e={shape.params:,} "
          f"W_e={shape.weight_bytes / 2**20:.1f} MiB h={shape.hidden}; {n} expert(s) back to back")
    print(f"{'tokens/expert':>14} {'T_C ship acts, CPU (ms)':>24} {'T_G ship weights, GPU (ms)':>27}  winner")
    for m, c, g in zip(tokens, tc, tg):
        print(f"{m:>14} {c * 1e3:>24.3f} {g * 1e3:>27.3f}  {'GPU' if g < c else 'CPU'}")
    print(f"knee (CPU turns compute-bound): m = {knee:.1f} tokens/expert")
    if cross is None:
        print(f"crossover: the CPU path wins up to {cm.MAX_CROSSOVER_TOKENS:,} tokens/expert")
    else:
        print(f"crossover: GPU wins from {cross} tokens/expert ({cross - 1} -> {cross})")
    return 0


def run_active(args) -> int:
    if args.experts < 1 or args.topk < 1 or args.topk > args.experts:
        raise UsageError(f"need 1 <= --topk <= --experts (got --experts {args.experts} --topk {args.topk})")
    if args.tokens < 0:
        raise UsageError(f"--tokens must be >= 0, got {args.tokens}")
    if args.expert_bytes is not None and args.expert_bytes <= 0:
        raise UsageError(f"--expert-bytes must be positive, got {args.expert_bytes}")
    active = cm.expected_active_experts(args.experts, args.topk, args.tokens)
    out = {"experts": args.experts, "topk": args.topk, "tokens": args.tokens,
           "assignments": args.tokens * args.topk, "expected_active_experts": active}
    if args.expert_bytes is not None:
        out["expert_bytes"] = args.expert_bytes
        out["expected_weight_bytes"] = active * args.expert_bytes
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.tokens} tokens x top-{args.topk} of {args.experts} experts = {out['assignments']} assignments")
    print(f"expected active experts (uniform routing): {active:.2f}")
    if args.expert_bytes is not None:
        print(f"expected weight bytes read: {out['expected_weight_bytes']:,.0f} "
              f"({out['expected_weight_bytes'] / 2**30:.3f} GiB)")
    return 0


def run_layer(args) -> int:
    """One MoE layer per batch size: predicted time of each strategy and the cost model's own split."""
    from placement.layer_model import expected_histogram
    from placement.schedule import LayerScheduler, parse_strategy

    hw = profile_from_args(args).require_gpu()
    shape = shape_from_args(args)
    batches = parse_tokens(args.tokens)
    strategies = [str(parse_strategy(s)) for s in args.strategies.split(",")]
    if not 0 <= args.resident <= shape.num_experts:
        raise UsageError(f"--resident must be in [0, {shape.num_experts}], got {args.resident}")
    try:
        hists = {m: expected_histogram(shape.num_experts, shape.topk, m, args.skew) for m in batches}
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    scheds = {strat: LayerScheduler(shape, hw, strat) for strat in strategies}
    rows = []
    for m, hist in hists.items():
        res, cold = hist[: args.resident], hist[args.resident:]  # the hottest experts are the resident ones
        row = {"tokens": m, "active_experts": int((hist > 0).sum())}
        for strat, sched in scheds.items():
            split = sched.decide(cold, batch_tokens=m, gpu_busy=sched.gpu_time(res), rows=m)
            row[strat] = {"ms": split.total * 1e3, "shipped": int(split.ship.sum()),
                          "cpu": int(((cold > 0) & ~split.ship).sum())}
        rows.append(row)
    if args.json:
        print(json.dumps({"profile": hw.name, "shape": shape.name, "skew": args.skew, "resident": args.resident,
                          "experts": shape.num_experts, "topk": shape.topk, "batches": rows}, indent=2))
        return 0
    print(f"profile {hw.name}; {shape.name}: E={shape.num_experts} top-{shape.topk}, {args.resident} resident, "
          f"routing {args.skew}; predicted layer time in ms (shipped/CPU experts)")
    print(f"{'tokens':>7} {'active':>6} " + " ".join(f"{s:>18}" for s in strategies))
    for r in rows:
        cells = [f"{r[s]['ms']:9.3f} ({r[s]['shipped']:>3}/{r[s]['cpu']:<3})" for s in strategies]
        print(f"{r['tokens']:>7} {r['active_experts']:>6} " + " ".join(f"{c:>18}" for c in cells))
    return 0


def register(sub) -> None:
    p = sub.add_parser("cost", help="price an expert on the CPU vs ship-to-GPU path (DESIGN.md, Cost model)",
                       description="Per token count: T_C (ship activations, run on the CPU) and T_G (ship "
                       "weights, run on the GPU), which wins, the knee and the crossover. SI units.")
    add_profile_args(p)
    add_shape_args(p)
    p.add_argument("--experts", type=int, default=1, help="experts run back to back (times add); default 1")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma-separated tokens per expert; default %(default)s")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_cost)
    inner = p.add_subparsers(dest="cost_mode", metavar="{active,layer}", parser_class=type(p))
    a = inner.add_parser("active", help="expected active experts and weight bytes for a batch",
                         description="E*(1-(1-K/E)^M): distinct experts touched by M uniformly routed tokens.")
    a.add_argument("--experts", type=int, required=True, help="E, routed experts per layer")
    a.add_argument("--topk", type=int, required=True, help="K, experts per token")
    a.add_argument("--tokens", type=int, required=True, help="M, tokens in the batch")
    a.add_argument("--expert-bytes", type=float, help="bytes of one expert's weights")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=run_active)
    lay = inner.add_parser("layer", help="one MoE layer per batch size: each strategy's predicted time",
                           description="For M tokens routed top-K over the shape's E experts (expected "
                           "histogram, uniform or Zipf), the predicted layer time of each strategy and the "
                           "cost model's split of the cold experts into shipped / CPU.")
    add_profile_args(lay)
    add_shape_args(lay)
    lay.add_argument("--tokens", default="1,8,64,512,4096", help="batch sizes (tokens); default %(default)s")
    lay.add_argument("--skew", default="uniform", help="uniform or zipfS, e.g. zipf1.0 (default uniform)")
    lay.add_argument("--resident", type=int, default=0, help="hottest experts resident in VRAM (default 0)")
    lay.add_argument("--strategies", default="cost,cpu,ship,threshold:32", help="default %(default)s")
    lay.add_argument("--json", action="store_true", help="print one JSON object")
    lay.set_defaults(func=run_layer)

