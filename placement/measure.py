"""Probes that measure this machine: DRAM read, CPU expert throughput per backend, link, GPU.

Shared by `hybrid calibrate` (which fits a HardwareProfile) and the benchmarks in bench/. Every probe
warms up, synchronises before reading the clock, repeats and keeps the median.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from placement.cost_model import ExpertShape

log = logging.getLogger("hybrid.measure")


def median_time(fn: Callable[[], object], reps: int = 5, warmup: int = 1, sync: Callable[[], None] | None = None) -> float:
    """Median wall seconds of fn() over `reps` runs."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- DRAM -------------------------------------------------------------------------------------------
def measure_dram_read(nbytes: int = 1 << 30, reps: int = 5) -> tuple[float, str]:
    """Multithreaded DRAM read bandwidth in bytes/s and the method used.

    Prefers the compiled streaming-read probe of cpu_kernels (AVX-512 loads on pinned threads: what the
    CPU expert kernels see); falls back to torch.sum over a buffer far larger than the last-level cache.
    """
    try:
        import cpu_kernels

        probe = getattr(cpu_kernels, "measure_read_bandwidth", None)
        if probe is not None:  # returns decimal GB/s
            return float(probe(nbytes)) * 1e9, f"cpu_kernels stream read, {nbytes / 2**20:.0f} MiB"
    except ImportError:
        pass
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    t = median_time(lambda: buf.sum(), reps=reps)
    return nbytes / t, f"torch.sum over {nbytes / 2**20:.0f} MiB, {torch.get_num_threads()} threads"


# -- experts ------------------------------------------------------------------------------------------
@dataclass
class ExpertWeights:
    """E experts' weights: gate, up [E, F, D]; down [E, D, F] (bf16 unless asked).

    `packed` [E, 3*F*D] holds each expert's three matrices back to back, so shipping an expert is one
    host->device transfer (one alpha, as the cost model prices it); the stacks are views into it.
    """

    packed: torch.Tensor
    hidden: int
    intermediate: int

    @classmethod
    def random(cls, shape: ExpertShape, experts: int, dtype=torch.bfloat16, device="cpu", pin: bool = False,
               seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        d, f = shape.hidden, shape.intermediate
        packed = (torch.randn(experts, 3 * f * d, generator=g, dtype=torch.float32) / d ** 0.5).to(dtype)
        if pin:
            packed = packed.pin_memory()
        if device != "cpu":
            packed = packed.to(device)
        return cls(packed, d, f)

    @property
    def experts(self) -> int:
        return self.packed.shape[0]

    def matrices(self, e: int, packed: torch.Tensor | None = None):
        """(gate [F, D], up [F, D], down [D, F]) of expert e, as views of `packed` (default: ours)."""
        d, f = self.hidden, self.intermediate
        row = (self.packed[e] if packed is None else packed).view(3, f * d)
        return row[0].view(f, d), row[1].view(f, d), row[2].view(d, f)

    def stacks(self):
        """Contiguous copies (w_gate [E, F, D], w_up [E, F, D], w_down [E, D, F]) for CPU kernels."""
        d, f = self.hidden, self.intermediate
        v = self.packed.view(self.experts, 3, f * d)
        return (v[:, 0].reshape(-1, f, d).contiguous(), v[:, 1].reshape(-1, f, d).contiguous(),
                v[:, 2].reshape(-1, d, f).contiguous())


def torch_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for one expert; x [m, D] -> [m, D]."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def cpu_backends() -> list[str]:
    """CPU expert backends present: the compiled kernels' ISAs (best first) and then torch."""
    names = []
    try:
        import cpu_kernels

        names += [isa for isa in cpu_kernels.available_isas() if isa != "ref"]
    except (ImportError, AttributeError, OSError) as exc:  # not built yet, or failed to load: say so
        log.warning("compiled CPU kernels unavailable (%s); measuring torch only", exc)
    return names + ["torch"]


class CpuExpertRunner:
    """Runs `experts` experts, each on m tokens, with one CPU backend: 'torch' or a compiled ISA."""

    def __init__(self, weights: ExpertWeights, backend: str, threads: int | None = None):
        self.w = weights
        self.backend = backend
        self.moe = None
        self.w_gate, self.w_up, self.w_down = weights.stacks()
        if backend != "torch":
            import cpu_kernels

            self.moe = cpu_kernels.CpuMoE(self.w_gate, self.w_up, self.w_down, dtype="bf16",
                                          threads=threads, isa=backend)

    def routing(self, m: int):
        """Each expert gets exactly m tokens (top-1 routing): ids [m*E, 1], weights [m*E, 1]."""
        e = self.w.experts
        ids = torch.arange(e, dtype=torch.int64).repeat_interleave(m).unsqueeze(1)
        return ids, torch.ones(ids.shape, dtype=torch.float32)

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None):
        """x [m*E, D] rows grouped by expert -> [m*E, D]."""
        if self.moe is not None:
            return self.moe.forward(x, ids, weights, out=out)
        m = x.shape[0] // self.w.experts
        out = out if out is not None else torch.empty_like(x)
        for e in range(self.w.experts):
            rows = slice(e * m, (e + 1) * m)
            out[rows] = torch_expert(x[rows], self.w_gate[e], self.w_up[e], self.w_down[e])
        return out


def measure_cpu_curve(shape: ExpertShape, backend: str, ms: list[int], experts: int = 8, reps: int = 3,
                      progress: Callable[[str], None] | None = None) -> list[list[float]]:
    """Effective C_C(m) = 2 m P_e E / t for E experts of m tokens each, as [[m, flop/s], ...].

    At small m this is bandwidth-bound and simply reproduces the measured time through the model's
    max(2mP/C_C, W/B_D); above the knee it is the kernel's compute rate.
    """
    weights = ExpertWeights.random(shape, experts)
    runner = CpuExpertRunner(weights, backend)
    curve = []
    for m in ms:
        x = torch.randn(m * experts, shape.hidden).to(torch.bfloat16)
        ids, w = runner.routing(m)
        out = torch.empty_like(x)
        t = median_time(lambda: runner.run(x, ids, w, out), reps=reps)
        curve.append([float(m), 2.0 * m * shape.params * experts / t])
        if progress:
            progress(f"{backend} m={m}: {curve[-1][1] / 1e12:.3f} TFLOP/s")
    return curve


# -- link and GPU -------------------------------------------------------------------------------------
def fit_transfer(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Fit t = alpha + bytes / B_L by least squares on relative error; returns (alpha, B_L)."""
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    a = np.stack([np.ones_like(s), s], axis=1) / t[:, None]  # weight rows by 1/t: relative residuals
    coef, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    alpha, inv_bw = float(coef[0]), float(coef[1])
    return max(alpha, 0.0), 1.0 / inv_bw


def measure_link(sizes: list[int], device: str = "cuda", reps: int = 10) -> dict:
    """Pinned host<->device copies of each size; returns times and the alpha + bytes/B_L fits."""
    largest = max(sizes)
    host = torch.empty(largest, dtype=torch.uint8).pin_memory()
    dev = torch.empty(largest, dtype=torch.uint8, device=device)
    h2d, d2h = [], []
    for n in sizes:
        h2d.append(median_time(lambda: dev[:n].copy_(host[:n], non_blocking=True), reps=reps, sync=cuda_sync))
        d2h.append(median_time(lambda: host[:n].copy_(dev[:n], non_blocking=True), reps=reps, sync=cuda_sync))
    a_h2d, bw_h2d = fit_transfer(sizes, h2d)
    a_d2h, bw_d2h = fit_transfer(sizes, d2h)
    return {"sizes": sizes, "h2d_s": h2d, "d2h_s": d2h, "h2d_alpha": a_h2d, "h2d_bw": bw_h2d,
            "d2h_alpha": a_d2h, "d2h_bw": bw_d2h}


def measure_hbm(nbytes: int = 2 << 30, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth, counting bytes read plus written."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = median_time(lambda: b.copy_(a), reps=10, warmup=2, sync=cuda_sync)
    return 2 * a.numel() / t


def measure_gpu_flops(shape: ExpertShape, m: int = 8192, experts: int = 8, device: str = "cuda") -> float:
    """bf16 expert throughput on the GPU at a large token count (C_G at expert shapes)."""
    w = ExpertWeights.random(shape, experts, device=device)
    x = torch.randn(m, shape.hidden, device=device, dtype=torch.bfloat16)

    def run():
        for e in range(experts):
            torch_expert(x, *w.matrices(e))

    t = median_time(run, reps=5, warmup=2, sync=cuda_sync)
    return 2.0 * m * shape.params * experts / t
