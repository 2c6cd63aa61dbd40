"""Measure this machine and fit a HardwareProfile (the figures of DESIGN section 3)."""

from __future__ import annotations

import datetime
import json
import mmap
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
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
LOAD_STEPS = 1  # the load speeds: packer per CPU dtype, packed copy, disk
# the CPU dtypes whose packing the probe times over a safetensors file's expert views: what a load runs (the compiled
# packer, csrc/pack.h, for all but the K-quants, which cpu_kernels.quant quantizes a chunk of experts at a time)
VIEW_PACK_DTYPES = ("bf16", "int8", "int4", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_xs")
PACK_BYTES = 64 << 20  # bf16 bytes of the random experts each CPU dtype's packing probe converts
DISK_BYTES = {True: 256 << 20, False: 1 << 30}  # the disk probe's file, quick / --full
QUICK_DISK_S = 3.0  # quick: the disk probe gives up when writing its file takes longer than this


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


def _probe_folder() -> Path:
    """A temporary folder in $HYBRID_CACHE (the packed cache's file system), else in the temp dir."""
    from cpu_kernels.knobs import knobs

    try:
        knobs().cache.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".load-probe-", dir=knobs().cache))
    except OSError:
        return Path(tempfile.mkdtemp(prefix="hybrid-load-probe-"))


def write_random_experts(path: Path, E: int, D: int, F: int) -> int:
    """A safetensors file of E experts' gate, up [F, D] and down [D, F] in bf16, N(0, 0.02), named "{e}.gate" ...,
    written one matrix at a time (no stack of the experts is ever allocated). Returns the weights' bytes."""
    shapes = [(f"{e}.{name}", (rows, k)) for e in range(E) for name, (rows, k) in
              (("gate", (F, D)), ("up", (F, D)), ("down", (D, F)))]
    header, off = {}, 0
    for name, (rows, k) in shapes:
        header[name] = {"dtype": "BF16", "shape": [rows, k], "data_offsets": [off, off + 2 * rows * k]}
        off += 2 * rows * k
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    gen = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _, (rows, k) in shapes:
            w = (torch.randn(rows, k, generator=gen) * 0.02).to(torch.bfloat16)
            f.write(memoryview(w.view(torch.uint8).numpy()))
    return off


def release_free_memory() -> None:
    """Hands the allocator's free memory back to the kernel (glibc malloc_trim), so that the next probe's buffers
    are fresh pages, as a load's are (its buffers are far above the allocator's mmap threshold): a probe that
    re-used the pages the previous one freed would skip the first touch every load pays."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


def _pack_views(path: Path, E: int, dtype: str):
    """A CpuMoE packed as a load packs it: ExpertRows of a freshly memory-mapped safetensors file (the loader's
    expert views), converted by the compiled packer on the executor's threads; returns (executor, seconds)."""
    import cpu_kernels
    from cpu_kernels.moe import ExpertRows
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        views = [ExpertRows([f.get_tensor(f"{e}.{name}") for e in range(E)]) for name in ("gate", "up", "down")]
        t0 = time.perf_counter()
        moe = cpu_kernels.CpuMoE(*views, dtype=dtype)
        return moe, time.perf_counter() - t0


def measure_pack_rates(hidden: int, intermediate: int, folder: Path, source_bytes: int = PACK_BYTES,
                       reps: int = 3) -> tuple[dict, float | None]:
    """(pack rates, packed copy rate), bytes/s over `reps` runs each (their bytes over their seconds, as a load's rate
    is over its layers, slow and fast alike). Pack rates per CPU dtype: bytes of bf16
    expert weights converted per second by what a load runs (VIEW_PACK_DTYPES: the compiled packer on the
    executor's threads, q4_k's torch quantizer) over a page-cached safetensors file's memory-mapped experts of this
    shape (as many as
    source_bytes hold, at least 2), and for mxfp4 CpuMoE.from_mxfp4 over blocks in the published layout (it has no
    compiled packer: torch re-orders the codes), for iq2_xxs, iq3_xxs, iq3_s, iq1_s and iq1_m CpuMoE.from_<dtype> over random
    GGUF blocks (a file's blocks copied, what these dtypes mostly pack; iq2_xxs's quantizer from floats is slower:
    _file_only_pack_rate). The packed copy rate: the bf16 executor's packed bytes, written
    to a file that stays in the page cache, memory-mapped and copied back by CpuMoE.from_packed as the packed
    cache copies them (its disk read is measure_disk's). Before each, the freed memory goes back to the kernel, so
    every one fills fresh pages as a load does; a load that holds far more memory may still find it slower to come
    by (much slower on a VM whose host backs the guest's memory lazily). ({}, None) without a compiled packer."""
    import cpu_kernels
    from cpu_kernels import _native

    if not _native.has_packer(_native.resolve_isa(None)):
        return {}, None
    D, F = hidden, intermediate
    E = max(2, source_bytes // (3 * D * F * 2))
    path = folder / "experts.safetensors"
    weights = write_random_experts(path, E, D, F)
    cpu_kernels.CpuMoE(*(torch.zeros(1, 64, 64, dtype=torch.bfloat16) for _ in range(3)))  # the pool's start-up
    rates = {}
    for dtype in VIEW_PACK_DTYPES:
        seconds = []
        for _ in range(reps):
            release_free_memory()
            seconds.append(_pack_views(path, E, dtype)[1])
        rates[dtype] = reps * weights / sum(seconds)
    if D % 32 == 0 and F % 32 == 0:
        gen = torch.Generator().manual_seed(1)
        pairs = [(torch.randint(0, 256, (E, r, k // 32, 16), dtype=torch.uint8, generator=gen),
                  torch.randint(119, 129, (E, r, k // 32), dtype=torch.uint8, generator=gen))
                 for r, k in ((F, D), (F, D), (D, F))]
        seconds = []
        for _ in range(reps):
            release_free_memory()
            t0 = time.perf_counter()
            cpu_kernels.CpuMoE.from_mxfp4(*pairs)
            seconds.append(time.perf_counter() - t0)
        rates["mxfp4"] = reps * weights / sum(seconds)
        del pairs
    for dtype in ("iq2_xxs", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"):
        rates[dtype] = _file_only_pack_rate(dtype, D, F, source_bytes, reps)
    release_free_memory()
    return rates, _packed_copy_rate(_pack_views(path, E, "bf16")[0], folder / "packed.bin", reps)


# a file-only dtype -> the bytes of its GGUF block per 256 values, the byte holding its fp16 d's top exponent bits and
# the mask that keeps d finite (IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S: d the first two bytes; IQ1_M: d's bits 12-15 the last byte's top nibble)
_FILE_ONLY_BLOCKS = {"iq2_xxs": (66, 1, 0x3B), "iq3_xxs": (98, 1, 0x3B), "iq3_s": (110, 1, 0x3B),
                     "iq1_s": (50, 1, 0x3B), "iq1_m": (56, 55, 0xBF)}


def _file_only_pack_rate(dtype: str, D: int, F: int, source_bytes: int, reps: int) -> float:
    """Bytes/s (as bf16 weights) of CpuMoE.from_<dtype> (iq2_xxs, iq3_xxs, iq3_s, iq1_s, iq1_m) over random GGUF blocks of its type of this
    shape (D and F rounded up to whole 256-value super-blocks): the compiled packer's copy of a file's blocks, the only
    way into that dtype."""
    import cpu_kernels

    Dp, Fp = -(-D // 256) * 256, -(-F // 256) * 256
    E = max(2, source_bytes // (3 * Dp * Fp * 2))
    gen = torch.Generator().manual_seed(2)
    raws = []
    for r, k in ((Fp, Dp), (Fp, Dp), (Dp, Fp)):
        nbytes, at, keep = _FILE_ONLY_BLOCKS[dtype]
        raw = torch.randint(0, 256, (E, r, k // 256, nbytes), dtype=torch.uint8, generator=gen)
        raw[..., at] &= keep  # a finite fp16 d (exponent below all ones)
        raws.append(raw)
    seconds = []
    for _ in range(reps):
        release_free_memory()
        t0 = time.perf_counter()
        getattr(cpu_kernels.CpuMoE, f"from_{dtype}")(*raws)
        seconds.append(time.perf_counter() - t0)
    return reps * 3 * E * Dp * Fp * 2 / sum(seconds)


def _packed_copy_rate(moe, path: Path, reps: int) -> float:
    """Bytes/s of CpuMoE.from_packed over moe's packed bytes in a page-cached, memory-mapped file, over `reps`
    copies."""
    import cpu_kernels

    state = moe.packed_state()
    parts, off = {}, 0
    with open(path, "wb") as f:
        for name, t in state.items():
            parts[name] = (off, t.numel())
            f.write(memoryview(t.numpy()))
            off += t.numel()
    seconds = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        data = torch.frombuffer(mm, dtype=torch.uint8)
        views = {name: data[o:o + n] for name, (o, n) in parts.items()}
        for _ in range(reps):
            release_free_memory()
            t0 = time.perf_counter()
            cpu_kernels.CpuMoE.from_packed(views, (moe.E, moe.F, moe.D), moe.layout, dtype=moe.dtype)
            seconds.append(time.perf_counter() - t0)
        del views, data
    return reps * off / sum(seconds)


def measure_disk(folder: Path, nbytes: int, budget_s: float | None = None) -> tuple[dict, str | None]:
    """({disk_write_bw, disk_read_bw}, None), bytes/s, or ({}, why not): a file of nbytes (random bytes) written
    and fsynced in `folder`, its pages dropped from the page cache (posix_fadvise DONTNEED), then read back
    sequentially. This is the disk of `folder` (the packed cache's); a checkpoint elsewhere may sit on another.
    budget_s: give up when writing takes longer (a slow disk would hold up a quick calibration)."""
    if not hasattr(os, "posix_fadvise"):
        return {}, "this system cannot drop a file from the page cache (no posix_fadvise)"
    chunk = os.urandom(min(nbytes, 16 << 20))
    path = folder / "disk.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0, written = time.perf_counter(), 0
        while written < nbytes:
            written += os.write(fd, chunk[:nbytes - written])
            if budget_s is not None and time.perf_counter() - t0 > budget_s and written < nbytes:
                return {}, (f"writing {nbytes >> 20} MiB took over {budget_s:.0f} s ({written >> 20} MiB written): "
                            "skipped in a quick calibration, --full measures it")
        os.fsync(fd)
        write_bw = nbytes / (time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    buf = bytearray(16 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0, read = time.perf_counter(), 0
        while n := os.readv(fd, [buf]):
            read += n
        read_bw = read / (time.perf_counter() - t0)
    finally:
        os.close(fd)
    return {"disk_write_bw": write_bw, "disk_read_bw": read_bw}, None


def measure_load_speeds(shape: ExpertShape, quick: bool, progress: Callable[[str], None],
                        pack_bytes: int | None = None, disk_bytes: int | None = None) -> dict:
    """The profile's load-time fields (placement/load_time.py): pack_rates, packed_copy_bw, disk_read_bw,
    disk_write_bw (absent where not measured), each probe in a temporary folder of $HYBRID_CACHE removed after."""
    folder = _probe_folder()
    out: dict = {}
    try:
        rates, copy = measure_pack_rates(shape.hidden, shape.intermediate, folder, pack_bytes or PACK_BYTES,
                                         reps=3 if quick else 5)
        if rates:
            out.update(pack_rates=rates, packed_copy_bw=copy)
            progress("  packer " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in rates.items())
                     + f" GB/s of bf16 weights; packed copy {copy / 1e9:.2f} GB/s")
        else:
            progress("  no compiled packer on this ISA: pack rates and packed copy not measured")
        n = disk_bytes or DISK_BYTES[quick]
        disk, why = measure_disk(folder, n, QUICK_DISK_S if quick else None)
        out.update(disk)
        progress(f"  disk of {folder.parent}: write {disk['disk_write_bw'] / 1e9:.2f} GB/s, read "
                 f"{disk['disk_read_bw'] / 1e9:.2f} GB/s ({n >> 20} MiB)" if disk else f"  disk not measured: {why}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def calibrate(shape: ExpertShape, quick: bool = False, experts: int = 8, backends: list[str] | None = None,
              dram_bytes: int | None = None, progress: Callable[[str], None] = print,
              probes: RuntimeProbes | None = None, load_bytes: tuple[int, int] | None = None
              ) -> tuple[HardwareProfile, dict]:
    """Run every probe; returns the profile and the raw measurements (for the summary and JSON). Without
    `probes` the hybrid layer's fixed costs and the graph floor are left at 0 with a warning, as when they fail.
    load_bytes: (packing probe's bf16 bytes, disk probe's file bytes), default PACK_BYTES and DISK_BYTES."""
    raw: dict = {"shape": shape.name, "hidden": shape.hidden, "intermediate": shape.intermediate,
                 "experts": experts, "threads": torch.get_num_threads()}
    ms = QUICK_M if quick else FULL_M
    # well above the last-level cache even in --quick: a buffer that fits in a large L3 reads faster than DRAM
    from cpu_kernels.bandwidth import default_read_bytes

    dram_bytes = dram_bytes or (default_read_bytes() if quick else max(2 << 30, default_read_bytes()))
    backends = backends or measure.cpu_backends()
    cuda = torch.cuda.is_available()
    step = Steps(1 + (len(KNEE_DTYPES) if _has_amx() else 0) + len(backends) + LOAD_STEPS + (GPU_STEPS if cuda else 0),
                 progress)

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

    step("load speeds: the packer per CPU dtype, the packed copy, the cache folder's disk...")
    try:
        load = measure_load_speeds(shape, quick, progress, *(load_bytes or (None, None)))
    except Exception as exc:  # noqa: BLE001 - the profile stays usable without them (load_time uses defaults)
        progress(f"  WARNING: could not measure the load speeds ({exc}); load-time predictions use defaults")
        load = {}
    raw["load"] = load

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
                              source="calibrated", **load, **gpu)
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
    if profile.pack_rates:
        rates = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in profile.pack_rates.items())
        rows.append(("packer, GB/s of bf16 weights", rates))
    for label, value in (("packed copy-back", profile.packed_copy_bw),
                         ("disk read (cache folder)", profile.disk_read_bw),
                         ("disk write + fsync", profile.disk_write_bw)):
        rows.append((label, "not measured" if value is None else f"{value / 1e9:.2f} GB/s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
