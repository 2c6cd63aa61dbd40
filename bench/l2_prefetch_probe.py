"""Does warming L2 with a layer's attention weights, while the GPU waits for the CPU lane, shorten that layer's
q/k/v and o_proj projections? (diagnostic for hybrid.gpu_kernels.prefetch)

    python -m bench.l2_prefetch_probe [--batch 1,8] [--layers 24] [--wait-us 60] [--rounds 5] [--out FILE.json]

A CUDA graph of --layers "layers" with their own weights (the Qwen3-30B shape's fused q/k/v [5120, 2048] and
o_proj [2048, 4096], bf16; 24 layers are ~0.9 GB, far past L2, so nothing is warm by accident). Each layer: a
GPU sleep of --wait-us standing in for the CPU lane's wait, then the two projections as decode runs them
(hybrid.models.layers.decode_linear). Ways:
- cold: as decode ran before the prefetch;
- touch / touch evict_last: a side stream forked before the sleep reads the layer's two weights once
  (gpu_kernels.prefetch.l2_touch), joined before the first projection;
- hot: the two projections twice in a row, the second pass's time reported (its weights were just read: the
  most L2 can give);
- sleep only: the sleeps alone, the baseline the others are measured from.
Per layer: (graph time - sleep-only graph time) / layers, the medians of --rounds rounds of 20 replays each, the
ways interleaved in each round. The L2 size is read off the device.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from hybrid.gpu_kernels.prefetch import l2_touch
from hybrid.models.layers import decode_linear

QKV, O = (5120, 2048), (2048, 4096)


def build(ws, x, wait_cycles: int, way: str):
    """A captured graph of len(ws) layers the given way; -> the graph."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()

    def run():
        for wq, wo in ws:
            if way.startswith("touch"):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    pol = "evict_last" if way.endswith("evict_last") else ""
                    l2_touch(wq, pol)
                    l2_touch(wo, pol)
            torch.cuda._sleep(wait_cycles)
            if way.startswith("touch"):
                main.wait_stream(side)
            for _ in range(2 if way == "hot" else 1 if way != "sleep only" else 0):
                y = decode_linear(x, wq, None)
                decode_linear(y[:, :O[1]].contiguous(), wo, None)

    run()  # compile and warm outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    torch.cuda.synchronize()
    return g


def time_graph(g, reps: int = 20) -> float:
    """Median seconds of one replay over reps."""
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(ts)


def cycles_per_us() -> float:
    """torch.cuda._sleep's clock, measured: cycles per microsecond."""
    n = 2_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    a.record()
    torch.cuda._sleep(n)
    b.record()
    b.synchronize()
    return n / (a.elapsed_time(b) * 1e3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8", help="rows per step, comma-separated (default 1,8)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--wait-us", type=float, default=60.0, help="the stand-in for the CPU lane's wait (default 60)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", help="write the medians here as JSON")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA (run on the GPU box)")
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 0)
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(*QKV, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02,
           torch.randn(*O, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02) for _ in range(a.layers)]
    mb = sum(w.numel() * 2 for w in ws[0]) / 2**20
    wait = int(a.wait_us * cycles_per_us())
    print(f"# {props.name}, L2 {l2 / 2**20:.0f} MiB; {a.layers} layers of {mb:.1f} MiB attention weights; "
          f"wait {a.wait_us:.0f} us per layer", flush=True)
    out = {"l2_bytes": l2, "layer_mib": mb, "wait_us": a.wait_us, "rows": {}}
    ways = ["sleep only", "cold", "touch", "touch evict_last", "hot"]
    for b in (int(v) for v in a.batch.split(",")):
        x = torch.randn(b, QKV[1], device="cuda", dtype=torch.bfloat16, generator=g)
        graphs = {w: build(ws, x, wait, w) for w in ways}
        runs = {w: [] for w in ways}
        for _ in range(a.rounds):
            for w in ways:
                runs[w].append(time_graph(graphs[w]))
        base = statistics.median(runs["sleep only"])
        res = {}
        cold = statistics.median(runs["cold"])
        for w in ways[1:]:
            ref = cold if w == "hot" else base  # hot: its second pass only
            per = [(t - ref) / a.layers * 1e6 for t in runs[w]]
            res[w] = statistics.median(per)
            print(f"batch {b:3d}  {w:18s} q/k/v + o_proj {res[w]:6.2f} us per layer "
                  f"(rounds {min(per):.2f}-{max(per):.2f})", flush=True)
        out["rows"][b] = res
        del graphs
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
