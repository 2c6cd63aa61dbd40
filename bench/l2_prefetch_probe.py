"""Does warming L2 with a layer's attention weights, while the GPU waits for the CPU lane, shorten that layer's
q/k/v and o_proj projections? (diagnostic; issue 12 run 17: no, so decode does not do it)

    python -m bench.l2_prefetch_probe [--batch 1,8] [--layers 24] [--wait-us 60] [--rounds 5] [--out FILE.json]

A CUDA graph of --layers "layers" with their own weights (the Qwen3-30B shape's fused q/k/v [5120, 2048] and
o_proj [2048, 4096], bf16; 24 layers are ~0.9 GB, far past L2, so nothing is warm by accident). Each layer: a
GPU sleep of --wait-us standing in for the CPU lane's wait, then the two projections as decode runs them
(hybrid.models.layers.decode_linear). Ways:
- cold: as decode runs;
- touch / touch evict_last: a side stream forked before the sleep reads the layer's two weights once
  (l2_touch below), joined before the first projection;
- hot: the two projections twice in a row, the second pass's time reported (its weights were just read: the
  most L2 can give);
- sleep only: the sleeps alone, the baseline the others are measured from.
Per layer: (graph time - sleep-only graph time) / layers, the medians of --rounds rounds of 20 replays each, the
ways interleaved in each round. The L2 size is read off the device.

The touch kernel (l2_touch) reads a tensor's bytes once with 16-byte loads, folding each block into an xor that it
stores only if it equals a fixed value (data-dependent, so the compiler keeps the loads; nothing is written in
practice). tests/test_l2_touch.py checks over ragged sizes that every word is read and the input left as it was.

What it found on the GPU box (bench/results/h200/decode/run17/call2-3, H200 with 60 MiB of L2, 36 MiB of weights
per layer): batch 1 cold 13.48-13.51 us per layer, touched 13.51-13.53, and even "hot" (weights read just
before) only 12.74: these projections are bound by latency and launch, not by HBM bandwidth, so L2 can give them
at most ~0.7 us per layer and the touch gave nothing measurable (batch 8: 20.33 cold, 20.34 touched).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from hybrid.models.layers import decode_linear

QKV, O = (5120, 2048), (2048, 4096)
BLOCK = 4096  # int32 words (16 KiB) per program: 8 16-byte loads per thread at 4 warps
_SINK: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _l2_touch(p, n, sink, BLOCK: tl.constexpr, POLICY: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(p + off, mask=off < n, other=0, eviction_policy=POLICY)
    s = tl.xor_sum(v, axis=0)  # xor, not a sum: no overflow (the interpreter checks int32 ranges)
    if s == 0x5A5A5A5A:  # data-dependent: keeps the loads; practically never true, harmless when it is
        tl.store(sink, s)


def _sink(device: torch.device) -> torch.Tensor:
    s = _SINK.get(device)
    if s is None:  # made by the first (eager) call, before any capture
        s = _SINK[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return s


def words(t: torch.Tensor) -> torch.Tensor | None:
    """t's bytes as int32 words (a view), or None when they cannot be viewed so (not contiguous, odd size)."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 4 or t.data_ptr() % 16:
        return None
    return t.reshape(-1).view(torch.int32)


def l2_touch(t: torch.Tensor, policy: str = "") -> bool:
    """Reads every byte of t once on the current stream; -> False (and does nothing) where t cannot be read as
    aligned int32 words."""
    w = words(t)
    if w is None or w.numel() == 0:
        return False
    n = w.numel()
    _l2_touch[(triton.cdiv(n, BLOCK),)](w, n, _sink(t.device), BLOCK=BLOCK, POLICY=policy, num_warps=4)
    return True


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
