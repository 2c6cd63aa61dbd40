"""Crossover sweep by tokens per expert: measured T_C and T_G beside the cost model's predictions.

T_C (ship activations): gather the expert's rows on the GPU, copy them device->host into a pinned
buffer, run the experts with a CPU backend, copy the outputs back; synchronised end to end.
T_G (ship weights): copy each expert's weights host->device from pinned memory, run it on the GPU.
E experts run back to back in both (times add, as in DESIGN section 3's worked example).
Without CUDA only T_C is measured (no transfers) and the output says so.

A prediction is only a prediction for a shape the profile's CPU curves were not calibrated on: each
result says whether its shape is the calibration's ("in-sample") or not ("hold-out").
`hybrid bench crossover` runs one shape; `python -m bench.crossover` sweeps several with one profile.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import torch

from placement import cost_model as cm
from placement import measure
from placement.calibrate import FULL_M, cpu_name
from placement.cost_model import ExpertShape
from placement.hardware import HardwareProfile

DEFAULT_SWEEP = FULL_M


class CrossoverRig:
    """Buffers and runners for one expert shape; `t_cpu(m)` and `t_gpu(m)` measure one point."""

    def __init__(self, shape: ExpertShape, experts: int, backend: str, max_m: int, reps: int = 3):
        self.shape, self.experts, self.reps = shape, experts, reps
        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.weights = measure.ExpertWeights.random(shape, experts, pin=self.cuda)  # host copy (pinned)
        self.runner = measure.CpuExpertRunner(self.weights, backend)
        rows = max_m * experts
        g = torch.Generator().manual_seed(1)
        # Tokens live on the GPU; twice the rows the largest point needs, so the gather is a real gather.
        self.x_all = torch.randn(2 * rows, shape.hidden, generator=g).to(torch.bfloat16).to(self.device)
        self.perm = torch.randperm(2 * rows, generator=g).to(self.device)
        pin = self.cuda
        self.host_x = torch.empty(rows, shape.hidden, dtype=torch.bfloat16, pin_memory=pin)
        self.host_out = torch.empty(rows, shape.hidden, dtype=torch.bfloat16, pin_memory=pin)
        self.out_dev = torch.empty(rows, shape.hidden, dtype=torch.bfloat16, device=self.device)
        if self.cuda:  # one staging slot: an expert's three matrices, shipped in one transfer
            self.stage = torch.empty(self.weights.packed.shape[1], dtype=torch.bfloat16, device="cuda")

    def t_cpu(self, m: int) -> float:
        n = m * self.experts
        idx = self.perm[:n]
        ids, w = self.runner.routing(m)
        hx, ho = self.host_x[:n], self.host_out[:n]

        def step():
            x = self.x_all.index_select(0, idx)  # [n, D] gather on the GPU
            hx.copy_(x, non_blocking=True)
            if self.cuda:
                torch.cuda.current_stream().synchronize()  # rows must be on the host before the CPU reads
            self.runner.run(hx, ids, w, ho)
            self.out_dev[:n].copy_(ho, non_blocking=True)

        return measure.median_time(step, reps=self.reps, sync=measure.cuda_sync)

    def t_gpu(self, m: int) -> float:
        x = self.x_all[: m * self.experts]
        wt = self.weights

        def step():
            for e in range(self.experts):
                self.stage.copy_(wt.packed[e], non_blocking=True)
                rows = slice(e * m, (e + 1) * m)
                self.out_dev[rows] = measure.torch_expert(x[rows], *wt.matrices(e, self.stage))

        return measure.median_time(step, reps=self.reps, sync=measure.cuda_sync)


def refine_crossover(rig: CrossoverRig, lo: int, hi: int, points: dict) -> int:
    """Bisect between lo (CPU path faster) and hi (GPU path faster) down to ~2% of m; returns hi."""
    while hi - lo > max(1, int(0.02 * lo)):
        mid = (lo + hi) // 2
        tc, tg = rig.t_cpu(mid), rig.t_gpu(mid)
        points[mid] = (tc, tg)
        if tg < tc:
            hi = mid
        else:
            lo = mid
    return hi


PREDICTION_KIND = {True: "hold-out", False: "in-sample", None: "unknown"}  # by calibration_match's holdout


def calibration_match(profile: HardwareProfile | None, shape: ExpertShape) -> dict:
    """Was the profile calibrated on this shape? holdout None = the profile does not say (built-ins)."""
    machine = (profile.machine or {}) if profile is not None else {}
    cal = machine.get("shape")
    dims = (machine.get("hidden"), machine.get("intermediate"))
    if cal is None and dims == (None, None):
        return {"calibrated_shape": None, "holdout": None}
    same = cal == shape.name or dims == (shape.hidden, shape.intermediate)
    return {"calibrated_shape": cal, "holdout": not same}


def run_sweep(shape: ExpertShape, profile: HardwareProfile | None, experts: int = 8, sweep=None,
              backend: str | None = None, reps: int = 3, refine: bool = True, log=print) -> dict:
    sweep = sorted(sweep or DEFAULT_SWEEP)
    backend = backend or measure.cpu_backends()[0]
    rig = CrossoverRig(shape, experts, backend, max(sweep), reps=reps)
    gpu_name = torch.cuda.get_device_name() if rig.cuda else None
    log(f"# crossover sweep | machine: {cpu_name()} ({platform.node()}), GPU: {gpu_name or 'none'}")
    log(f"# CPU backend {backend}, {torch.get_num_threads()} threads, bf16 | shape {shape.name}: "
        f"D={shape.hidden} F={shape.intermediate} P_e={shape.params:,} W_e={shape.weight_bytes / 2**20:.1f} MiB; "
        f"{experts} experts back to back")
    if not rig.cuda:
        log("# no CUDA device: measuring T_C only (no transfers: the 'GPU' tensors live on the CPU)")
    points: dict[int, tuple] = {}
    for m in sweep:
        tc = rig.t_cpu(m)
        tg = rig.t_gpu(m) if rig.cuda else None
        points[m] = (tc, tg)
        log(f"  m={m:5d}  T_C {tc * 1e3:9.3f} ms" + (f"  T_G {tg * 1e3:9.3f} ms" if tg is not None else ""))
    measured_cross = None
    if rig.cuda:
        wins = [m for m in sweep if points[m][1] < points[m][0]]
        if wins:
            first = wins[0]
            below = [m for m in sweep if m < first]
            measured_cross = refine_crossover(rig, below[-1], first, points) if (refine and below) else first
    kernel = backend if profile is not None and backend in profile.cpu_flops else None
    ms = sorted(points)
    result = {
        "machine": {"cpu": cpu_name(), "host": platform.node(), "gpu": gpu_name, "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "shape": {"name": shape.name, "hidden": shape.hidden, "intermediate": shape.intermediate,
                  "params": shape.params, "weight_bytes": shape.weight_bytes},
        "dtype": "bf16", "experts": experts, "cpu_backend": backend,
        "tokens": ms,
        "measured_t_cpu_ms": [points[m][0] * 1e3 for m in ms],
        "measured_t_gpu_ms": [points[m][1] * 1e3 if points[m][1] is not None else None for m in ms],
        "measured_crossover_tokens": measured_cross,
        "profile": profile.name if profile else None,
        **calibration_match(profile, shape),
    }
    if profile is not None and profile.has_gpu:
        result["predicted_t_cpu_ms"] = list(cm.t_cpu(shape, profile, ms, kernel) * experts * 1e3)
        result["predicted_t_gpu_ms"] = list(cm.t_gpu(shape, profile, ms) * experts * 1e3)
        pred = cm.crossover_tokens(shape, profile, kernel)
        result["predicted_crossover_tokens"] = pred
        result["predicted_knee_tokens"] = cm.knee_tokens(shape, profile, kernel)
        if pred and measured_cross:
            result["crossover_ratio_measured_over_predicted"] = measured_cross / pred
        for lane in ("cpu", "gpu"):
            meas = np.array([v if v is not None else np.nan for v in result[f"measured_t_{lane}_ms"]])
            err = np.abs(np.array(result[f"predicted_t_{lane}_ms"]) - meas) / meas
            if np.isfinite(err).any():
                result[f"t_{lane}_relative_error_median"] = float(np.nanmedian(err))
                result[f"t_{lane}_relative_error_max"] = float(np.nanmax(err))
    return result


def print_table(res: dict, log=print) -> None:
    pred = "predicted_t_cpu_ms" in res
    kind = PREDICTION_KIND[res.get("holdout")]
    log(f"# prediction: {kind} (profile calibrated on {res.get('calibrated_shape') or 'an unrecorded shape'}, "
        f"swept {res['shape']['name']})")
    log(f"{'m':>6} {'T_C meas ms':>12} {'T_C pred ms':>12} {'T_G meas ms':>12} {'T_G pred ms':>12}  winner")
    for i, m in enumerate(res["tokens"]):
        tc, tg = res["measured_t_cpu_ms"][i], res["measured_t_gpu_ms"][i]
        pc = f"{res['predicted_t_cpu_ms'][i]:12.3f}" if pred else f"{'-':>12}"
        pg = f"{res['predicted_t_gpu_ms'][i]:12.3f}" if pred else f"{'-':>12}"
        win = "-" if tg is None else ("GPU" if tg < tc else "CPU")
        log(f"{m:>6} {tc:12.3f} {pc} {tg if tg is not None else float('nan'):12.3f} {pg}  {win}")
    log(f"measured crossover: {res['measured_crossover_tokens']}; predicted: {res.get('predicted_crossover_tokens')}; "
        f"ratio measured/predicted: {res.get('crossover_ratio_measured_over_predicted')}")
    for lane in ("cpu", "gpu"):
        if f"t_{lane}_relative_error_median" in res:
            log(f"T_{lane[0].upper()} predicted vs measured: median error {res[f't_{lane}_relative_error_median']:.1%}, "
                f"max {res[f't_{lane}_relative_error_max']:.1%}")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    m = np.array(res["tokens"])
    ax.plot(m, res["measured_t_cpu_ms"], "o-", color="tab:blue", label="T_C measured (ship activations, CPU)")
    if res["measured_t_gpu_ms"][0] is not None:
        ax.plot(m, res["measured_t_gpu_ms"], "s-", color="tab:red", label="T_G measured (ship weights, GPU)")
    if "predicted_t_cpu_ms" in res:
        ax.plot(m, res["predicted_t_cpu_ms"], "--", color="tab:blue", label="T_C predicted")
        ax.plot(m, res["predicted_t_gpu_ms"], "--", color="tab:red", label="T_G predicted")
    if res.get("measured_crossover_tokens"):
        ax.axvline(res["measured_crossover_tokens"], color="k", lw=1,
                   label=f"measured crossover m={res['measured_crossover_tokens']}")
    if res.get("predicted_crossover_tokens"):
        ax.axvline(res["predicted_crossover_tokens"], color="k", ls=":", lw=1,
                   label=f"predicted crossover m={res['predicted_crossover_tokens']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per expert (m)")
    ax.set_ylabel(f"time for {res['experts']} experts (ms)")
    ax.set_title(f"{res['shape']['name']} expert, CPU {res['cpu_backend']}, GPU {res['machine']['gpu'] or 'none'}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(res: dict, out_dir: Path, tag: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / f"crossover_{tag}.json"
    js.write_text(json.dumps(res, indent=2) + "\n")
    png = out_dir / f"crossover_{tag}.png"
    plot(res, png)
    return [js, png]
