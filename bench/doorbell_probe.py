"""What each way of handing a captured layer's job to the CPU lane costs on the GPU (diagnostic).

    python -m bench.doorbell_probe [--layers 16] [--reps 200] [--out FILE.json]

A CUDA graph of `layers` "layers", each a producer kernel (writes a decode-sized 4 KB input block) and a
consumer kernel (reads a 4 KB output block), with a hand-off between them to a real doorbell lane thread
(hybrid.offload.doorbell) answering ids no job is registered for (so the CPU side is the lane's own poll,
not the experts). Variants, per layer:

- base:     producer -> consumer, device memory, no lane (the launch gap of two dependent kernels);
- memop3:   blocks in mapped page-locked memory; write doorbell, wait done, re-arm done (stream memory
            operations, what captured decode did until now);
- memop2:   the same without the re-arm (the lane thread re-arms the previous id);
- kring:    the producer kernel rings the doorbell itself (system-scope store), then the wait memop;
- kspin:    the producer rings, the consumer kernel spins on the done word itself (no memory operation);
- side3:    memop3 on a side stream forked from and joined to the main one, as HostFnLane does.

Each figure is the median graph replay divided by `layers` (nothing subtracted): compare the variants with each
other and with `base`. Box run 9 (bench/results/h200/decode/run9/call1/): 2.1, 10.6, 8.9, 8.3, 9.1, 10.5 us.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl

from hybrid.offload import doorbell

N = 2048  # bf16 elements: one decode row of the 30B width (4 KB)


@triton.jit
def _ring_sys(ptr, val):
    """System-scope release store of val to ptr (page-locked host memory): earlier writes are visible first."""
    tl.inline_asm_elementwise("fence.sc.sys;\n\tst.release.sys.global.u32 [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,r", [ptr + tl.zeros([1], tl.int32), tl.zeros([1], tl.int32) + val],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_acquire_sys(ptr):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.u32 $0, [$1];", "=r,l",
                                     [ptr + tl.zeros([1], tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _produce(src, dst, bell, jid, n, RING: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    v = tl.load(src + o)  # BLOCK == n
    tl.store(dst + o, v + 1)
    if RING:
        tl.debug_barrier()
        _ring_sys(bell, jid)


@triton.jit
def _consume(src, dst, done, n, SPIN: tl.constexpr, BLOCK: tl.constexpr):
    if SPIN:
        f = tl.max(_load_acquire_sys(done), axis=0)
        while f != 1:
            f = tl.max(_load_acquire_sys(done), axis=0)
    o = tl.arange(0, BLOCK)
    v = tl.load(src + o)  # BLOCK == n; ordered after the acquire above
    tl.store(dst + o, v)


def build(variant: str, layers: int, lane, dev):
    side = torch.cuda.Stream(dev)
    host_in = torch.zeros(N, dtype=torch.bfloat16, pin_memory=True)
    host_out = torch.zeros(N, dtype=torch.bfloat16, pin_memory=True)
    d_in, d_out = torch.zeros(N, dtype=torch.bfloat16, device=dev), torch.zeros(N, dtype=torch.bfloat16, device=dev)
    mapped = variant != "base"
    a_in = doorbell.mapped_alias(host_in, dev) if mapped else d_in
    a_out = doorbell.mapped_alias(host_out, dev) if mapped else d_out
    words = lane._words
    bell_dev = doorbell.mapped_alias(words, dev)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(dev)
    kr, ks = variant in ("kring", "kspin"), variant == "kspin"

    def one(i):
        jid = 100 + (i % layers)  # distinct ids, unregistered: the lane answers without running anything
        cur = torch.cuda.current_stream()
        _produce[(1,)](d_out, a_in, bell_dev, jid, N, RING=kr, BLOCK=N)
        if variant == "side3":
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                lane.ring(side, jid, rearm=True)
            cur.wait_stream(side)
        elif variant in ("memop3", "memop2"):
            lane.ring(cur, jid, rearm=variant == "memop3")
        elif variant == "kring":
            lane.wait_done(cur, jid, rearm=False)
        _consume[(1,)](a_out, d_out, bell_dev[jid + 1:], N, SPIN=ks, BLOCK=N)

    with torch.cuda.stream(s):
        for i in range(layers):  # compile outside the capture
            one(i)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for i in range(layers):
                one(i)
    return g, (host_in, host_out, d_in, d_out, a_in, a_out, bell_dev, side, s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--variants", default="base,memop3,memop2,kring,kspin,side3")
    p.add_argument("--isa", default=None, help="the lane's cpu_kernels ISA (default: the best compiled)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("doorbell_probe needs CUDA")
    import cpu_kernels

    dev = torch.device("cuda", 0)
    isa = cpu_kernels._native.resolve_isa(a.isa)
    cpu_kernels._native.tune(isa, "spin_us", 2000)
    lane = doorbell.DoorbellLane(isa, 0, dev)
    res = {}
    try:
        for v in a.variants.split(","):
            g, keep = build(v, a.layers, lane, dev)
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
            ts = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                g.replay()
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            res[v] = statistics.median(ts) / a.layers * 1e6
            print(f"{v:>8}: {res[v]:7.2f} us per layer (median of {a.reps} replays of {a.layers} layers)", flush=True)
            del g, keep
    finally:
        torch.cuda.synchronize()
        lane.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"us_per_layer": res, "layers": a.layers, "isa": isa}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
