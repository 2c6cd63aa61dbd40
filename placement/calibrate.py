"""Measure this machine and fit a HardwareProfile (the figures of DESIGN section 3)."""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass
from typing import Callable

import torch

from cpu_kernels.dtypes import AMX_DTYPES
from placement import measure
from placement.cost_model import ExpertShape
from placement.hardware import AUTO, HardwareProfile

FULL_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]  # the crossover sweep's range
QUICK_M = [1, 4, 16, 64]
FULL_LINK = [8 << 10, 64 << 10, 512 << 10, 4 << 20, 32 << 20, 256 << 20]  # 8 KiB .. 256 MiB
QUICK_LINK = [8 << 10, 512 << 10, 32 << 20]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


KNEE_DTYPES = AMX_DTYPES  # the dtypes with an AMX path (int4 at its default group size)
GPU_STEPS = 4  # link; HBM + GEMM; the hybrid layer's fixed costs; the graph decode floor


@dataclass(frozen=True)
class RuntimeProbes:
    """The two GPU probes that time the runtime's own hybrid layer (hybrid.offload.overheads): the caller passes
    them in, so that this floor imports nothing from the runtime above it.
    fixed_costs(probe_profile) -> {layer_overhead, cpu_lane_overhead, cpu_lane_start, ship_chunk_overhead,
    ship_expert_overhead, ...}; graph_floor(hidden) -> {graph_layer_floor, ...}."""

    fixed_costs: Callable[[HardwareProfile], dict]
    graph_floor: Callable[[int], dict]


def _has_amx() -> bool:
    try:
        import cpu_kernels
        import cpu_kernels.knee  # noqa: F401 - the knee probe needs it
    except ImportError:
        return False
    return "amx" in cpu_kernels.available_isas()


class Steps:
    """Numbers the top-level progress lines, "step 3/7: ...", from the list of probes known up front (the
    indented detail lines pass through; `m i/n` counts the token counts of a CPU curve)."""

    def __init__(self, total: int, progress: Callable[[str], None]):
        self.total, self.done, self.progress = total, 0, progress

    def __call__(self, line: str) -> None:
        self.done += 1
        self.progress(f"step {self.done}/{self.total}: {line}")

    def detail(self, line: str) -> None:
        self.progress("  " + line)


def _measure_knee(shape: ExpertShape, quick: bool, progress, step=None) -> dict:
    """Tokens per expert from which AMX beats the vector path, per dtype, on this shape ({} without AMX);
    set as CpuMoE's default in this process (cpu_kernels.knee)."""
    if not _has_amx():
        return {}
    from cpu_kernels.knee import measure_amx_knee, set_default_knee

    step = step or progress
    knees = {}
    for dtype in KNEE_DTYPES:
        step(f"AMX knee, {dtype}: 8 experts x m tokens, vector path vs AMX...")
        r = measure_amx_knee(shape.hidden, shape.intermediate, dtype, reps=3 if quick else 5)
        knees[dtype] = r["knee"]
        progress("  " + ", ".join(f"m={m}: {v * 1e3:.2f} / {a * 1e3:.2f} ms" for m, v, a in
                                  zip(r["ms"], r["vector_s"], r["amx_s"])) + f" -> knee {r['knee']}")
    set_default_knee(knees)
    return knees


def calibrate(shape: ExpertShape, quick: bool = False, experts: int = 8, backends: list[str] | None = None,
              dram_bytes: int | None = None, progress: Callable[[str], None] = print,
              probes: RuntimeProbes | None = None) -> tuple[HardwareProfile, dict]:
    """Run every probe; returns the profile and the raw measurements (for the summary and JSON). Without
    `probes` the hybrid layer's fixed costs and the graph floor are left at 0 with a warning, as when they fail."""
    raw: dict = {"shape": shape.name, "hidden": shape.hidden, "intermediate": shape.intermediate,
                 "experts": experts, "threads": torch.get_num_threads()}
    ms = QUICK_M if quick else FULL_M
    # well above the last-level cache even in --quick: a buffer that fits in a large L3 reads faster than DRAM
    from cpu_kernels.bandwidth import default_read_bytes

    dram_bytes = dram_bytes or (default_read_bytes() if quick else max(2 << 30, default_read_bytes()))
    backends = backends or measure.cpu_backends()
    cuda = torch.cuda.is_available()
    step = Steps(1 + (len(KNEE_DTYPES) if _has_amx() else 0) + len(backends) + (GPU_STEPS if cuda else 0), progress)

    step(f"DRAM read bandwidth ({dram_bytes / 2**20:.0f} MiB buffer)...")
    dram_bw, method = measure.measure_dram_read(dram_bytes)
    raw["dram_bw"], raw["dram_method"] = dram_bw, method
    progress(f"  B_D = {dram_bw / 1e9:.1f} GB/s ({method})")

    amx_knee = _measure_knee(shape, quick, progress, step)  # before the curves: the amx curve then uses it

    curves, peaks = {}, {}
    for backend in backends:
        step(f"CPU expert throughput, backend {backend}, m = {ms}...")
        seen = iter(range(1, len(ms) + 1))
        curve = measure.measure_cpu_curve(shape, backend, ms, experts=experts, reps=2 if quick else 3,
                                          progress=lambda s: progress(f"  [m {next(seen, len(ms))}/{len(ms)}] {s}"))
        curves[backend] = curve
        peaks[backend] = max(f for _, f in curve)
    raw["cpu_curves"] = curves

    gpu = {}
    if cuda:
        name = torch.cuda.get_device_name()
        step(f"GPU {name}: pinned host<->device transfers...")
        link = measure.measure_link(QUICK_LINK if quick else FULL_LINK)
        raw["link"] = link
        progress(f"  H2D: alpha {link['h2d_alpha'] * 1e6:.1f} us, B_L {link['h2d_bw'] / 1e9:.1f} GB/s; "
                 f"D2H: alpha {link['d2h_alpha'] * 1e6:.1f} us, {link['d2h_bw'] / 1e9:.1f} GB/s")
        step("HBM copy bandwidth and expert GEMM throughput...")
        hbm = measure.measure_hbm((256 << 20) if quick else (2 << 30))
        c_g = measure.measure_gpu_flops(shape, m=1024 if quick else 8192)
        raw["hbm_bw"], raw["gpu_flops"] = hbm, c_g
        progress(f"  B_H {hbm / 1e9:.0f} GB/s, C_G {c_g / 1e12:.0f} TFLOP/s")
        # Weights travel host->device (ship lane); activations go both ways, so alpha is their mean.
        gpu = dict(gpu_flops=c_g, hbm_bw=hbm, link_bw=link["h2d_bw"],
                   alpha=(link["h2d_alpha"] + link["d2h_alpha"]) / 2)
        raw["gpu"] = name
        step("fixed costs of the hybrid layer (tiny layer: launches, copies, hand-offs)...")
        try:
            probe = HardwareProfile(name="probe", cpu_flops=peaks, dram_bw=dram_bw, **gpu)
            ov = _require(probes).fixed_costs(probe)
            raw["overheads"] = ov
            keys = ("layer_overhead", "cpu_lane_overhead", "cpu_lane_start", "ship_chunk_overhead", "ship_expert_overhead")
            gpu.update({k: ov[k] for k in keys})
            progress("  per layer {:.0f} us, CPU lane +{:.0f} us (starts at {:.0f} us), ship chunk +{:.0f} us, "
                     "ship expert +{:.0f} us".format(*(1e6 * ov[k] for k in keys)))
        except Exception as exc:  # noqa: BLE001 - the profile stays usable without them; say so loudly
            progress(f"  WARNING: could not measure the hybrid layer's fixed costs ({exc}); left at 0")
        step("latency floor of graph decode per layer (small hybrid model, batch 1)...")
        try:
            fl = _require(probes).graph_floor(shape.hidden)
            raw["graph_floor"] = fl
            gpu["graph_layer_floor"] = fl["graph_layer_floor"]
            progress(f"  {fl['graph_layer_floor'] * 1e6:.0f} us per decoder layer")
        except Exception as exc:  # noqa: BLE001 - as above
            progress(f"  WARNING: could not measure the graph decode floor ({exc}); left at 0")
    else:
        progress("no CUDA device: writing the CPU fields only (GPU and link figures left null)")
        gpu = dict(gpu_flops=None, hbm_bw=None, link_bw=None, alpha=None)

    machine = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "gpu": raw.get("gpu"),
               "torch": torch.__version__, "calibrated_at": datetime.datetime.now(datetime.timezone.utc)
               .isoformat(timespec="seconds"), "shape": shape.name, "hidden": shape.hidden,
               "intermediate": shape.intermediate, "dram_method": method}
    if amx_knee:
        machine["amx_knee"] = amx_knee
        raw["amx_knee"] = amx_knee
    profile = HardwareProfile(name=f"calibrated-{platform.node() or 'this-machine'}", cpu_flops=peaks,
                              dram_bw=dram_bw, cpu_kernel=AUTO, cpu_curves=curves, machine=machine,
                              source="calibrated", **gpu)
    return profile, raw


def _require(probes: RuntimeProbes | None) -> RuntimeProbes:
    if probes is None:
        raise RuntimeError("no runtime probes were given")
    return probes


def summary(profile: HardwareProfile) -> str:
    rows = [("B_D  DRAM read", f"{profile.dram_bw / 1e9:.1f} GB/s")]
    for kind, peak in profile.cpu_flops.items():
        rows.append((f"C_C  CPU ({kind}), best", f"{peak / 1e12:.3f} TFLOP/s"))
    if profile.has_gpu:
        rows += [("C_G  GPU expert GEMM", f"{profile.gpu_flops / 1e12:.1f} TFLOP/s"),
                 ("B_H  HBM copy", f"{profile.hbm_bw / 1e9:.0f} GB/s"),
                 ("B_L  host->GPU pinned", f"{profile.link_bw / 1e9:.1f} GB/s"),
                 ("alpha per transfer", f"{profile.alpha * 1e6:.1f} us"),
                 ("hybrid layer fixed cost", f"{profile.layer_overhead * 1e6:.0f} us"),
                 ("CPU lane fixed cost", f"{profile.cpu_lane_overhead * 1e6:.0f} us"),
                 ("CPU lane starts after", "not measured" if profile.cpu_lane_start is None
                  else f"{profile.cpu_lane_start * 1e6:.0f} us"),
                 ("ship: per chunk / per expert", f"{profile.ship_chunk_overhead * 1e6:.0f} / "
                                                  f"{profile.ship_expert_overhead * 1e6:.0f} us"),
                 ("graph decode floor per layer", f"{profile.graph_layer_floor * 1e6:.0f} us")]
    else:
        rows.append(("GPU, link", "not measured (no CUDA device)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
