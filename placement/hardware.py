"""HardwareProfile: the measured (or published) machine the cost model prices work on.

Units are SI throughout: FLOP/s, bytes/s, seconds. A profile is a JSON file written by `hybrid
calibrate` (or one of the built-ins below) and read back with `load_profile`, which validates it and
turns every problem into a one-line UsageError.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from placement.errors import UsageError
from placement.json_file import write_json

log = logging.getLogger("placement")

SCHEMA_VERSION = 1
AUTO = "auto"  # cpu_kernel value: per m, the fastest kernel kind the profile knows


def _positive(name: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise UsageError(f"{name} must be a positive finite number, got {value!r}")
    return v


def _seconds(name: str, value) -> float:
    """A non-negative finite number of seconds."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise UsageError(f"{name} must be a non-negative number of seconds, got {value!r}")
    return v


@dataclass(frozen=True)
class HardwareProfile:
    """C_C per CPU kernel kind, B_D, C_G, B_H, B_L and alpha of DESIGN.md (Cost model).

    cpu_flops:  peak C_C per kernel kind (e.g. {"torch": 3.4e12, "amx": 1.2e13}).
    cpu_curves: optional measured C_C(m) per kind as [[m, flop/s], ...]; when present, the model
                interpolates it (log m) instead of using the peak, since small-m efficiency is far
                below peak on every kernel we measured.
    cpu_kernel: the kind used for pricing, or "auto" = the fastest kind at each m.
    """

    name: str
    cpu_flops: dict
    dram_bw: float
    gpu_flops: float | None  # None: calibrated without a GPU (CPU fields only)
    hbm_bw: float | None
    link_bw: float | None
    alpha: float | None
    cpu_kernel: str = AUTO
    cpu_curves: dict = field(default_factory=dict)
    # Fixed costs of our own runtime, measured by `hybrid calibrate` on a tiny hybrid layer (0 = ideal, as
    # in the paper's arithmetic): per layer call (routing histogram to the host, bookkeeping), per use of
    # the CPU lane (pinned copies, host function, pool wake-up), per shipped chunk (grouped GEMM
    # launches) and per shipped expert beyond its transfer (copy launches).
    layer_overhead: float = 0.0
    cpu_lane_overhead: float = 0.0
    ship_chunk_overhead: float = 0.0
    ship_expert_overhead: float = 0.0
    # Seconds from the start of an eager layer call to its CPU lane starting (routing histogram to the host,
    # the decision, the lane's enqueue and input copy). The rest of layer_overhead (the GPU lane's launches,
    # the merge) runs while the CPU lane works, so a layer costs max(layer_overhead + GPU lane, cpu_lane_start
    # + CPU lane), cpu_lane_start capped at layer_overhead. None = not measured: taken as layer_overhead (no
    # overlap).
    cpu_lane_start: float | None = None
    # Seconds per decoder layer of a captured decode step at batch 1 beyond its weight traffic (kernel
    # launches inside the graph, the CPU lane's copies and host function): measured by `hybrid calibrate`
    # on a small hybrid model with the expert shape's hidden size; 0 = not measured.
    graph_layer_floor: float = 0.0
    machine: dict = field(default_factory=dict)
    source: str = "builtin"
    # Load-time figures (placement/load_time.py), measured by `hybrid calibrate`'s load step; absent (older
    # profiles, {} / None) = not measured, and the prediction uses LOAD_DEFAULTS and says so.
    # pack_rates: CPU dtype -> bytes/s of experts converted for the CPU executor, counted as 2 bytes (bf16) per
    # weight whatever the source dtype; packed_copy_bw: bytes/s of packed bytes copied from a page-cached file
    # into the executor's node-local buffers (the packed cache's copy-back); disk_read_bw / disk_write_bw: bytes/s
    # of a sequential read (page cache dropped first) / write + fsync of a file in the cache folder's file system.
    pack_rates: dict = field(default_factory=dict)
    packed_copy_bw: float | None = None
    disk_read_bw: float | None = None
    disk_write_bw: float | None = None

    def __post_init__(self):
        if not isinstance(self.cpu_flops, dict) or not self.cpu_flops:
            raise UsageError(f"profile {self.name!r}: cpu_flops must be a non-empty object of kernel -> FLOP/s")
        flops = {str(k): _positive(f"cpu_flops[{k}]", v) for k, v in self.cpu_flops.items()}
        object.__setattr__(self, "cpu_flops", flops)
        object.__setattr__(self, "dram_bw", _positive("dram_bw", self.dram_bw))
        gpu_fields = ("gpu_flops", "hbm_bw", "link_bw", "alpha")
        given = [name for name in gpu_fields if getattr(self, name) is not None]
        if given and len(given) != len(gpu_fields):
            missing = sorted(set(gpu_fields) - set(given))
            raise UsageError(f"profile {self.name!r}: GPU fields must be all set or all null; null: {', '.join(missing)}")
        for name in ("gpu_flops", "hbm_bw", "link_bw"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive(name, getattr(self, name)))
        if self.alpha is not None:
            object.__setattr__(self, "alpha", _seconds("alpha", self.alpha))
        if self.cpu_kernel != AUTO and self.cpu_kernel not in flops:
            raise UsageError(f"profile {self.name!r}: cpu_kernel {self.cpu_kernel!r} not in cpu_flops "
                             f"({', '.join(flops)}) and not 'auto'")
        for name in ("layer_overhead", "cpu_lane_overhead", "ship_chunk_overhead", "ship_expert_overhead",
                     "graph_layer_floor"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))
        if self.cpu_lane_start is not None:
            object.__setattr__(self, "cpu_lane_start", _seconds("cpu_lane_start", self.cpu_lane_start))
        self._check_load_figures()
        curves = {}
        for kind, points in (self.cpu_curves or {}).items():
            try:
                pts = sorted((float(m), float(f)) for m, f in points)
            except (TypeError, ValueError):
                raise UsageError(f"profile {self.name!r}: cpu_curves[{kind}] must be a list of [m, flop/s] pairs") from None
            if not pts or any(not (m > 0 and f > 0 and math.isfinite(f)) for m, f in pts):
                raise UsageError(f"profile {self.name!r}: cpu_curves[{kind}] needs positive [m, flop/s] pairs")
            curves[str(kind)] = [list(p) for p in pts]
        object.__setattr__(self, "cpu_curves", curves)

    def _check_load_figures(self) -> None:
        if not isinstance(self.pack_rates, dict):
            raise UsageError(f"profile {self.name!r}: pack_rates must be an object of CPU dtype -> bytes/s")
        rates = {str(k): _positive(f"pack_rates[{k}]", v) for k, v in self.pack_rates.items()}
        object.__setattr__(self, "pack_rates", rates)
        for name in ("packed_copy_bw", "disk_read_bw", "disk_write_bw"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive(name, getattr(self, name)))

    @property
    def cpu_lane_head(self) -> float:
        """Seconds of the layer call's fixed cost that the CPU lane runs through (its head start over the
        GPU lane): layer_overhead - cpu_lane_start, 0 when not measured."""
        if self.cpu_lane_start is None:
            return 0.0
        return max(0.0, self.layer_overhead - self.cpu_lane_start)

    # -- pricing helpers -------------------------------------------------------------------------
    @property
    def has_gpu(self) -> bool:
        return self.gpu_flops is not None

    def require_gpu(self) -> "HardwareProfile":
        if not self.has_gpu:
            raise UsageError(f"profile {self.name!r} has no GPU or link figures (calibrated without a GPU); "
                             "calibrate on the GPU machine or pass --gpu-flops --hbm-bw --link-bw --alpha")
        return self

    def kinds(self, kernel: str | None = None) -> list[str]:
        kernel = kernel or self.cpu_kernel
        if kernel == AUTO:
            return list(self.cpu_flops)
        if kernel not in self.cpu_flops:
            raise UsageError(f"CPU kernel {kernel!r} not in profile {self.name!r} ({', '.join(self.cpu_flops)})")
        return [kernel]

    def cpu_peak(self, kernel: str | None = None) -> float:
        return max(self.cpu_flops[k] for k in self.kinds(kernel))

    def cpu_flops_at(self, m, kernel: str | None = None):
        """C_C at m tokens per expert (array in, array out): the curve if measured, else the peak."""
        m = np.maximum(np.asarray(m, dtype=np.float64), 1.0)
        best = np.zeros_like(m)
        for kind in self.kinds(kernel):
            pts = self.cpu_curves.get(kind)
            if pts:
                xs = np.log([p[0] for p in pts])
                ys = np.array([p[1] for p in pts])
                c = np.interp(np.log(m), xs, ys)  # clamped to the end points outside the range
            else:
                c = np.full_like(m, self.cpu_flops[kind])
            best = np.maximum(best, c)
        return best

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json(), indent=2)

    @classmethod
    def from_json(cls, data: dict, origin: str = "profile") -> "HardwareProfile":
        if not isinstance(data, dict):
            raise UsageError(f"{origin}: expected a JSON object")
        version = data.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise UsageError(f"{origin}: schema_version {version} not supported (this build reads {SCHEMA_VERSION})")
        required = ("name", "cpu_flops", "dram_bw", "gpu_flops", "hbm_bw", "link_bw", "alpha")
        missing = [k for k in required if k not in data]
        if missing:
            raise UsageError(f"{origin}: missing field(s) {', '.join(missing)}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known - {"schema_version"})
        if unknown:
            raise UsageError(f"{origin}: unknown field(s) {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})


def load_profile(path: str | os.PathLike) -> HardwareProfile:
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"profile file {str(path)!r} not found") from None
    except OSError as exc:
        raise UsageError(f"cannot read profile {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"profile {str(path)!r} is not UTF-8 text (byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"profile {str(path)!r} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise UsageError(f"profile {str(path)!r} is not valid JSON (nested too deeply)") from None
    try:
        return HardwareProfile.from_json(data, origin=f"profile {str(path)!r}")
    except (TypeError, ValueError, AttributeError) as exc:  # a field of the wrong type the checks did not name
        raise UsageError(f"profile {str(path)!r}: malformed ({type(exc).__name__}: {exc})") from None


# The box of the KTransformers paper (SOSP'25), as DESIGN.md (Cost model) quotes it: one Xeon Platinum 8452Y
# socket (B_D 220 GB/s; C_C 1.8 TFLOP/s with a PyTorch AVX-512 kernel, 21.3 with their AMX kernel), an
# A100 40GB PCIe at 50% of peak (C_G 156 TFLOP/s, B_H 778 GB/s), PCIe 4.0 x16 taken as 25 GB/s, 5 us.
# Load-time figures for profiles that did not measure them (the built-ins, and calibrations older than the load
# step): NOT measured, round figures for a many-core server with a PCIe 4.0 NVMe drive. Disk: 2 GB/s sequential
# read, 1 GB/s write with fsync. Packer: the compiled packer (bf16, int8, int4, q8_0, q4_0) at 2 / 2 / 1.5 / 2 / 2 GB/s
# of bf16 weights, iq4_xs (its codebook search per value) at 1, mxfp4 (published blocks re-ordered with torch) and the K-quants (torch's quantizers) at 0.3,
# iq2_xxs, iq3_xxs, iq3_s, iq1_s and iq1_m (a GGUF file's blocks copied by the compiled packer; iq2_xxs's quantizer from floats, a
# codebook search in torch, is slower) at 2; packed copy-back
# 5 GB/s. Every CPU dtype of cpu_kernels.dtypes has one. placement/load_time.py says "defaults, not measured"
# whenever it prices with them.
LOAD_DEFAULTS = dict(pack_rates={"bf16": 2e9, "int8": 2e9, "int4": 1.5e9, "mxfp4": 0.3e9, "q8_0": 2e9, "q4_0": 2e9,
                                 "q4_k": 0.3e9, "q5_k": 0.3e9, "q6_k": 0.3e9, "q2_k": 0.3e9, "q3_k": 0.3e9, "iq4_xs": 1e9,
                                 "iq2_xxs": 2e9, "iq3_xxs": 2e9, "iq3_s": 2e9, "iq1_s": 2e9,
                                 "iq1_m": 2e9},
                     packed_copy_bw=5e9, disk_read_bw=2e9, disk_write_bw=1e9)
_PAPER = dict(dram_bw=220e9, gpu_flops=156e12, hbm_bw=778e9, link_bw=25e9, alpha=5e-6, **LOAD_DEFAULTS,
              machine={"cpu": "Xeon Platinum 8452Y (1 socket)", "gpu": "A100 40GB PCIe",
                       "link": "PCIe 4.0 x16", "reference": "KTransformers, SOSP'25",
                       "load_figures": "not measured (placement.hardware.LOAD_DEFAULTS)"})
BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    "ktransformers-paper-avx512": HardwareProfile(
        name="ktransformers-paper-avx512", cpu_flops={"avx512": 1.8e12}, cpu_kernel="avx512", **_PAPER),
    "ktransformers-paper-amx": HardwareProfile(
        name="ktransformers-paper-amx", cpu_flops={"amx": 21.3e12}, cpu_kernel="amx", **_PAPER),
}


def default_profile_path() -> Path:
    from cpu_kernels.knobs import knobs  # here, not at the top: the cpu_kernels package imports torch

    return knobs().cache / "profile.json"


def resolve_profile(name_or_path: str | HardwareProfile | None) -> HardwareProfile:
    """A built-in name, a JSON path, or (None) the calibrated profile of this machine if one exists; a profile
    already resolved (pricing_profile's) is returned as it is."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    if name_or_path is None:
        path = default_profile_path()
        if path.exists():
            return load_profile(path)
        raise UsageError(f"no profile given and none calibrated at {path}; run `hybrid calibrate` or pass "
                         f"--profile ({', '.join(BUILTIN_PROFILES)} or a JSON file)")
    if name_or_path in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name_or_path]
    if name_or_path.endswith(".json") or os.path.sep in name_or_path or Path(name_or_path).exists():
        return load_profile(name_or_path)
    raise UsageError(f"unknown profile {name_or_path!r}: built-ins are {', '.join(BUILTIN_PROFILES)}; "
                     f"or pass a JSON file written by `hybrid calibrate`")


FALLBACK_PROFILE = "ktransformers-paper-amx"  # whose GPU figures every command borrows when a profile has none
GPU_FIELDS = ("gpu_flops", "hbm_bw", "link_bw", "alpha", "layer_overhead", "cpu_lane_overhead", "cpu_lane_start",
              "ship_chunk_overhead", "ship_expert_overhead", "graph_layer_floor")


def with_borrowed_gpu(hw: HardwareProfile, donor: HardwareProfile) -> HardwareProfile:
    """`hw`'s CPU figures (B_D, C_C and its curves, the AMX knee) with `donor`'s GPU, link and fixed-cost figures:
    a CPU-only calibration measured this machine's CPU, and nothing else should replace what it measured."""
    machine = dict(hw.machine, gpu_figures_from=donor.name)
    return replace(hw, name=f"{hw.name}+{donor.name}", machine=machine,
                   **{name: getattr(donor, name) for name in GPU_FIELDS})


def _warn(line: str) -> None:
    log.warning("%s", line)


def priced_kernel(hw: HardwareProfile, cpu_dtype: str, group: int | None, isa: str | None = None,
                  note: Callable[[str], None] = _warn) -> str | None:
    """The CPU kernel curve the CPU lane is priced with (cost_model.cpu_compute_time's `kernel`): the curve of the
    kernels `cpu_dtype` experts really run on where that differs from the executor's ISA `isa` (None: the profile's
    best kind, the machine it measured), i.e. the vector kernels for a dtype the AMX tiles have no path for; None
    (the profile's own choice) otherwise. A profile pinned to one kernel keeps it. Where the profile lacks that curve
    (it measured AMX only), `note` says so: the lane is then priced at AMX's rate and the cost schedule keeps more of
    a long prompt's expert work on the CPU than it should."""
    from cpu_kernels.dtypes import computing_isa

    if hw.cpu_kernel != AUTO or cpu_dtype is None:
        return None
    isa = isa or max(hw.cpu_flops, key=hw.cpu_flops.get)
    runs = computing_isa(cpu_dtype, group, isa)
    if runs == isa:
        return None
    if runs in hw.cpu_flops:
        return runs
    note(f"profile {hw.name!r} has no curve of the {runs} kernels that {cpu_dtype} experts run on (it measured "
         f"{', '.join(hw.cpu_flops)}): their CPU work is priced at the {isa} rate, so a long prompt keeps more of it "
         f"on the CPU than it should; `hybrid calibrate` on this machine measures every kernel")
    return None


def pricing_profile(name_or_path: str | HardwareProfile | None = None, note: Callable[[str], None] = _warn,
                    say_fallback: bool = True) -> HardwareProfile:
    """The one rule every command prices with: the profile named (a built-in or a JSON file), else this machine's
    calibrated one, else the built-in FALLBACK_PROFILE. A profile without GPU figures (`hybrid calibrate` on a
    machine without CUDA) keeps its own CPU figures and borrows only the GPU and link figures of FALLBACK_PROFILE.
    `note` gets one line whenever figures are borrowed, and (unless say_fallback is False: an output that names
    its profile anyway) when there is no calibrated profile."""
    fallback = BUILTIN_PROFILES[FALLBACK_PROFILE]
    if name_or_path is None and not default_profile_path().exists():
        if say_fallback:
            note(f"no calibrated profile at {default_profile_path()} (run `hybrid calibrate`): pricing with the "
                 f"built-in {FALLBACK_PROFILE}")
        return fallback
    hw = resolve_profile(name_or_path)
    if hw.has_gpu:
        return hw
    note(f"profile {hw.name!r} has no GPU figures (calibrated without a GPU): pricing with its own CPU figures "
         f"(B_D, C_C) and only the GPU and link figures (C_G, B_H, B_L, alpha) of the built-in {FALLBACK_PROFILE}")
    return with_borrowed_gpu(hw, fallback)
