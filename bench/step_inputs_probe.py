"""A captured decode step's inputs on the GPU: three copies from a fresh pageable tensor (the way before StepInputs)
against StepInputs.write (one asynchronous copy from page-locked rows), host time per step (diagnostic).

    python -m bench.step_inputs_probe [--batch 1,8] [--iters 2000] [--out FILE.json]

Each figure is the median, over 5 rounds of --iters steps, of the host time from the step's Python lists to the
copies being queued, plus the wait for the stream (a synchronize), as a decode step pays it before its graph can
replay; the stream is idle between steps, as it is between two steps of Engine.decode_step. Both ways run
interleaved in each round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hybrid.runtime.cuda_graphs import StepInputs


def pageable(dst: torch.Tensor, ids, positions, slots) -> None:
    """The way before StepInputs: one pageable [3, b] tensor, three copies into separate static inputs."""
    b = dst.shape[1]
    pad = b - len(ids)
    host = torch.tensor([ids + [0] * pad, positions + [-1] * pad, slots + [0] * pad], dtype=torch.long)
    dst[0].view(b, 1).copy_(host[0, :, None])
    dst[1].view(b, 1).copy_(host[1, :, None])
    dst[2].copy_(host[2])


def time_us(fn, iters: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8", help="rows per step, comma-separated (default 1,8)")
    p.add_argument("--iters", type=int, default=2000, help="steps per round (default 2000)")
    p.add_argument("--out", help="write the medians here as JSON")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA (run on the GPU box)")
    rows = {}
    for b in (int(x) for x in a.batch.split(",")):
        dst = torch.zeros(3, b, dtype=torch.long, device="cuda")
        st = StepInputs(b)
        ids, pos, slots = list(range(b)), [100] * b, list(range(b))
        ways = {"pageable, 3 copies": lambda: pageable(dst, ids, pos, slots),
                "StepInputs, 1 pinned copy": lambda: st.write(dst, ids, pos, slots)}
        runs = {k: [] for k in ways}
        for _ in range(5):
            for k, fn in ways.items():
                runs[k].append(time_us(fn, a.iters))
        for k, v in runs.items():
            rows[f"b{b} {k}"] = statistics.median(v)
            print(f"batch {b:3d}  {k:28s} {statistics.median(v):7.2f} us per step (rounds {min(v):.2f}-{max(v):.2f})")
        assert dst.tolist() == [ids, pos, slots]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
