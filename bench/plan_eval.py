"""The placement planner against the machine: predicted vs measured decode tokens/s for several GPU
budgets, peak GPU memory vs each budget, and a synthetic routing shift (online re-placement vs static).

    python -m bench.make_checkpoint --preset qwen3-30b-a3b --layers 8 --out /tmp/q3-8l
    python -m bench.plan_eval --model /tmp/q3-8l --profile PROFILE.json --budgets 4GiB,6GiB,8GiB \
        --cpu-budget 100GiB --out DIR

Without --model the demo checkpoint is used (CPU smoke run: the "GPU" is torch on the CPU, so the
numbers only prove the harness works). Steps:

1. Routing statistics: the model is loaded once, every expert in the CPU executor; prompts of random
   token ids are prefilled and continued greedily as the measured decode is (--profile-decode), and the
   router's choices counted (hybrid profile-routing's recorder). With random weights, greedy decode
   routes very differently from prefill (most of decode's routing goes to experts that prefill-only
   statistics rank cold), so prefill-only statistics mispredict decode.
2. Per budget: `placement.planner.plan`, its residency set on the loaded layers, a fresh Engine (CUDA
   graphs on a GPU), a warm-up, then `--steps` decode steps at batch --max-batch after a short prompt.
   Measured tokens/s vs the plan's predicted_decode_tokens_per_s (error = measured / predicted - 1), and
   the same for a prefill of --prefill-tokens (best of 3); the same decode again, eager, to count the
   routing those steps saw, and the plan's placement priced on that routing (the cost model's own error,
   apart from the profiled statistics' mismatch with the measured tokens);
   peak allocated VRAM (torch.cuda.max_memory_allocated, which leaves out the CUDA context the plan's
   --reserve stands for) vs the plan's gpu_bytes and the budget.
3. Routing shift, at the middle budget, eager decode (re-placement needs it): `--steps` steps, then
   every router's rows are permuted (the hot experts become others), then `--steps` more; tokens/s per
   window of --window steps, once with the static plan and once with --replace online.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from hybrid.commands.profile_routing import profile
from hybrid.loading.parse import parse_bytes
from hybrid.offload.build import load_hybrid
from hybrid.offload.config import HybridConfig
from hybrid.offload.replace import OnlineReplacer
from hybrid.runtime.engine import Engine
from hybrid.loading.parse import resolve_device
from placement.calibrate import cpu_name
from placement.hardware import pricing_profile
from placement.measure import cuda_sync
from placement.memory import MemorySettings, breakdown
from placement.planner import PlanSettings, decode_step_time, expert_shapes, plan
from placement.replace import ReplaceConfig
from placement.routing_stats import RoutingStats


def rel_error(measured: float, predicted: float, comparable: bool) -> float | None:
    """measured / predicted - 1, or None when it means nothing: a prediction for the profile's GPU against a
    CPU-only measurement (not comparable), or a zero / non-finite figure (no NaN, no -100%)."""
    if not comparable or not (np.isfinite(measured) and np.isfinite(predicted)) or predicted <= 0:
        return None
    return measured / predicted - 1.0


def pct(x: float | None, fmt: str = "+.0%") -> str:
    return "n/a (CPU-only)" if x is None else format(x, fmt)


def finite(obj):
    """The results with every NaN / inf replaced by None (JSON has neither)."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def decode_run(eng, batch: int, prompt_len: int, steps: int, vocab: int, seed: int, window: int = 0, on_step=None):
    """Prefill `batch` random prompts, then `steps` greedy decode steps. -> (tokens/s, [tokens/s per window])."""
    g = torch.Generator().manual_seed(seed)
    slots, last = [], []
    for _ in range(batch):
        s = eng.allocate_slot()
        logits = eng.prefill(s, torch.randint(0, vocab, (prompt_len,), generator=g).tolist())
        slots.append(s)
        last.append(int(logits.argmax()))
    cuda_sync()
    t0 = tw = time.perf_counter()
    per_window = []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        logits = eng.decode_step(slots, last)
        last = logits.argmax(-1).tolist()
        if window and (i + 1) % window == 0:
            cuda_sync()
            now = time.perf_counter()
            per_window.append(window * batch / (now - tw))
            tw = now
    cuda_sync()
    total = steps * batch / (time.perf_counter() - t0)
    for s in slots:
        eng.free_slot(s)
    return total, per_window


def decode_routing(model, off, args, seed: int) -> np.ndarray:
    """[L, E] routing shares of the decode steps decode_run(seed) makes, counted by an eager engine."""
    eng = Engine(model, None, max_batch=args.max_batch, max_context=args.max_context, eager=True)
    snap = {}

    def mark(i):
        if i == 0:  # after the prompts' prefill: count the decode steps only
            snap["before"] = np.stack([layer.stats.routed.copy() for layer in off.layers])

    decode_run(eng, args.max_batch, args.prompt, args.steps, model.cfg.vocab_size, seed=seed, on_step=mark)
    counts = np.stack([layer.stats.routed for layer in off.layers]) - snap["before"]
    return counts / float(args.steps * args.max_batch)


def measure_prefill(eng, tokens: int, vocab: int, seed: int, repeats: int = 3) -> float:
    """Best of `repeats` prefills of a `tokens`-token random prompt into a fresh slot (tokens/s)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens,), generator=g).tolist()
    best = 0.0
    for _ in range(repeats):
        s = eng.allocate_slot()
        t0 = time.perf_counter()
        eng.prefill(s, ids)  # synchronises on a GPU
        best = max(best, tokens / (time.perf_counter() - t0))
        eng.free_slot(s)
    return best


def permute_routers(model, seed: int) -> None:
    """Synthetic routing shift: expert e's router row moves to pi(e), so the tokens that chose e now
    choose pi(e), with the same distribution over a different set of experts."""
    g = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        if layer.moe is not None:
            r = layer.moe.router
            perm = torch.randperm(r.shape[0], generator=g).to(r.device)
            with torch.no_grad():
                r.copy_(r[perm].clone())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the demo checkpoint)")
    p.add_argument("--profile", default="ktransformers-paper-amx", help="hardware profile (name or JSON)")
    p.add_argument("--budgets", default="", help="GPU budgets, comma separated (default: three spread between "
                   "the fixed part and all experts resident)")
    p.add_argument("--cpu-budget", default="1TiB")
    p.add_argument("--cpu-dtype", default="bf16", choices=("bf16", "int8", "int4", "mxfp4"))
    p.add_argument("--max-context", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before decoding")
    p.add_argument("--prefill-tokens", type=int, default=0, help="prompt length of the prefill measurement "
                   "(default: max-context - 1)")
    p.add_argument("--steps", type=int, default=64, help="decode steps per measurement (each half of the shift run)")
    p.add_argument("--window", type=int, default=16, help="steps per window in the shift run")
    p.add_argument("--profile-tokens", type=int, default=2048, help="tokens for the routing statistics")
    p.add_argument("--profile-decode", type=int, default=-1,
                   help="greedy tokens decoded after each profiling prompt of --prompt tokens (default: --steps, the "
                        "measured workload's shape; 0: prefill-only statistics from prompts of max-context - 1 tokens)")
    p.add_argument("--reserve", default="1GiB", help="the plan's VRAM reserve (CUDA context etc.)")
    p.add_argument("--device", default="auto")
    p.add_argument("--cpu-isa", help="CPU kernel ISA (default: the best available)")
    p.add_argument("--out", help="directory for plan_eval.json")
    args = p.parse_args(argv)

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if not args.model:
        from hybrid.runtime.demo import demo_checkpoint

        args.model = str(demo_checkpoint())
    hw = pricing_profile(args.profile, note=lambda line: print(f"# note: {line}", flush=True))
    t0 = time.perf_counter()
    model, off = load_hybrid(args.model, device, dtype, HybridConfig(gpu_experts=0, cpu_dtype=args.cpu_dtype,
                                                                     cpu_isa=args.cpu_isa, profile=hw),
                             progress=False)
    cfg = model.cfg
    load_s = time.perf_counter() - t0

    # 1. routing statistics from prefills of random tokens
    eng = Engine(model, None, max_batch=1, max_context=args.max_context, eager=True)
    g = torch.Generator().manual_seed(0)
    n_dec = args.profile_decode if args.profile_decode >= 0 else args.steps
    plen = args.prompt if n_dec else args.max_context - 1
    n_prompts = max(1, args.profile_tokens // (plen + n_dec))
    prompts = [torch.randint(0, cfg.vocab_size, (plen,), generator=g).tolist() for _ in range(n_prompts)]
    layers, counts, tokens, series, dec_counts, dec_tokens = profile(eng, prompts, window=args.max_context,
                                                                     decode_tokens=n_dec)
    stats = RoutingStats(cfg.num_experts, cfg.experts_per_token, tuple(layers), counts, tokens, args.max_context,
                         tuple(series), {"kind": "measured", "prompts": "random token ids",
                                         "decode_tokens_per_prompt": n_dec}, dec_counts, dec_tokens)
    del eng

    mem = MemorySettings(max_context=args.max_context, max_batch=args.max_batch, cpu_dtype=args.cpu_dtype,
                         gpu_dtype_bytes=torch.empty((), dtype=dtype).element_size(), reserve=parse_bytes(args.reserve),
                         node_threads=tuple(len(n) for n in off.layers[0].cpu_moe.topology.nodes))
    cpu_budget = parse_bytes(args.cpu_budget)
    P = min(args.prefill_tokens or args.max_context - 1, args.max_context - 1)
    if args.budgets:
        budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    else:  # a quarter, half and three quarters of the experts' VRAM on top of the fixed part
        b = breakdown(cfg, mem)  # what plan() prices: the fixed VRAM part and one resident expert
        fixed = b.gpu_fixed
        every = cfg.num_moe_layers * cfg.num_experts * b.resident_expert
        budgets = [fixed + every * f // 4 for f in (1, 2, 3)]

    header = (f"# plan_eval | {cpu_name()} ({platform.node()}), GPU {torch.cuda.get_device_name() if cuda else 'none'} | "
              f"{args.model}: {cfg.num_layers} layers, E={cfg.num_experts}, K={cfg.experts_per_token}, D={cfg.hidden_size}, "
              f"F={cfg.expert_intermediate_size} | CPU {off.layers[0].cpu_moe.isa} x "
              f"{sum(mem.node_threads)} threads {args.cpu_dtype} | {dtype} | profile {hw.name} | batch {args.max_batch}, "
              f"context {args.max_context} | load {load_s:.0f} s")
    if not cuda:  # predictions price the profile's GPU; the measurement here is torch on the CPU
        header += (f" | CPU-only: no CUDA device, so predicted vs measured errors are not computed (the predictions "
                   f"assume profile {hw.name}'s GPU figures; the measured 'GPU' side is torch on the CPU)")
    print(header, flush=True)
    results = {"header": header, "device": str(device), "profile": hw.name, "comparable": cuda, "budgets": []}

    # 2. predicted vs measured per budget
    plans = []
    for budget in budgets:
        pl = plan(cfg, stats, hw, PlanSettings(gpu_budget=budget, cpu_budget=cpu_budget, memory=mem, prefill_tokens=P))
        plans.append(pl)
        for layer in off.layers:
            layer.captured = False  # the previous engine's graphs are gone (bench only)
            layer.set_resident(pl.resident_of(layer.layer))
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        eng = Engine(model, None, max_batch=args.max_batch, max_context=args.max_context, eager=not cuda)
        decode_run(eng, args.max_batch, args.prompt, 4, cfg.vocab_size, seed=1)  # warm-up (+ graph capture)
        measured, _ = decode_run(eng, args.max_batch, args.prompt, args.steps, cfg.vocab_size, seed=2)
        prefill = measure_prefill(eng, P, cfg.vocab_size, seed=4)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        graphs = eng.graphs is not None
        del eng
        # The plan predicts from the profiled routing; the measured steps routed their own tokens. The same
        # decode again, eager (which counts routing on the host), prices the plan's placement on the routing
        # the measured steps saw: the cost model's own error, without the statistics' mismatch.
        seen = decode_routing(model, off, args, seed=2)
        res_mask = np.zeros((len(off.layers), cfg.num_experts), dtype=bool)
        for i, layer in enumerate(off.layers):
            res_mask[i, list(pl.resident_of(layer.layer))] = True
        matched = args.max_batch / decode_step_time(cfg, hw, mem, seen, res_mask, args.max_batch)
        row = {"gpu_budget_bytes": budget, "plan_gpu_bytes": pl.gpu_bytes, "peak_allocated_bytes": peak,
               "resident_per_layer": [len(lp.resident_experts) for lp in pl.layers],
               "predicted_decode_tokens_per_s": pl.predicted_decode_tokens_per_s, "measured_decode_tokens_per_s": measured,
               "error": rel_error(measured, pl.predicted_decode_tokens_per_s, cuda), "graphs": graphs,
               "predicted_on_seen_routing_tokens_per_s": matched,
               "error_on_seen_routing": rel_error(measured, matched, cuda),
               "cold_share_profiled": float((stats.decode_shares() * ~res_mask).sum() / stats.decode_shares().sum()),
               "cold_share_seen": float((seen * ~res_mask).sum() / max(seen.sum(), 1e-12)),
               "prefill_tokens": P, "predicted_prefill_tokens_per_s": pl.predicted_prefill_tokens_per_s,
               "measured_prefill_tokens_per_s": prefill,
               "prefill_error": rel_error(prefill, pl.predicted_prefill_tokens_per_s, cuda)}
        results["budgets"].append(row)
        print(f"budget {budget / 2**30:7.2f} GiB | resident {sum(row['resident_per_layer']):5d} | predicted "
              f"{pl.predicted_decode_tokens_per_s:9.1f} tok/s | measured {measured:9.1f} tok/s | error {pct(row['error'])} | "
              f"peak {'-' if peak is None else f'{peak / 2**30:.2f} GiB'} (plan {pl.gpu_bytes / 2**30:.2f} GiB) | prefill "
              f"{P} tok: predicted {pl.predicted_prefill_tokens_per_s:.0f}, measured {prefill:.0f} tok/s "
              f"({pct(row['prefill_error'])})", flush=True)
        print(f"    on the routing the measured steps saw: predicted {matched:.1f} tok/s, error "
              f"{pct(row['error_on_seen_routing'])}; routed to cold experts: {row['cold_share_seen']:.0%} seen, "
              f"{row['cold_share_profiled']:.0%} in the profiled statistics", flush=True)

    # 3. routing shift at the middle budget: static plan vs online re-placement (eager decode)
    mid = plans[len(plans) // 2]
    cpu_shape, gpu_shape = expert_shapes(cfg, mem)
    shift = {}
    router_backup = [l.moe.router.detach().clone() for l in model.layers if l.moe is not None]
    for mode in ("static", "online"):
        for layer in off.layers:
            layer.captured = False
            layer.set_resident(mid.resident_of(layer.layer))
        for l, r in zip([l for l in model.layers if l.moe is not None], router_backup):
            with torch.no_grad():
                l.moe.router.copy_(r)
        off.replacer = (OnlineReplacer(off, cpu_shape, gpu_shape, hw, ReplaceConfig(window=4 * args.window, slices=4))
                        if mode == "online" else None)
        eng = Engine(model, None, max_batch=args.max_batch, max_context=args.max_context, eager=True)
        half = args.steps
        tps, windows = decode_run(eng, args.max_batch, args.prompt, 2 * half, cfg.vocab_size, seed=3, window=args.window,
                                  on_step=lambda i: permute_routers(model, 7) if i == half else None)
        landed = off.replacer.stats.landed if off.replacer is not None else 0
        shift[mode] = {"tokens_per_s": tps, "per_window": windows, "swaps_landed": landed}
        print(f"shift {mode:6s} | {tps:9.1f} tok/s | per window " + " ".join(f"{w:.0f}" for w in windows)
              + f" | swaps {landed}", flush=True)
        del eng
    off.replacer = None
    n_w = len(shift["static"]["per_window"]) // 2
    if n_w:  # a window after the shift for each mode (else: no mean to compare, not NaN)
        after = {m: float(np.mean(shift[m]["per_window"][n_w:])) for m in shift}
        shift["second_half_online_vs_static"] = rel_error(after["online"], after["static"], True)
        print(f"after the shift: online {after['online']:.1f} vs static {after['static']:.1f} tok/s "
              f"({pct(shift['second_half_online_vs_static'], '+.1%')})")
    else:
        shift["second_half_online_vs_static"] = None
        print(f"after the shift: not measured ({2 * args.steps} steps make fewer than 2 windows of {args.window}: "
              "raise --steps or lower --window)")
    results["shift"] = shift
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan_eval.json").write_text(json.dumps(finite(results), indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
