"""`hybrid calibrate`: measure this machine and write its HardwareProfile JSON.

Quick by default (tens of seconds: fewer token counts and sizes, the DRAM buffer still well above the
last-level cache); `--full` runs the dense sweep the benchmarks quote (about 10 minutes on a 2-core CPU box,
longer with a GPU). Every step prints a line with the elapsed time, and a heartbeat line every 30 s of a step
that is still running, so a long probe is never a silent one.
"""

from __future__ import annotations

import sys
import threading
import time

from hybrid.commands.cost import add_shape_args, shape_from_args
from hybrid.errors import UsageError
from placement.hardware import default_profile_path
from placement.json_file import check_writable, write_json

HEARTBEAT_S = 30.0


class Progress:
    """progress(line) for the probes: each line stamped with the elapsed seconds; a background thread says
    what is still running when a step has been quiet for HEARTBEAT_S."""

    def __init__(self, out=None, heartbeat_s: float = HEARTBEAT_S):
        self.out, self.heartbeat_s = out or sys.stdout, heartbeat_s  # sys.stdout now, not at import
        self.t0 = self.last = time.monotonic()
        self.step = "starting"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __call__(self, line: str) -> None:
        with self._lock:
            self.last = time.monotonic()
            if not line.startswith(" "):
                self.step = line.rstrip(".")
            print(f"[{self.last - self.t0:6.1f} s] {line}", file=self.out, flush=True)

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                now = time.monotonic()
                if now - self.last >= self.heartbeat_s:
                    print(f"[{now - self.t0:6.1f} s]   ... still measuring: {self.step}", file=self.out, flush=True)
                    self.last = now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_exc):
        self._stop.set()
        self._thread.join()


def _backends(text: str | None) -> list[str] | None:
    """--backends checked against what this machine has, before anything is measured."""
    if not text:
        return None
    from placement import measure

    present = measure.cpu_backends()
    asked = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in asked if b not in present]
    if unknown or not asked:
        raise UsageError(f"--backends: {', '.join(unknown) or repr(text)} not available here "
                         f"(this machine has: {', '.join(present)})")
    return asked


def runtime_probes():
    """The hybrid layer's own GPU probes for placement.calibrate, each imported when it runs (so that a failing
    import costs a warning line, as a failing probe does, not the whole calibration)."""
    from placement.calibrate import RuntimeProbes

    def fixed_costs(profile):
        from hybrid.offload.overheads import measure_overheads

        return measure_overheads(profile)

    def graph_floor(hidden):
        from hybrid.offload.overheads import measure_graph_layer_floor

        return measure_graph_layer_floor(hidden)

    return RuntimeProbes(fixed_costs=fixed_costs, graph_floor=graph_floor)


def run(args) -> int:
    from placement.calibrate import calibrate, summary  # imports torch: keep `hybrid --help` fast

    shape = shape_from_args(args)
    if args.experts < 1:
        raise UsageError(f"--experts must be >= 1, got {args.experts}")
    if args.quick and args.full:
        raise UsageError("give --quick or --full, not both")
    out = args.out or default_profile_path()
    check_writable(out, "--out")  # before minutes of measuring, not after
    check_writable(args.raw, "--raw")
    backends = _backends(args.backends)
    quick = not args.full
    print(f"calibrating ({'quick, tens of seconds; --full for the dense sweep' if quick else 'full sweep, about 10 minutes on a small CPU box'})",
          flush=True)
    with Progress() as progress:
        profile, raw = calibrate(shape, quick=quick, experts=args.experts, backends=backends, progress=progress,
                                 probes=runtime_probes())
    out = profile.save(out)
    if args.raw:
        write_json(args.raw, raw, indent=2)
    print(f"\nprofile {profile.name} written to {out}")
    print(summary(profile))
    return 0


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write a hardware profile",
                       description="Measures DRAM read bandwidth, the CPU expert throughput C_C(m) of every "
                       "CPU backend present (compiled kernels per ISA, torch) at an expert shape, the load speeds "
                       "(the expert packer per CPU dtype, the packed cache's copy-back, the cache folder's disk: "
                       "`hybrid plan`'s load time) and, with "
                       "CUDA, the pinned link (alpha + bytes/B_L), HBM bandwidth, GPU expert throughput and the "
                       "hybrid layer's fixed costs. Writes a JSON profile the cost model reads (DESIGN.md, "
                       "'Cost model'). Quick by default (tens of seconds on a CPU box; the disk probe writes 256 MiB "
                       "and is skipped when that takes over 3 s); --full measures more token counts and larger "
                       "sizes (about 10 minutes). Each step prints a line with the elapsed time.")
    add_shape_args(p)
    p.add_argument("--experts", type=int, default=8, help="experts per measurement (weights >> cache); default 8")
    p.add_argument("--backends", help="comma-separated CPU backends to measure (default: all present)")
    p.add_argument("--full", action="store_true", help="the dense sweep: more token counts and sizes (~10 min)")
    p.add_argument("--quick", action="store_true", help="the default; kept for scripts that pass it")
    p.add_argument("--out", help=f"profile path (default {default_profile_path()}; HYBRID_CACHE moves it)")
    p.add_argument("--raw", help="also write the raw measurements as JSON to this path")
    p.set_defaults(func=run)
