"""End to end with hybrid MoE layers: prefill and decode tokens/s per strategy, against the roofline.

    python -m bench.hybrid_e2e --profile PROFILE.json --layers 8 --resident 32 --out DIR
    python -m bench.hybrid_e2e --profile PROFILE.json --layers 12 --resident 0 --graphs --strategies cpu \\
        --prefill 128 --decode-batch 1,8 --cpu-dtype int4 --ab tail_split=1/4 --ab-rounds 6   # a knob A/B

A Qwen3-30B-A3B-shaped model (fewer layers when --layers is given) is built in memory with random
weights: attention, router and norms on the GPU; every MoE layer's experts in the CPU executor, of
which --resident per layer (a quarter by default) are uploaded to VRAM, chosen by routing counts of a
calibration prefill (or, with --resident-layers N, every expert of the last N layers: llama.cpp's `-ncmoe`
layout). For each strategy: prefill tokens/s at each prompt length, decode tokens/s at each batch size
(eager: the hybrid layer reads its routing histogram on the host).

Bounds (bench/bounds.py says why no strategy can beat them):
- prefill: per layer, the LP lower bound over every split of its cold experts between the CPU kernel
  and the link (each priced at the profile's rates, no fixed costs, perfect overlap) and the resident
  experts' GPU compute, from the prompt's own routing; summed over layers. The old "PCIe bound" (every
  touched cold expert over the link) is kept as `prefill_N_all_ship_link_tok_s`: `cost` can beat it by
  running experts on the CPU, so it is no bound.
- decode: each step feeds every row its own greedy token (routing as in generation, not one token
  repeated); with graphs the steps are queued one ahead as greedy generation runs them (Engine.decode_queue: the
  next step fed on the device, each step timed by CUDA events from the end of the one before), --decode-sync times
  each alone between host syncs (the measurement before decode-ahead; --ab ahead=0/1 runs both in one process); the distinct cold experts of each step are read once from DRAM and the resident ones from
  HBM (per layer the larger), plus the non-expert weights (lm_head included) from HBM, at the DRAM read
  and HBM bandwidths measured in this run. Distinct experts are counted exactly per step from the
  hybrid layers' routing histograms; captured (graph) steps are re-run eagerly on the same tokens and
  positions to read their routing (`decode_bB_replay_token_agreement` says how often the replay
  predicted the same next tokens, i.e. how faithful that routing is).
- decode's CPU lane (compiled ISA on CUDA): `decode_bB_cpu_lane_ms_per_step` is the time the lane's jobs spent
  computing per step (their own clock), `_cpu_lane_share` its share of the step and `_cpu_lane_GBps` the cold
  experts' bytes over that time: against the DRAM ceiling it says whether the CPU kernel or the rest of the
  step (GPU kernels, the hand-off) is what a step below its roofline lost.
- repeated routing: `decode_bB_cold_reused_from_last_step` is the share of a step's cold experts that the step
  before read too. Those reads may come from the CPU's last-level cache (random-weight models repeat their
  routing far more than trained ones), so the DRAM-only roofline can be beaten; `_llc_roofline_tok_s` is the
  bound with them served free as far as the LLC holds them (bench.bounds.llc_adjusted), `_of_llc_roofline`
  the step's share of it.
- tokens per expert: `decode_bB_cold_tokens_per_expert` splits a step's cold expert reads by the tokens routed to
  each (1, 2, 3-4, 5-8, 9+; bench.bounds.tokens_per_cold_expert): the CPU kernels' rate per byte falls with it, and
  from a few tokens per expert they are bound by their instructions, not by DRAM.
- the DRAM ceiling moves on a shared host (a VM's neighbours read memory too), so it is measured again right
  after each batch's timed steps: `decode_bB_dram_after_GBps`, and `_of_roofline_after` the step's share of the
  roofline at that ceiling. `_of_roofline` stays against the run's first measurement;
  the two bracket what the host's memory gave while the steps ran.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from cpu_kernels.dtypes import NAMES as CPU_DTYPE_NAMES
from hybrid.models import build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.offload.build import expert_shape, expert_vram_bytes, random_expert_stacks
from hybrid.offload import HybridExperts, Offload
from hybrid.runtime import Engine
from hybrid.runtime.config import RuntimeConfig
from bench.bounds import (decode_step_bound, distinct_per_step, llc_adjusted, reused_per_step, reused_share,
                          split_lower_bound, tokens_per_cold_expert)
from placement.calibrate import cpu_name
from placement.cost_model import cpu_compute_time, gpu_compute_time
from placement.errors import UsageError
from placement.hardware import pricing_profile
from placement.json_file import write_json
from placement.schedule import LayerScheduler


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def check_dram(cfg, args, device, dtype) -> None:
    """Refuse in one line (exit 2) a model this machine's DRAM cannot hold, before minutes of building it ends in
    the OOM killer: the runtime's own estimate (hybrid.loading.dram), at this run's context and batch."""
    from cpu_kernels.bandwidth import default_read_bytes
    from hybrid.loading.dram import DramNeed, check_dram_fits, model_dram

    need = model_dram(cfg, device.type != "cuda", torch.empty((), dtype=dtype).element_size(), args.cpu_dtype,
                      max_context(args), max(args.decode_batch))
    need = DramNeed(need.parts + (("DRAM probe buffer", default_read_bytes()),))  # bench.hybrid_e2e.measure_dram
    check_dram_fits(need, f"{args.preset} x {cfg.num_layers} layers ({args.cpu_dtype} experts)",
                    "use fewer --layers, or --cpu-dtype int8 / int4")


def build(args, hw, device, dtype):
    raw = hf_config(args.preset, layers=args.layers)
    cfg = family_for(raw).parse_config(raw)
    check_dram(cfg, args, device, dtype)
    model = build_empty(cfg, device, dtype, build_experts=False)
    init_random_(model, seed=0)
    shape = expert_shape(cfg, args.cpu_dtype, dtype)
    off = Offload(device, dtype, LayerScheduler(shape, hw, "cost"), cpu_dtype=args.cpu_dtype, cpu_isa=args.isa,
                  threads=args.cpu_threads, defer=args.defer_experts)
    gen = torch.Generator(device=device).manual_seed(1)
    E, F_, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    stacks = None
    for i, layer in enumerate(model.layers):
        if layer.moe is None:
            continue
        # drawn on the GPU (fast), then kept only in the CPU executor; without CUDA one draw serves every layer
        # (each layer still packs its own DRAM copy and has its own router: drawing 600M normals per layer is
        # most of the build on a small CPU box)
        if stacks is None or device.type == "cuda":
            stacks = random_expert_stacks(E, F_, D, gen)
        layer.moe.experts = HybridExperts(i, *stacks, off)
    return model, cfg, shape, off


def snapshot(off) -> np.ndarray:
    return np.array([[l.stats.batches, l.stats.cpu_experts, l.stats.shipped_experts, l.stats.predicted_s,
                      l.stats.decide_s] for l in off.layers]).sum(0)


def describe(delta: np.ndarray, forwards: int) -> dict:
    """Per forward: the scheduler's predicted expert time (all layers) and its split, per layer call."""
    b = max(delta[0], 1)
    return {"predicted_moe_ms_per_forward": 1e3 * delta[3] / forwards, "cpu_experts_per_layer": delta[1] / b,
            "shipped_experts_per_layer": delta[2] / b, "decide_us": 1e6 * delta[4] / b}


def timed(fn, dev) -> float:
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    return time.perf_counter() - t0


def dense_bytes(model) -> int:
    """Weights a decode step reads besides the experts: every parameter but the embedding table (one row
    per token); the hybrid layers' resident experts are plain tensors, not parameters, so not counted."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # untied: the embedding table is only indexed
        total -= model.embed.numel() * model.embed.element_size()
    return total


def measure_dram(off, nbytes: int) -> float:
    """DRAM read bandwidth (B/s) with the executor's own threads over an nbytes buffer."""
    import cpu_kernels

    moe = off.layers[0].cpu_moe
    return cpu_kernels.measure_read_bandwidth(nbytes, isa=moe.isa, topology=moe.topology) * 1e9


def measured_bandwidths(off, hw, device) -> dict:
    """DRAM read with the executor's own threads (cpu_kernels' stream read over a buffer well above the
    LLC) and HBM copy bandwidth, measured now: the decode bound uses these, not the profile's."""
    from cpu_kernels.bandwidth import default_read_bytes, llc_bytes

    nbytes = default_read_bytes()
    dram = measure_dram(off, nbytes)
    if device.type == "cuda":
        from placement.measure import measure_hbm

        hbm = measure_hbm(1 << 30)
    else:
        hbm = hw.hbm_bw  # no GPU: the profile's figure (the bench's numbers mean nothing here anyway)
    return {"dram_bw": dram, "dram_buffer_bytes": nbytes, "llc_bytes": llc_bytes(), "hbm_bw": hbm,
            "hbm_method": "device copy, 1 GiB" if device.type == "cuda" else "profile"}


def prefill_bound(off, shape, gpu_shape, hw, routed_delta) -> float:
    """Seconds no split of the experts can beat for this prompt (bench.bounds), summed over layers."""
    tau = shape.weight_bytes / hw.link_bw
    total = 0.0
    for layer, delta in zip(off.layers, routed_delta):
        cold = ~layer.is_resident
        c = cpu_compute_time(shape, hw, delta[cold])
        g0 = float(gpu_compute_time(gpu_shape, hw, delta[~cold]).sum())
        total += split_lower_bound(c, tau, g0)
    return total


def routed_during(off, fn):
    """Runs fn() -> (its result, per MoE layer the [E] routing counts the hybrid layers added meanwhile)."""
    before = [layer.stats.routed.copy() for layer in off.layers]
    out = fn()
    return out, [layer.stats.routed - b for layer, b in zip(off.layers, before)]


def decode_steps(eng, off, slots, first, steps, device, count: bool, ahead: bool = False):
    """`steps` timed decode steps, each row fed its own greedy next token. -> (seconds per step, tokens
    fed per step, greedy next tokens per step, per-step routing [steps][layers] of [E] if count). ahead: the
    steps queued one ahead as greedy generation runs them (decode_steps_ahead); else each timed alone."""
    if ahead:
        return decode_steps_ahead(eng, off, slots, first, steps, device, count)
    fed, nxt, times, routing = [], [], [], []
    tokens = list(first)
    for _ in range(steps):
        out = {}

        def step():
            return timed(lambda: out.setdefault("logits", eng.decode_step(slots, tokens)), device)

        if count:
            dt, routed = routed_during(off, step)
            routing.append(routed)
        else:
            dt = step()
        times.append(dt)
        fed.append(tokens)
        tokens = out["logits"].argmax(-1).tolist()  # consume before the next step reuses the buffer
        nxt.append(tokens)
    return times, fed, nxt, routing


def decode_steps_ahead(eng, off, slots, first, steps, device, count: bool):
    """decode_steps as `hybrid generate` runs greedy decode (Engine.decode_queue): step i+1 is queued, fed on the
    device, before step i's tokens are read, so the host's work between steps (reading tokens, launching the next
    graph) overlaps the GPU's. A step's time is from the end of the step before (the first: from its queueing) to
    its own end, by CUDA events (the CPU: the host clock); their median is the steady rate of a long generation."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    queue = (lambda toks: routed_during(off, lambda: eng.decode_queue(slots, toks))) if count else \
        (lambda toks: (eng.decode_queue(slots, toks), None))
    q, r = queue(list(first))
    fed, nxt, routing, done = [], [], [], []
    tokens = list(first)
    for i in range(steps):
        nq, nr = queue(None) if i + 1 < steps else (None, None)  # queued before this step's tokens are read
        fed.append(tokens)
        tokens = q.tokens()
        nxt.append(tokens)
        routing.append(r) if count else None
        done.append(q.done if cuda else q.done_s)
        q, r = nq, nr
    if cuda:
        marks = [start] + done
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    else:
        marks = [t0] + done
        times = [b - a for a, b in zip(marks, marks[1:])]
    return times, fed, nxt, routing


def replay_routing(eng, off, slots, lengths, fed, nxt):
    """The routing of captured steps: the same tokens at the same positions, eagerly (which counts it).
    -> (per-step routing, share of steps whose greedy next tokens matched the captured ones)."""
    graphs, eng.graphs = eng.graphs, None
    try:
        for s, n in zip(slots, lengths):
            eng.lengths[s] = n
        routing, agree = [], 0
        for toks, expect in zip(fed, nxt):
            logits, routed = routed_during(off, lambda: eng.decode_step(slots, toks))
            routing.append(routed)
            agree += logits.argmax(-1).tolist() == expect
    finally:
        eng.graphs = graphs
    return routing, agree / max(len(fed), 1)


def decode_ab(eng, off, prompts, knob: str, values: list[int], rounds: int, steps: int, device, cold_bytes: float,
              bound_s: float) -> dict:
    """An in-process A/B of one CPU executor knob at decode: each round runs the same prompts' greedy steps once per
    value, the values forward then backward in turn (A B, B A, ...), so a host whose memory drifts within the
    process moves every value alike, and one build serves every run. Kernels give bit-identical outputs over every
    knob (tests/test_cpu_decode_path.py), so every run reads the same experts: the step's roofline (bound_s) and cold
    bytes are the main measurement's. knob "ahead" (0/1) times the steps host-synchronised one by one (0) or queued
    one ahead as greedy generation runs them (1)."""
    from bench.decode_probe import round_orders
    from cpu_kernels import _native

    isa = off.layers[0].cpu_moe.isa
    tok_s = {v: [] for v in values}
    lane_gbps = {v: [] for v in values}
    for order in round_orders(values, rounds):
        for v in order:
            if knob != AHEAD_AB:
                was = _native.tune(isa, knob, v)
            slots = []
            try:
                slots = [eng.allocate_slot() for _ in prompts]
                first = [int(eng.prefill(s, p).argmax()) for s, p in zip(slots, prompts)]
                first = eng.decode_step(slots, first).argmax(-1).tolist()  # warm-up, as in the main measurement
                busy0 = off.cpu_lane_busy_s()
                ahead = bool(int(v)) if knob == AHEAD_AB else eng.decode_ahead
                times = decode_steps(eng, off, slots, first, steps, device, count=False, ahead=ahead)[0]
                lane_s = (off.cpu_lane_busy_s() - busy0) / steps
            finally:
                for s in slots:
                    eng.free_slot(s)
                if knob != AHEAD_AB:
                    _native.tune(isa, knob, was)
            tok_s[v].append(len(prompts) / statistics.median(times))
            if lane_s > 0:
                lane_gbps[v].append(cold_bytes / lane_s / 1e9)
    med = {v: statistics.median(t) for v, t in tok_s.items()}
    return dict(knob=knob, rounds=rounds, values=values, tok_s={str(v): t for v, t in tok_s.items()},
                median_tok_s={str(v): m for v, m in med.items()},
                of_roofline={str(v): bound_s * m / len(prompts) for v, m in med.items()},
                vs_first={str(v): m / med[values[0]] for v, m in med.items()},
                lane_GBps={str(v): g for v, g in lane_gbps.items() if g})


def trace(step, path: str, repeats: int = 3) -> None:
    """torch.profiler over `repeats` calls of step() (host launches, copies and kernels per stream) as a
    chrome trace, and the top of its table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
    prof.export_chrome_trace(path)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15), flush=True)


def resident_ids(i: int, n_layers: int, counts, resident: int, whole: int | None) -> list[int]:
    """Hybrid layer i's resident experts: its `resident` most-routed ones by `counts` (ties to the lower id), or with
    `whole` (--resident-layers) every expert if i is one of the last `whole` layers, none otherwise."""
    if whole is not None:
        return list(range(len(counts))) if i >= n_layers - whole else []
    return np.argsort(-np.asarray(counts), kind="stable")[:resident].tolist()


def max_context(args) -> int:
    """KV positions per slot: --max-context, else the longest prefill (or calibration prefill) + 64."""
    need = max(max(args.prefill), CPU_ONLY_CALIBRATION if args.reduced else 512) + 64
    given = getattr(args, "max_context", None)
    if given and given < need:
        raise UsageError(f"--max-context {given} is below what the run needs ({need})")
    return given or need


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hw = pricing_profile(args.profile, note=lambda line: print(f"# note: {line}", flush=True))
    from cpu_kernels.knee import set_default_knee

    set_default_knee(hw.machine.get("amx_knee"))  # as the runtime does (hybrid.offload.build)
    t0 = time.perf_counter()
    calib_len = CPU_ONLY_CALIBRATION if args.reduced else 512
    max_ctx = max_context(args)
    model, cfg, shape, off = build(args, hw, device, dtype)
    resident = args.resident if args.resident is not None else cfg.num_experts // 4
    eng = Engine(model, None, config=RuntimeConfig(max_batch=max(args.decode_batch), max_context=max_ctx,
                                                   eager=not args.graphs,
                                                   context_buckets=not getattr(args, "no_context_buckets", False)))
    gen = torch.Generator().manual_seed(2)
    calib = torch.randint(0, cfg.vocab_size, (calib_len,), generator=gen).tolist()
    slot = eng.allocate_slot()
    _, routed = routed_during(off, lambda: eng.prefill(slot, calib))
    whole = getattr(args, "resident_layers", None)  # other benches (deepseek_box, gpt_oss_box) run this without it
    if device.type == "cuda":
        for i, (layer, counts) in enumerate(zip(off.layers, routed)):
            layer.set_resident(resident_ids(i, len(off.layers), counts, resident, whole))
        placed = (f"{resident}/{cfg.num_experts} experts resident per layer" if whole is None else
                  f"every expert of the last {whole} of {len(off.layers)} hybrid layers resident, none elsewhere")
    else:  # resident experts need a GPU: here they would be second copies in DRAM, only costing memory
        resident, whole = 0, None
        placed = "no resident experts (no CUDA device: they would be second copies in DRAM)"
    eng.free_slot(slot)
    mem = off.memory()
    header = (f"# hybrid e2e | {cpu_name()} ({platform.node()}), GPU "
              f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'none'} | {args.preset} x {cfg.num_layers} "
              f"layers, {placed}, CPU {off.layers[0].cpu_moe.isa} x "
              f"{sum(len(n) for n in off.layers[0].cpu_moe.topology.nodes)} threads "
              f"{args.cpu_dtype}, {dtype}, decode {'CUDA graphs' if eng.graphs is not None else 'eager'}"
              f"{', steps queued one ahead' if decode_ahead(eng, args) else ', steps timed one by one'} | profile {hw.name} | build {time.perf_counter() - t0:.0f} s | "
              f"DRAM experts {mem['dram_expert_bytes'] / 2**30:.1f} GiB, "
              + (f"VRAM resident {mem['vram_resident_bytes'] / 2**30:.2f} GiB" if device.type == "cuda" else
                 f"'resident' torch copies {mem['vram_resident_bytes'] / 2**30:.2f} GiB (DRAM; no CUDA device: the "
                 f"'GPU' side is torch on the CPU, the ship lane a copy within DRAM)"))
    if eng.graphs is not None:
        header += f" | max context {max_ctx}, graph context buckets {list(eng.graphs.contexts)}"
    tune = getattr(args, "tune", None) or {}  # other benches (deepseek_box, gpt_oss_box) run this without it
    if tune:
        from cpu_kernels import _native

        isa = off.layers[0].cpu_moe.isa
        was = {k: _native.tune(isa, k, v) for k, v in tune.items()}
        header += " | CPU knobs " + ", ".join(f"{k}={v} (was {was[k]})" for k, v in tune.items())
    if args.defer_experts:
        header += f" | EXPERT DEFERRAL: {args.defer_experts} of each token's experts one layer late (changes the math)"
    if args.reduced:
        header += (" | CPU-only: reduced sizes (" + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in args.reduced.items())
                   + f", calibration prefill {calib_len}; give them to measure more)")
    print(header, flush=True)
    bw = measured_bandwidths(off, hw, device)
    print(f"# measured now: DRAM read {bw['dram_bw'] / 1e9:.1f} GB/s ({bw['dram_buffer_bytes'] / 2**20:.0f} MiB "
          f"buffer, executor threads), HBM {bw['hbm_bw'] / 1e9:.0f} GB/s ({bw['hbm_method']}); "
          f"profile: {hw.dram_bw / 1e9:.1f} / {hw.hbm_bw / 1e9:.0f} GB/s; LLC {bw['llc_bytes'] >> 20} MiB", flush=True)
    gpu_shape = expert_shape(cfg, "bf16", dtype)
    w_gpu = expert_vram_bytes(cfg, dtype)
    dense = dense_bytes(model)
    results = []
    for strat in args.strategies:  # warm-up: first-use allocations (staging, pinned buffers) out of the timings
        off.scheduler = LayerScheduler(shape, hw, strat)
        s = eng.allocate_slot()
        eng.prefill(s, torch.randint(0, cfg.vocab_size, (max(args.prefill),), generator=gen).tolist())
        for _ in range(3):
            eng.decode_step([s], [1])
        eng.free_slot(s)
    for strat in args.strategies:
        off.scheduler = LayerScheduler(shape, hw, strat)
        row = {"strategy": strat}
        for n in args.prefill:
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
            if not args.reduced:  # CPU-only, reduced: the warm-up loop above already ran this strategy at this length
                s = eng.allocate_slot()
                eng.prefill(s, ids[: min(n, 256)])  # warm-up
                eng.free_slot(s)
            s = eng.allocate_slot()
            snap = snapshot(off)
            dt, delta = routed_during(off, lambda: timed(lambda: eng.prefill(s, ids), device))
            eng.free_slot(s)
            runs = [dt]
            for _ in range(getattr(args, "prefill_repeats", 1) - 1):  # the same prompt again: the host's spread within one process
                s = eng.allocate_slot()
                runs.append(timed(lambda: eng.prefill(s, ids), device))
                eng.free_slot(s)
            if len(runs) > 1:
                dt = statistics.median(runs)
                row[f"prefill_{n}_runs_tok_s"] = [round(n / r, 1) for r in runs]
            bound = prefill_bound(off, shape, gpu_shape, hw, delta)
            row[f"prefill_{n}_bound_tok_s"] = n / bound if bound else float("inf")
            row[f"prefill_{n}_of_bound"] = bound / dt
            # the old "PCIe bound": every touched cold expert over the link (beatable: not a bound)
            cold_bytes = sum(int((d > 0)[~layer.is_resident].sum()) * shape.weight_bytes
                             for layer, d in zip(off.layers, delta))
            row[f"prefill_{n}_all_ship_link_tok_s"] = n / (cold_bytes / hw.link_bw) if cold_bytes else float("inf")
            row[f"prefill_{n}_tok_s"] = n / dt
            row[f"prefill_{n}_ms"] = dt * 1e3
            row[f"prefill_{n}_sched"] = describe(snapshot(off) - snap, len(runs))
            if args.trace:  # one prefill: where the time goes beside the link's share

                def prefill_once():
                    s = eng.allocate_slot()
                    eng.prefill(s, ids)
                    eng.free_slot(s)

                trace(prefill_once, f"{args.trace}_{strat.replace(':', '')}_prefill{n}.json", repeats=1)
        for b in args.decode_batch:
            slots = [eng.allocate_slot() for _ in range(b)]
            prompts = [torch.randint(0, cfg.vocab_size, (16,), generator=gen).tolist() for _ in slots]
            first = []
            for s, prompt in zip(slots, prompts):  # each row: its own prompt and its own greedy continuation
                first.append(int(eng.prefill(s, prompt).argmax()))
            first = eng.decode_step(slots, first).argmax(-1).tolist()  # warm-up
            lengths = [eng.lengths[s] for s in slots]
            snap = snapshot(off)
            captured = eng.graphs is not None
            busy0 = off.cpu_lane_busy_s()
            times, fed, nxt, routing = decode_steps(eng, off, slots, first, args.steps, device, count=not captured,
                                                    ahead=decode_ahead(eng, args))
            lane_s = (off.cpu_lane_busy_s() - busy0) / args.steps
            dram_after = measure_dram(off, bw["dram_buffer_bytes"])  # the host's memory right after the steps
            row[f"decode_b{b}_sched"] = describe(snapshot(off) - snap, args.steps)
            if captured:  # captured steps do not count routing on the host: re-run them eagerly
                routing, agree = replay_routing(eng, off, slots, lengths, fed, nxt)
                row[f"decode_b{b}_replay_token_agreement"] = agree
            if args.trace:
                trace(lambda: eng.decode_step(slots, nxt[-1]), f"{args.trace}_{strat.replace(':', '')}_b{b}.json")
            for s in slots:
                eng.free_slot(s)
            step = statistics.median(times)
            by_layer = [([r[i] for r in routing], layer.is_resident) for i, layer in enumerate(off.layers)]
            per_layer = [distinct_per_step(*x) for x in by_layer]
            bound = decode_step_bound(per_layer, shape.weight_bytes, w_gpu, dense, bw["dram_bw"], bw["hbm_bw"])
            row[f"decode_b{b}_tok_s"] = b / step
            row[f"decode_b{b}_ms"] = step * 1e3
            row[f"decode_b{b}_cold_experts_per_layer_step"] = float(np.mean([c for c, _ in per_layer]))
            row[f"decode_b{b}_resident_experts_per_layer_step"] = float(np.mean([r for _, r in per_layer]))
            row[f"decode_b{b}_cold_reused_from_last_step"] = float(np.mean([reused_share(*x) for x in by_layer]))
            row[f"decode_b{b}_cold_tokens_per_expert"] = tokens_per_cold_expert(by_layer)
            reused = [reused_per_step(*x) for x in by_layer]
            llc_bound = decode_step_bound(llc_adjusted(per_layer, reused, shape.weight_bytes, bw["llc_bytes"]),
                                          shape.weight_bytes, w_gpu, dense, bw["dram_bw"], bw["hbm_bw"])
            row[f"decode_b{b}_llc_roofline_tok_s"] = b / llc_bound
            row[f"decode_b{b}_of_llc_roofline"] = llc_bound / step
            row[f"decode_b{b}_roofline_tok_s"] = b / bound
            row[f"decode_b{b}_of_roofline"] = bound / step
            row[f"decode_b{b}_dram_after_GBps"] = dram_after / 1e9
            row[f"decode_b{b}_of_roofline_after"] = decode_step_bound(
                per_layer, shape.weight_bytes, w_gpu, dense, dram_after, bw["hbm_bw"]) / step
            cold = sum(c for c, _ in per_layer) * shape.weight_bytes
            if lane_s > 0:  # the host lane's jobs (doorbell or host functions): their share and read rate
                row[f"decode_b{b}_cpu_lane_ms_per_step"] = lane_s * 1e3
                row[f"decode_b{b}_cpu_lane_share"] = lane_s / step
                row[f"decode_b{b}_cpu_lane_GBps"] = cold / lane_s / 1e9
            ab = getattr(args, "ab", None)  # other benches run this without it
            if ab:
                knob, values = ab
                res = decode_ab(eng, off, prompts, knob, values, args.ab_rounds, args.steps, device, cold, bound)
                row[f"decode_b{b}_ab"] = res
                print(f"# A/B {knob} at batch {b}, {args.ab_rounds} rounds: " + " | ".join(
                    f"{v}: {res['median_tok_s'][str(v)]:.1f} tok/s ({res['vs_first'][str(v)]:.3f}x, "
                    f"{100 * res['of_roofline'][str(v)]:.0f}% of roofline; runs "
                    + ", ".join(f"{t:.1f}" for t in res["tok_s"][str(v)]) + ")" for v in values), flush=True)
        results.append(row)
        print("  " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else
                              f"{k}={','.join(map(str, v))}" if isinstance(v, list) else f"{k}={v}" for k, v in row.items()
                              if not isinstance(v, dict)), flush=True)
        for k, v in row.items():
            if isinstance(v, dict) and not k.endswith("_ab"):  # an A/B printed its own line
                print(f"    {k}: " + " ".join(f"{a}={b:.2f}" for a, b in v.items()), flush=True)
    return {"header": header, "cpu_only_reduced": args.reduced or None, "graphs": eng.graphs is not None,
            "decode_ahead": decode_ahead(eng, args), "preset": args.preset, "layers": cfg.num_layers, "resident": resident if whole is None else None,
            "resident_layers": whole,
            "cpu_isa": off.layers[0].cpu_moe.isa, "profile": hw.name, "memory": mem, "measured": bw,
            "dense_bytes": dense, "results": results}


GPU_DEFAULTS = {"prefill": [2048, 8192], "decode_batch": [1, 8], "steps": 16,
                "strategies": ["cost", "cpu", "ship", "threshold:32"]}
# Without CUDA the "GPU" side is torch on the CPU: an 8192-token prefill per strategy runs for minutes on a
# small box, and ship / threshold only copy weights within DRAM there. Bounded defaults instead.
CPU_ONLY_DEFAULTS = {"prefill": [128], "decode_batch": [1], "steps": 4, "strategies": ["cost", "cpu"]}
CPU_ONLY_CALIBRATION = 128  # tokens of the placement prefill (512 on a GPU)


def apply_defaults(args, cuda: bool) -> None:
    """Fill the sizes not given: the GPU defaults, or without CUDA the reduced ones; args.reduced records
    which reduced values were used ({} when none)."""
    args.reduced = {}
    for key, full in GPU_DEFAULTS.items():
        if getattr(args, key) is None:
            value = full if cuda else CPU_ONLY_DEFAULTS[key]
            setattr(args, key, value)
            if not cuda:
                args.reduced[key] = ",".join(map(str, value)) if isinstance(value, list) else value


def run_isolated(args, argv) -> dict:
    """One child process per strategy; their results merged in order (header, memory from the first)."""
    import subprocess
    import sys
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    merged = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, strat in enumerate(args.strategies):
            out = Path(tmp) / str(i)
            child = [a for a in argv if a != "--isolate"] + ["--strategies", strat, "--out", str(out)]
            subprocess.run([sys.executable, "-m", "bench.hybrid_e2e", *child], check=True)
            res = json.loads((out / f"hybrid_e2e_{args.preset}.json").read_text())
            if merged is None:
                merged = dict(res, isolated=True)
            else:
                merged["results"] += res["results"]
    return merged


def knobs(text: str) -> dict:
    """'pf_rows=16,task_min=1' -> {'pf_rows': 16, 'task_min': 1}, every name a cpu_kernels._native.TUNABLES knob."""
    from cpu_kernels._native import parse_knob

    try:
        return dict(parse_knob(item) for item in filter(None, text.split(",")))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


AHEAD_AB = "ahead"  # --ab ahead=0/1: decode steps timed one by one (0) or queued one ahead (1)


def decode_ahead(eng, args) -> bool:
    """Whether the main decode timings queue steps ahead: as the engine's greedy generation does, unless
    --decode-sync."""
    return eng.decode_ahead and not getattr(args, "decode_sync", False)


def ab_values(text: str) -> tuple[str, list]:
    """'tail_split=1/4' -> ('tail_split', [1, 4]): one cpu_kernels._native.TUNABLES knob (or `ahead`) and two or more
    distinct integer values (the first is the one the others are compared with)."""
    from cpu_kernels._native import parse_knob

    name, sep, vals = text.partition("=")
    try:
        if name == AHEAD_AB:
            values = [int(v) for v in vals.split("/")] if sep else []
            if not set(values) <= {0, 1}:
                raise ValueError(f"--ab {text!r}: ahead takes 0 and 1")
        else:
            values = [parse_knob(f"{name}={v}", "--ab")[1] for v in vals.split("/")] if sep else []
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if len(values) < 2 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"bad --ab {text!r}: KNOB=V1/V2[/V3...], two or more distinct values")
    return name, values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--resident", type=int, help="resident experts per layer (default: a quarter)")
    p.add_argument("--resident-layers", type=int, metavar="N",
                   help="instead of --resident: every expert of the last N hybrid layers in VRAM, none in the others "
                        "(llama.cpp's -ncmoe layout, for a comparison at the same layout as well as the same VRAM)")
    p.add_argument("--defer-experts", type=int, default=0, metavar="N",
                   help="expert deferral (changes the output): each token's N lowest-ranked experts one layer late")
    p.add_argument("--profile", required=True)
    p.add_argument("--cpu-dtype", default="bf16", choices=CPU_DTYPE_NAMES)
    p.add_argument("--isa")
    p.add_argument("--graphs", action="store_true", help="decode in CUDA graphs (every cold expert on the CPU "
                   "lane as a host function; the strategy then only affects prefill)")
    p.add_argument("--cpu-threads", type=int, help="CPU executor threads (default: all cores but one)")
    p.add_argument("--max-context", type=int, help="KV positions per slot (default: the longest prefill + 64); "
                   "graph decode's cache reads grow with it unless graphs are keyed by context bucket")
    p.add_argument("--no-context-buckets", action="store_true",
                   help="decode graphs attend over the whole --max-context (the behaviour before context buckets)")
    p.add_argument("--prefill", type=ints, help="prompt lengths (default 2048,8192; CPU-only 128)")
    p.add_argument("--prefill-repeats", type=int, default=1, metavar="N",
                   help="time each prompt length N times in a row and report the median (the runs too); the "
                        "routing counts and the bound are the first run's (default 1)")
    p.add_argument("--decode-batch", type=ints, help="decode batch sizes (default 1,8; CPU-only 1)")
    p.add_argument("--steps", type=int, help="timed decode steps per batch (default 16; CPU-only 4)")
    p.add_argument("--strategies", type=lambda s: s.split(","),
                   help="schedules to measure (default cost,cpu,ship,threshold:32; CPU-only cost,cpu)")
    p.add_argument("--isolate", action="store_true",
                   help="measure each strategy in a fresh process (same weights and placement): strategies run "
                        "one after another in one process can change each other's timings)")
    p.add_argument("--tune", type=knobs, default={}, metavar="KNOB=V[,KNOB=V]",
                   help="set CPU executor run-time knobs before the timings (cpu_kernels._native.TUNABLES, e.g. "
                        "pf_rows=16): an A/B of a knob end to end, said in the header")
    p.add_argument("--ab", type=ab_values, metavar="KNOB=V1/V2",
                   help="after each decode batch's timings, an in-process A/B of one CPU knob: --ab-rounds rounds of "
                        "the same greedy steps per value, forward then backward in turn (medians, runs, share of the "
                        "same roofline, lane GB/s); one build for every run, and a drifting host moves the values "
                        "alike")
    p.add_argument("--ab-rounds", type=int, default=4, metavar="N", help="rounds of --ab (default 4)")
    p.add_argument("--decode-sync", action="store_true",
                   help="time each decode step alone, host-synchronised before and after (the measurement before "
                        "decode-ahead); by default graph steps are queued one ahead as greedy generation runs them "
                        "(--ab ahead=0/1 compares the two in one process)")
    p.add_argument("--trace", help="also profile one prefill per length and 3 decode steps per batch, per "
                   "strategy: chrome traces TRACE_<strategy>_prefill<n>.json and TRACE_<strategy>_b<batch>.json")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.prefill_repeats < 1:
        p.error("--prefill-repeats must be at least 1")
    if args.ab_rounds < 1:
        p.error("--ab-rounds must be at least 1")
    if args.resident_layers is not None and (args.resident is not None or not 0 <= args.resident_layers <= args.layers):
        p.error("--resident-layers takes 0..--layers and replaces --resident")
    apply_defaults(args, torch.cuda.is_available())
    res = run_isolated(args, argv) if args.isolate and len(args.strategies) > 1 else run(args)
    write_json(Path(args.out) / f"hybrid_e2e_{args.preset}.json", res, indent=1)
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
