"""Decode in CUDA graphs: one graph per batch-size bucket and context bucket, captured once, replayed every step.

A Python loop of small CUDA ops costs ~25-30 us per op on the GPU box (DESIGN.md sec. 6), a decode
step is thousands of them, so decode is captured whole: embedding, attention over the static cache,
router, the expert executor (it must not sync with the host) and the head. A step with B rows runs
the smallest bucket >= B; unused rows get position -1 (their K/V land in the cache's spare column) and
slot 0 (read but never written), so they disturb nothing.

A graph's shapes are fixed at capture, so it attends over a fixed number of cache positions. Attending over
all of max_context in every step would make each layer gather and read the whole cache (at --max-context
32768 that is 67 MB per layer of a Qwen3-30B-shaped model, tens of microseconds of a step's fixed cost) however
short the sequences are. So graphs are also keyed by a context bucket: the first power of two >= 256 that
holds every row's position (max_context last). The first decode step captures every batch bucket at its
context bucket; a step that needs a (batch, context) pair not captured yet captures it then (Engine.decode_step
keeps that out of the timed step). All graphs share one memory pool (only one replays at a time).

Every graph of one batch bucket reads the same static inputs (row ids, positions, slots) and ends by writing them
for the next step: each row's greedy token (argmax of its logits) and its position + 1 (padding stays at -1). A
greedy decode can so replay step n+1 right behind step n without the host ever seeing step n's tokens in between
(`replay`, Engine.decode_queue); a step fed by the host (`step`) overwrites them first.
"""

from __future__ import annotations

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT_MIN = 256  # smallest context bucket: below it the cache read is a few microseconds anyway


def context_buckets(max_context: int, enabled: bool = True) -> tuple[int, ...]:
    """Cache positions a graph may attend over: 256, 512, ... below max_context, then max_context itself
    (only max_context when disabled)."""
    out, L = [], CONTEXT_MIN
    while enabled and L < max_context:
        out.append(L)
        L *= 2
    return (*out, max_context)


class DecodeGraphs:
    def __init__(self, model, cache, buckets: tuple[int, ...] | None = None, context: bool = True):
        """context: key graphs by context bucket too (False: every graph attends over max_context)."""
        self.model, self.cache = model, cache
        mb = cache.max_batch
        self.buckets = tuple(sorted(set(b for b in (buckets or BUCKETS) if b < mb) | {mb}))
        self.contexts = context_buckets(cache.max_context, context)
        self.device = model.device
        self._pool = None
        self._stage: dict[int, StepInputs] = {}  # batch bucket -> page-locked step inputs
        self._inputs: dict[int, torch.Tensor] = {}  # batch bucket -> the [3, b] inputs its graphs read and feed
        # (batch bucket, context bucket) -> (graph, static inputs, output logits)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}

    def _static(self, b: int, scratch: bool = False) -> dict[str, torch.Tensor]:
        """A graph's inputs: rows ids / positions / slots of one [3, b] device tensor, so a step writes them all
        with one copy from a page-locked staging tensor of the same layout (StepInputs). Shared by the batch
        bucket's graphs (scratch: a private padding-only one, for warm-up runs that must not touch them)."""
        inputs = None if scratch else self._inputs.get(b)
        if inputs is None:
            inputs = torch.zeros(3, b, dtype=torch.long, device=self.device)
            inputs[1] = -1  # padding position
            if not scratch:
                self._inputs[b] = inputs
        return {
            "inputs": inputs,  # [3, b]
            "ids": inputs[0].view(b, 1),  # [b, 1]
            "pos": inputs[1].view(b, 1),  # [b, 1]; -1 = padding
            "slots": inputs[2],  # [b]
        }

    def _run(self, s, L: int):
        kv_len = None if L >= self.cache.max_context else L
        out = self.model(s["ids"], s["pos"], s["slots"], self.cache, last_only=True, kv_len=kv_len)
        feed_back(s["inputs"], out)
        return out

    @torch.no_grad()
    def capture(self, context: int | None = None) -> None:
        """Capture every batch bucket (largest first) at one context bucket (default the smallest)."""
        L = self.contexts[0] if context is None else context
        for b in sorted(self.buckets, reverse=True):
            self.ensure((b, L), sync=False)
        torch.cuda.synchronize()

    @torch.no_grad()
    def ensure(self, key: tuple[int, int], sync: bool = True) -> None:
        """Capture the graph of (batch bucket, context bucket) unless it exists."""
        if key in self.graphs:
            return
        b, L = key
        s = self._static(b)
        warm = self._static(b, scratch=True)  # a greedy chain's fed inputs in s survive a capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture: lazy inits, cuBLAS workspaces
            for _ in range(2):
                self._run(warm, L)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out = self._run(s, L)  # [b, V]
        self._pool = g.pool()
        self.graphs[key] = (g, s, out)
        if sync:
            torch.cuda.synchronize()

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch {n} exceeds the largest graph bucket {self.buckets[-1]}")

    def key(self, n: int, positions: list[int]) -> tuple[int, int]:
        """(batch bucket, context bucket) of a step of n rows at these positions."""
        need = max(positions) + 1
        return self.bucket(n), next(L for L in self.contexts if L >= need)

    def prepare(self, n: int, positions: list[int]) -> tuple[tuple[int, int], bool]:
        """The key of a step of n rows at these positions, its graph captured if missing (the first capture
        takes every batch bucket at that context); -> (key, whether anything was captured)."""
        key = self.key(n, positions)
        if key in self.graphs:
            return key, False
        if not self.graphs:
            self.capture(key[1])
        self.ensure(key)
        return key, True

    @torch.no_grad()
    def step(self, ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """-> logits [B, V] (a view of the graph's output buffer: consume before the next step)."""
        n = len(ids)
        key, _ = self.prepare(n, positions)
        b = key[0]
        g, s, out = self.graphs[key]
        self._staging(b).write(s["inputs"], ids, positions, slots)
        g.replay()
        return out[:n]

    @torch.no_grad()
    def replay(self, n: int, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of the same n rows as the last step of their batch bucket, fed by that step on the device (its
        greedy tokens, positions + 1): no input copy, nothing for the host to wait for. positions are the host's
        count of them (they pick the context bucket; the graph must be captured: prepare()).
        -> (logits [n, V], the next step's fed ids [n]), both views of graph buffers that the next replay reuses."""
        key = self.key(n, positions)
        if key not in self.graphs:
            raise RuntimeError(f"no decode graph captured for {key}: prepare() it before a fed replay")
        g, s, out = self.graphs[key]
        g.replay()
        return out[:n], s["inputs"][0, :n]

    def fed_ids(self, n: int) -> torch.Tensor:
        """The ids the last replay of n rows' bucket wrote for the next step (a view; [n])."""
        return self._inputs[self.bucket(n)][0, :n]

    def _staging(self, b: int) -> "StepInputs":
        st = self._stage.get(b)
        if st is None:
            st = self._stage[b] = StepInputs(b)
        return st


def feed_back(inputs: torch.Tensor, logits: torch.Tensor) -> None:
    """A graph's last kernels: inputs [3, b] := the next greedy step's, row 0 each row's argmax token, row 1 its
    position + 1 (padding rows, at -1, stay there); the slots in row 2 stay."""
    torch.argmax(logits, dim=-1, out=inputs[0])
    pos = inputs[1]
    pos.add_(pos.ge(0))


class StepInputs:
    """A decode step's ids / positions / slots for a graph of b rows, staged in page-locked memory and sent with
    one asynchronous copy. Three copies from pageable tensors (the previous way) each cost the host a staged,
    synchronous transfer before the replay could be queued. The staging tensor is rewritten only after the
    event of its previous copy has passed, so a caller that does not synchronise between steps is still safe."""

    def __init__(self, b: int):
        pin = torch.cuda.is_available()
        self.host = torch.empty(3, b, dtype=torch.long, pin_memory=pin)  # [3, b]
        self.rows = self.host.numpy()  # writes go straight into the page-locked memory
        self.sent = torch.cuda.Event() if pin else None  # recorded after each copy out of self.host

    def fill(self, ids: list[int], positions: list[int], slots: list[int]) -> None:
        """Rows 0..n-1 from the step; padding rows get id 0, position -1 (their K/V land in the spare column) and
        slot 0."""
        n = len(ids)
        if not n == len(positions) == len(slots) or n > self.rows.shape[1]:
            raise ValueError(f"a step of {len(ids)} ids, {len(positions)} positions and {len(slots)} slots "
                             f"does not fit a graph of {self.rows.shape[1]} rows")
        r = self.rows
        r[0, :n], r[1, :n], r[2, :n] = ids, positions, slots
        r[0, n:], r[1, n:], r[2, n:] = 0, -1, 0

    def write(self, dst: torch.Tensor, ids: list[int], positions: list[int], slots: list[int]) -> None:
        """dst [3, b] (a graph's static inputs) := this step's rows, queued on the current stream."""
        if self.sent is not None:
            self.sent.synchronize()  # the previous step's copy has read the staging rows (at once if none)
        self.fill(ids, positions, slots)
        dst.copy_(self.host, non_blocking=self.sent is not None)
        if self.sent is not None:
            self.sent.record()
