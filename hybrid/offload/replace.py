"""Online re-placement, the mechanism (the policy is placement.replace). `--replace online` turns it on.

Every eager hybrid layer call ends with `after_batch(layer, hist)`: the histogram joins the layer's
sliding window, and the policy may propose a swap (bring cold expert c into VRAM, evict resident v).
The copy never stalls a step:

- CUDA: c's packed bytes are copied host -> GPU (pinned, non_blocking) and de-quantized on a copy
  stream; an event marks the end. The swap lands at the start of a later call of that layer, once the
  event has completed (`query`, never a wait): a device-to-device copy into v's slot on the compute
  stream, ordered after every kernel that still reads v, and only then the routing map changes.
- CPU (CI, "GPU" played by torch on the CPU): the copy runs inline and the swap lands at the next call.

A batch in flight keeps its routing map: residency changes only between calls of a layer, never
inside one. One copy is in flight at a time over all layers, so re-placement needs one expert of VRAM
beyond the plan (the plan's --reserve must cover it: 36 MiB for a Qwen3-235B expert in bf16). Decode CUDA graphs hold their placement (HybridExperts.set_resident refuses after capture),
so re-placement runs in eager mode only: the session turns decode graphs off with --replace online, and
a layer found captured is left alone (logged once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from hybrid.offload.sources import expert_weights
from placement.replace import ReplaceConfig, ReplacePolicy, SlidingWindow, Swap, copy_time, saving_fn

log = logging.getLogger("hybrid.offload")


@dataclass
class _Pending:
    swap: Swap
    weights: tuple  # (gate [F, D], up [F, D], down [D, F]) on the device
    event: object  # torch.cuda.Event | None (CPU: ready at once)


@dataclass
class ReplaceStats:
    proposed: int = 0
    landed: int = 0
    skipped_captured: int = 0
    history: list = field(default_factory=list)  # (layer, batch, add, evict) of landed swaps


class OnlineReplacer:
    def __init__(self, offload, cpu_shape, gpu_shape, hw, cfg: ReplaceConfig = ReplaceConfig()):
        self.offload = offload
        self.cfg = cfg
        self.policy = ReplacePolicy(saving_fn(cpu_shape, gpu_shape, hw), copy_time(cpu_shape, hw), cfg)
        dev = offload.device
        self.copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.windows: dict[int, SlidingWindow] = {}
        self.pending: dict[int, _Pending] = {}
        self.batches: dict[int, int] = {}
        self.stats = ReplaceStats()
        self._warned = False
        self.max_in_flight = 1  # VRAM beyond the plan: one expert (covered by the plan's --reserve)

    # -- hooks called by HybridExperts.forward (eager calls only) ----------------------------------
    def before_batch(self, layer) -> None:
        """Land a finished copy of this layer (non-blocking check) before the batch reads its routing map."""
        p = self.pending.get(layer.layer)
        if p is None or (p.event is not None and not p.event.query()):
            return
        del self.pending[layer.layer]
        layer.swap_resident(p.swap.evict, p.swap.add, p.weights)
        if p.event is not None:  # the staged tensors were made on the copy stream, read on this one
            for t in p.weights:
                t.record_stream(torch.cuda.current_stream())
        self.stats.landed += 1
        self.stats.history.append((layer.layer, self.batches.get(layer.layer, 0), p.swap.add, p.swap.evict))

    def after_batch(self, layer, hist) -> None:
        """Record the batch's histogram [E]; maybe start one copy (after the batch's results are combined)."""
        if layer.captured:
            if not self._warned:
                log.warning("online re-placement skipped: decode graphs hold the placement (run with --eager)")
                self._warned = True
            self.stats.skipped_captured += 1
            return
        w = self.windows.get(layer.layer)
        if w is None:
            w = self.windows[layer.layer] = SlidingWindow(layer.num_experts, self.cfg.window)
        w.push(hist)
        self.batches[layer.layer] = self.batches.get(layer.layer, 0) + 1
        if len(self.pending) >= self.max_in_flight:
            return  # the link moves one expert at a time anyway; each copy in flight holds one expert of VRAM
        swaps = self.policy.decide(w, layer.is_resident)
        if swaps:
            self.stats.proposed += 1
            self._start(layer, swaps[0])

    # -- the copy --------------------------------------------------------------------------------------
    def _start(self, layer, swap: Swap) -> None:
        off = self.offload
        if self.copy_stream is None:
            self.pending[layer.layer] = _Pending(swap, layer.expert_weights(swap.add), None)
            return
        # no wait on the compute stream: the copy reads the never-written packed DRAM copy into fresh
        # buffers, so it may overlap the steps that follow
        with torch.cuda.stream(self.copy_stream):
            weights = _upload(layer, swap.add, off.device, off.dtype)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        self.pending[layer.layer] = _Pending(swap, weights, ev)


def _upload(layer, e: int, device, dtype):
    """Expert e's weights from the pinned packed copy to the device on the current (copy) stream:
    non_blocking copies, so the host does not wait for the link (HybridExperts.expert_weights would)."""
    return expert_weights(layer.sources, e, device, dtype, non_blocking=True)
