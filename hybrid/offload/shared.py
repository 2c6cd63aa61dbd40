"""Offload: what all hybrid MoE layers of one model share (device, lanes, scheduler, CPU executor options),
and the split of the host's cores between the CPU executor and the thread that launches GPU work."""

from __future__ import annotations

import contextlib
import logging
import os

from typing import TYPE_CHECKING, Callable

import torch

from cpu_kernels.knobs import knobs
from hybrid.offload.lanes import CpuLane, ShipLane
from placement.schedule import LayerScheduler

if TYPE_CHECKING:
    from hybrid.offload.experts import HybridExperts

log = logging.getLogger("hybrid.offload")
# The cpus this process may use, read before any thread is pinned (pinning narrows the pinned thread's own
# affinity, which later reads would otherwise see).
_PROCESS_CPUS = frozenset(os.sched_getaffinity(0))


class Offload:
    """What all hybrid layers of one model share: device, lanes, scheduler settings and CPU executor options."""

    def __init__(self, device, dtype: torch.dtype, scheduler: LayerScheduler, cpu_dtype: str = "bf16",
                 cpu_isa: str | None = None, threads: int | None = None, staging_slots: int = 3,
                 group_size: int = 128, ship_chunk: int = 8, graphs: bool = True, defer: int = 0,
                 resident_dtype: str = "bf16"):
        from hybrid.offload.resident import RESIDENT_KINDS

        if resident_dtype not in RESIDENT_KINDS:
            raise ValueError(f"resident experts' dtype must be one of {', '.join(RESIDENT_KINDS)}, got {resident_dtype!r}")
        # resident experts in VRAM: bf16 copies, or int8 / int4 bytes (hybrid.offload.resident)
        self.resident_dtype = resident_dtype
        self.device = torch.device(device)
        self.dtype = dtype
        self.lane_cpus: set[int] | None = None
        self._launcher_cpus: set[int] | None = None
        self.topology = self._split_cores(threads) if self.device.type == "cuda" else None
        self.scheduler = scheduler
        self.cpu_dtype, self.cpu_isa, self.threads, self.group_size = cpu_dtype, cpu_isa, threads, group_size
        self.cpu_lane = CpuLane(self.device, pin_cpus=self.lane_cpus)
        self.graphs = graphs and self.device.type == "cuda"
        self._host_lane = None
        self.ship_lane = ShipLane(self.device, staging_slots, ship_chunk)
        self.replacer = None  # hybrid.offload.replace.OnlineReplacer when --replace online
        self.pinned_weight_bytes = 0
        self.layers: list["HybridExperts"] = []
        if defer < 0:
            raise ValueError(f"defer must be >= 0, got {defer}")
        # Expert deferral (off by default: it changes the model's math): each token's `defer` lowest-ranked
        # routed experts of a hybrid layer are added to the next hybrid layer's output, so that in captured
        # decode their CPU work runs beside the next layer's attention (KTransformers, SOSP'25).
        self.defer = defer
        self.pending = None  # the deferred output of the layer before: a callable giving [T, D]
        # (CPU dtype, strategy) -> a LayerScheduler priced for layers in another CPU dtype than cpu_dtype (a GGUF
        # file of mixed layers): the expert's bytes and the kernel curve of that dtype (scheduler_of)
        self.scheduler_factory: Callable[[str, object], LayerScheduler] | None = None
        self._schedulers: dict = {}

    def scheduler_of(self, cpu_dtype: str) -> LayerScheduler:
        """The scheduler of a layer whose experts are in `cpu_dtype`: the shared one for the load's dtype, else one
        built once per dtype with the shared one's strategy (again when the shared one is replaced)."""
        if cpu_dtype == self.cpu_dtype or self.scheduler_factory is None:
            return self.scheduler
        key = (cpu_dtype, id(self.scheduler))
        if key not in self._schedulers:
            self._schedulers = {k: v for k, v in self._schedulers.items() if k[1] == id(self.scheduler)}
            self._schedulers[key] = self.scheduler_factory(cpu_dtype, self.scheduler.strategy)
        return self._schedulers[key]

    def _split_cores(self, threads: int | None):
        """Give the CPU executor's pool all cores but one, leaving one for the GPU-launching thread.

        The launching thread spin-waits in CUDA syncs and, while the ship lane runs, launches copies for a
        millisecond or more; on a core of the pool it would steal a pinned worker's time slice (ms) in the
        middle of a layer call. The pool's first core is left by its pinned workers to the thread that calls
        the executor (the CPU lane's thread), which is pinned there at its first job (pinned measured faster
        than floating at batched and eager decode). The launching thread is pinned to the spare cpu while it
        runs a hybrid layer call (launcher_pinned) and gets its own affinity back after it, so torch CPU work
        outside the layers keeps every core. HYBRID_CORE_SPLIT=0 (a machine shared with other work) gives the
        pool the cpus asked for and pins neither thread. Returns the pool's topology."""
        import cpu_kernels

        topo = cpu_kernels.Topology.discover(allowed=_PROCESS_CPUS).limit(threads)
        if not knobs().core_split:
            return topo
        pool = sorted(c for n in topo.nodes for c in n)
        rest = sorted(_PROCESS_CPUS - set(pool))
        if not rest:  # every core is in the pool: give up the last one
            if len(pool) < 2:
                return topo
            give = {topo.nodes[-1][-1]}
            topo = cpu_kernels.Topology(tuple(t for t in (tuple(c for c in n if c not in give) for n in topo.nodes) if t))
            rest = sorted(give)
            pool = [c for c in pool if c not in give]
        self.lane_cpus = {pool[0]}
        self._launcher_cpus = set(rest)
        log.info("hybrid: CPU executor on %d cpus (%s..%s), spare for GPU launches: %s", len(pool), pool[0], pool[-1], rest)
        return topo

    @contextlib.contextmanager
    def launcher_pinned(self):
        """Run the block with the calling (GPU-launching) thread pinned off the executor's cores, its own
        affinity restored after. While a layer's CPU lane runs, a launching thread that the kernel scheduler
        puts on a pool core takes a pinned worker's time slice (ms) and stalls the executor's phase barrier.
        Scoped to layer calls, not set once, so that loading, packing and torch CPU work elsewhere keep every
        core. A few syscalls per step (~us); the engine wraps whole steps, graph replays included."""
        cpus, before = self._launcher_cpus, None
        if cpus:
            try:
                before = os.sched_getaffinity(0)  # this thread only (Linux: pid 0 = the calling thread)
                if before == cpus:
                    before = None  # already pinned (an enclosing step): nothing to undo here
                else:
                    os.sched_setaffinity(0, cpus)
            except OSError as exc:
                log.warning("could not pin the launching thread to cpus %s (%s); leaving it floating",
                            sorted(cpus), exc)
                self._launcher_cpus, before = None, None
        try:
            yield
        finally:
            if before is not None:
                os.sched_setaffinity(0, before)

    @property
    def host_lane(self):
        """The CPU lane as stream-ordered host functions (CUDA): captured steps, and eager ones with a
        compiled ISA (hybrid.offload.host_lane)."""
        if self._host_lane is None:
            from hybrid.offload.host_lane import HostFnLane

            self._host_lane = HostFnLane(self.device, pin_cpus=self.lane_cpus, defer=self.defer > 0)
        return self._host_lane

    def cpu_lane_busy_s(self) -> float:
        """Seconds the host lane's compiled jobs have computed so far (0 before it exists)."""
        return self._host_lane.busy_s if self._host_lane is not None else 0.0

    def uses_host_lane(self, layer) -> bool:
        """Eager calls: CUDA with a compiled CPU kernel use the host lane (no GIL); else the Python worker lane."""
        return self.device.type == "cuda" and layer.cpu_moe.isa != "ref"

    def memory(self) -> dict:
        """Bytes: DRAM of the CPU executors, pinned host memory, VRAM of resident experts and staging."""
        return {
            "dram_expert_bytes": sum(layer.cpu_moe.nbytes for layer in self.layers),
            "pinned_bytes": self.pinned_weight_bytes + self.cpu_lane.pinned_bytes
            + (self._host_lane.pinned_bytes if self._host_lane is not None else 0),
            "vram_resident_bytes": sum(layer.resident_bytes for layer in self.layers),
            "vram_staging_bytes": self.ship_lane.vram_bytes,
        }
