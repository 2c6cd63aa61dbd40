"""Decode in CUDA graphs: one graph per batch-size bucket, captured once, replayed every step.

A Python loop of small CUDA ops costs ~25-30 us per op on the GPU box (DESIGN.md sec. 6), a decode
step is thousands of them, so decode is captured whole: embedding, attention over the static cache,
router, the expert executor (it must not sync with the host) and the head. A step with B rows runs
the smallest bucket >= B; unused rows get position -1 (their K/V land in the cache's spare column) and
slot 0 (read but never written), so they disturb nothing. The graphs attend over the whole cache
(kv_len = max_context) because their shapes are fixed at capture.
"""

from __future__ import annotations

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    def __init__(self, model, cache, buckets: tuple[int, ...] | None = None):
        self.model, self.cache = model, cache
        mb = cache.max_batch
        self.buckets = tuple(sorted(set(b for b in (buckets or BUCKETS) if b < mb) | {mb}))
        self.device = model.device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}

    def _static(self, b: int) -> dict[str, torch.Tensor]:
        dev = self.device
        return {
            "ids": torch.zeros(b, 1, dtype=torch.long, device=dev),  # [b, 1]
            "pos": torch.full((b, 1), -1, dtype=torch.long, device=dev),  # [b, 1]; -1 = padding
            "slots": torch.zeros(b, dtype=torch.long, device=dev),  # [b]
        }

    def _run(self, s):
        return self.model(s["ids"], s["pos"], s["slots"], self.cache, last_only=True, kv_len=None)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        pool = None
        for b in sorted(self.buckets, reverse=True):
            s = self._static(b)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture: lazy inits, cuBLAS workspaces
                for _ in range(2):
                    self._run(s)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._run(s)  # [b, V]
            pool = g.pool()
            self.graphs[b] = (g, s, out)
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch {n} exceeds the largest graph bucket {self.buckets[-1]}")

    @torch.no_grad()
    def step(self, ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """-> logits [B, V] (a view of the graph's output buffer: consume before the next step)."""
        if not self.graphs:
            self.capture()
        n = len(ids)
        b = self.bucket(n)
        g, s, out = self.graphs[b]
        pad = b - n
        host = torch.tensor([ids + [0] * pad, positions + [-1] * pad, slots + [0] * pad], dtype=torch.long)
        s["ids"].copy_(host[0, :, None])
        s["pos"].copy_(host[1, :, None])
        s["slots"].copy_(host[2])
        g.replay()
        return out[:n]
