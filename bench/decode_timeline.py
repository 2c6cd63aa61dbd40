"""Where a captured decode layer's fixed cost goes: the GPU kernels of one graph replay, per layer.

    python -m bench.decode_timeline [--layers 2,8] [--resident none] [--batch 8] [--out FILE.json]

The model is hybrid.offload.overheads' floor model (the 30B width, small experts, CUDA graphs), at batch 1 or
--batch rows (each its own prompt; at 8 rows the layer's CPU lane reads most of its 16 small experts).
Figures:
- the floor as a slope: decode step time at two layer counts, (t_long - t_short) / (layers difference), the
  cost one more layer adds, apart from the step's own fixed part (embedding, head, sampling, graph launch,
  host sync), which `measure_graph_layer_floor` divides among the layers;
- with --intermediate 64,128: that slope at two expert widths, extrapolated to zero expert bytes (at the 30B
  width even 64-wide experts are most of a megabyte each). Read it with care: on a host with a large L3 part of
  the floor model's experts sits in it, so the extra width's cost varies from run to run; the slope at 64 alone
  is an upper bound of the fixed cost;
- torch.profiler over replays of the longer model: per kernel, launches and GPU microseconds per layer; the
  slope minus the kernels' busy time is what no kernel covers (launch gaps, the CPU lane's round trip);
- the CPU executor's own clock over the same profiled steps (the host lane jobs' busy time, per layer): the GPU's
  idle time minus it is the hand-off (doorbell and wait, the lane thread, the pool's wake-up and the output's
  trip back) plus launch gaps, which neither a GPU kernel nor the executor covers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from hybrid.offload.overheads import floor_engine, time_decode_steps


def kernel_table(eng, slots, layers: int, steps: int = 5) -> dict:
    """Kernels of `steps` profiled decode steps: {name: (launches per layer, us per launch)}, and the busy
    (kernel) microseconds per layer. (A step's span from the trace is not reported: a trace splits steps at
    host-sync gaps, which miscounts them, and the slope above measures the same thing without a profiler.)"""
    from torch.profiler import ProfilerActivity, profile

    time_decode_steps(eng, slots, 2)
    off = offload_of(eng)
    busy0 = off.cpu_lane_busy_s() if off is not None else 0.0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_decode_steps(eng, slots, steps)  # 3 warm-up steps + steps, all profiled
    total = steps + 3
    lane_busy = (off.cpu_lane_busy_s() - busy0) * 1e6 / (total * layers) if off is not None else 0.0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = defaultdict(list)
    for e in kernels:
        per[e.name].append(e.time_range.elapsed_us())
    table = {name: (len(ts) / (total * layers), statistics.median(ts)) for name, ts in per.items()}
    busy = sum(sum(ts) for ts in per.values()) / (total * layers)
    return {"kernels": table, "busy_us_per_layer": busy, "gaps": gap_table(kernels, total * layers),
            "cpu_lane_busy_us_per_layer": lane_busy}


def offload_of(eng):
    """The Offload of an engine's hybrid MoE layers (None without one)."""
    for layer in eng.model.layers:
        experts = getattr(getattr(layer, "moe", None), "experts", None)
        if getattr(experts, "offload", None) is not None:
            return experts.offload
    return None


def _short(name: str) -> str:
    """A kernel's bare name: `void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)` ->
    `CatArrayBatchedCopy` (the namespace is dropped first: its parenthesis would cut the name off)."""
    name = name.replace("(anonymous namespace)::", "").replace("void ", "")
    return name.split("(")[0].split("<")[0].split("::")[-1][:40]


def gap_table(kernels, per: int, step_gap_us: float = 300.0) -> dict:
    """Idle GPU time between consecutive kernels, by (kernel before, kernel after): {"a -> b": (times per
    layer, median us)}. Gaps longer than step_gap_us are a step's host sync, not a layer's, and are left out.
    What sits in a gap: the launch of the next node, stream memory operations (the CPU lane's doorbell and
    wait: the gap after the kernel that writes the lane's inputs is the lane's round trip)."""
    ev = sorted(kernels, key=lambda e: e.time_range.start)
    gaps = defaultdict(list)
    for a, b in zip(ev, ev[1:]):
        g = b.time_range.start - a.time_range.end
        if 0 <= g < step_gap_us:
            gaps[f"{_short(a.name)} -> {_short(b.name)}"].append(g)
    return {k: (len(v) / per, statistics.median(v)) for k, v in gaps.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", default="2,8", help="two layer counts for the slope")
    p.add_argument("--resident", default="none", choices=("none", "half", "all"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=1, help="rows per decode step (default 1)")
    p.add_argument("--intermediate", default="64",
                   help="expert widths of the floor model: one, or two to extrapolate the slope to zero expert bytes "
                        "(noisy where the experts partly fit the host's L3)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_timeline needs CUDA (it profiles captured decode steps)")
    short, long_ = (int(n) for n in a.layers.split(","))
    widths = [int(f) for f in a.intermediate.split(",")]
    slopes, med_all = {}, {}
    built = None
    for f in widths:
        med = {}
        for n in (short, long_):
            eng, slots, _ = floor_engine(a.hidden, layers=n, resident=a.resident, intermediate=f, batch=a.batch)
            med[n] = statistics.median(time_decode_steps(eng, slots, a.steps))
            if f == widths[0] and n == long_:
                built = (eng, slots)  # profiled below
            else:
                del eng, slots
            print(f"# batch {a.batch}, experts {f} wide, {n} layers: decode step {med[n] * 1e6:.1f} us ({med[n] / n * 1e6:.1f} us per "
                  f"layer, the step's fixed part included)", flush=True)
        slopes[f] = (med[long_] - med[short]) / (long_ - short)
        fixed = med[short] - short * slopes[f]
        med_all[f] = med
        print(f"# experts {f} wide: floor per layer (slope {short}->{long_} layers): {slopes[f] * 1e6:.1f} us; per step "
              f"besides the layers: {fixed * 1e6:.1f} us", flush=True)
    zero = None
    if len(widths) == 2:
        # Expert bytes scale with the width and nothing else does: the slope at zero expert bytes.
        fa, fb = widths
        zero = slopes[fa] - (slopes[fb] - slopes[fa]) * fa / (fb - fa)
        print(f"# floor per layer at zero expert bytes (extrapolated from {fa} and {fb} wide): {zero * 1e6:.1f} us; "
              f"{(slopes[fb] - slopes[fa]) * 1e6:.1f} us per layer for the {fb - fa} more", flush=True)
    tab = kernel_table(*built, long_)
    print(f"# profiled {long_}-layer steps: kernels busy {tab['busy_us_per_layer']:.1f} us per layer (the rest of the "
          f"slope: launch gaps and the CPU lane's round trip)")
    print(f"{'launches/layer':>14} {'us each':>8} {'us/layer':>9}  kernel")
    rows = sorted(tab["kernels"].items(), key=lambda kv: -kv[1][0] * kv[1][1])
    for name, (n, us) in rows:
        print(f"{n:14.2f} {us:8.2f} {n * us:9.2f}  {name[:90]}")
    gaps = sorted(tab["gaps"].items(), key=lambda kv: -kv[1][0] * kv[1][1])
    idle = sum(n * us for n, us in tab["gaps"].values())
    print(f"# idle between kernels: {idle:.1f} us per layer (medians)")
    print(f"# CPU executor busy (its own clock, same steps): {tab['cpu_lane_busy_us_per_layer']:.1f} us per layer; idle minus "
          f"it (hand-off and launch gaps): {idle - tab['cpu_lane_busy_us_per_layer']:.1f} us per layer")
    print(f"{'gaps/layer':>14} {'us each':>8} {'us/layer':>9}  kernel before -> kernel after")
    for name, (n, us) in gaps[:16]:
        print(f"{n:14.2f} {us:8.2f} {n * us:9.2f}  {name}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"step_s": med_all, "slope_s": slopes, "zero_bytes_slope_s": zero, "resident": a.resident,
                       "batch": a.batch, **tab}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
