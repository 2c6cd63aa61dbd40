"""Server metrics in the Prometheus text exposition format (version 0.0.4), no client library needed.

Counters and gauges are updated from the event loop (requests) and the engine thread (tokens, batch
sizes), so every update takes one lock. `expert_split` is the hook for the hybrid MoE layer: a callable
returning {layer: (cold experts run on the CPU, cold experts shipped to the GPU)}, cumulative, read at
scrape time (the adapter reads the hybrid executors' own counters). With no hybrid layer it returns {}
and those series are absent (not zero), so dashboards can tell "no hybrid layer" from "all shipped".
`device` (the engine's device type) gives hybrid_device_info; without CUDA the cold-expert series carry a
device="cpu" label, since their "shipped" lane is then a DRAM copy for torch on the CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

log = logging.getLogger("hybrid.server")

TOKENS_PER_S_WINDOW_S = 10.0  # tokens/s is averaged over this trailing window


# Latency buckets in seconds: from one fast decode step to a long generation on a slow box.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    """Cumulative buckets + sum + count, as Prometheus histograms are exposed (callers hold the lock)."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> list[tuple[str, dict, float]]:
        out = [("_bucket", {"le": f"{b:g}"}, c) for b, c in zip(self.buckets, self.counts)]
        out.append(("_bucket", {"le": "+Inf"}, self.count))
        return out + [("_sum", {}, round(self.sum, 6)), ("_count", {}, self.count)]


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


class Metrics:
    def __init__(self, expert_split: Callable[[], dict[int, tuple[int, int]]] = dict, device: str | None = None):
        self._lock = threading.Lock()
        self.expert_split = expert_split
        # the engine's device type ("cuda", "cpu"; None: unknown, e.g. a fake runtime): exposed as
        # hybrid_device_info, and on a run without CUDA the cold-expert series carry device="cpu", because
        # their "shipped" lane is then a copy within DRAM for torch on the CPU, not a transfer to a GPU
        self.device = None if device is None else str(device).split(":")[0]
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cancelled = 0  # sequences ended because the client went away (running or queued)
        self.decode_steps = 0
        self.decode_rows = 0  # sum of batch sizes over decode steps
        self.prefills = 0
        self.last_batch_size = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for tokens/s
        self._started = time.monotonic()
        # per sequence: waiting for a slot, until its first token, whole life (submit to last token)
        self.queue_wait = Histogram()
        self.time_to_first_token = Histogram()
        self.sequence_duration = Histogram()

    # --- updates -------------------------------------------------------------------------------
    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def prefilled(self, prompt_tokens: int, done: bool = True) -> None:
        """A prefill chunk ran; `done` = it completed its prompt."""
        with self._lock:
            self.prefills += int(done)
            self.prompt_tokens += prompt_tokens

    def generated(self, tokens: int, batch_size: int | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            self.generation_tokens += tokens
            self._recent.append((now, tokens))
            self._trim(now)  # bounded even when nobody scrapes
            if batch_size is not None:
                self.decode_steps += 1
                self.decode_rows += batch_size
                self.last_batch_size = batch_size

    def sequence_cancelled(self) -> None:
        with self._lock:
            self.cancelled += 1

    def observe_sequence(self, queue_wait_s: float | None = None, ttft_s: float | None = None,
                         duration_s: float | None = None) -> None:
        with self._lock:
            for hist, value in ((self.queue_wait, queue_wait_s), (self.time_to_first_token, ttft_s),
                                (self.sequence_duration, duration_s)):
                if value is not None:
                    hist.observe(value)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - TOKENS_PER_S_WINDOW_S:
            self._recent.popleft()

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            # a server up for 2 s has a 2 s window, not 10 s of which 8 never happened
            span = max(min(TOKENS_PER_S_WINDOW_S, now - self._started), 1e-3)
            return sum(n for _, n in self._recent) / span

    # --- exposition ----------------------------------------------------------------------------
    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """Prometheus text; `gauges` are live values from the scheduler: name -> (help, value)."""
        tps = self.tokens_per_s()
        out: list[str] = []

        def family(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{_labels(labels)} {value}")

        with self._lock:
            family("hybrid_requests_total", "counter", "HTTP requests on the OpenAI endpoints, by status.",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            family("hybrid_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [({}, self.prompt_tokens)])
            family("hybrid_generation_tokens_total", "counter", "Tokens generated.", [({}, self.generation_tokens)])
            family("hybrid_sequences_cancelled_total", "counter",
                   "Sequences stopped because their client went away, running or still queued.", [({}, self.cancelled)])
            family("hybrid_prefills_total", "counter", "Prompts prefilled.", [({}, self.prefills)])
            family("hybrid_decode_steps_total", "counter", "Batched decode steps.", [({}, self.decode_steps)])
            family("hybrid_decode_batch_rows_total", "counter",
                   "Sum of decode batch sizes (divide by decode steps for the mean batch).", [({}, self.decode_rows)])
            family("hybrid_decode_batch_size", "gauge", "Sequences in the last decode step.",
                   [({}, self.last_batch_size)])
            for name, hist, help_ in (
                    ("hybrid_queue_wait_seconds", self.queue_wait, "Time a sequence waited for a KV slot."),
                    ("hybrid_time_to_first_token_seconds", self.time_to_first_token,
                     "Time from submission to a sequence's first token."),
                    ("hybrid_sequence_duration_seconds", self.sequence_duration,
                     "Time from submission to a sequence's last token.")):
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} histogram")
                out.extend(f"{name}{suffix}{_labels(labels)} {v}" for suffix, labels, v in hist.samples())
        family("hybrid_generation_tokens_per_second", "gauge",
               f"Generated tokens per second over the last {TOKENS_PER_S_WINDOW_S:g} s.", [({}, round(tps, 3))])
        for name, (help_, value) in gauges.items():
            family(name, "gauge", help_, [({}, value)])
        try:
            split = self.expert_split()
        except Exception:  # noqa: BLE001 - a broken hook must not take the other metrics down
            log.exception("reading the expert split failed")
            split = {}
        from hybrid.runtime.device_role import gpu_role, is_cuda

        if self.device is not None:
            family("hybrid_device_info", "gauge",
                   "Device of the model's GPU side (1): cuda, or cpu when torch on the CPU plays the GPU's role "
                   "(no VRAM, no PCIe: the ship lane then copies weights within DRAM).",
                   [({"device": self.device, "gpu_role": gpu_role(self.device)}, 1)])
        if split:
            cpu_only = self.device is not None and not is_cuda(self.device)
            extra = {"device": self.device} if cpu_only else {}
            ship = ("shipped = copied within DRAM for torch on the CPU (no GPU on this run)" if cpu_only
                    else "shipped to the GPU")
            family("hybrid_cold_experts_total", "counter",
                   f"Cold experts with tokens, per MoE layer, by lane: run on the CPU executor or {ship}.",
                   [({"layer": l, "lane": lane, **extra}, n) for l, (c, s) in split.items()
                    for lane, n in (("cpu", c), ("shipped", s))])
            family("hybrid_cold_expert_cpu_share", "gauge",
                   f"Share of cold experts run on the CPU executor (rest {ship}), per MoE layer.",
                   [({"layer": l, **extra}, round(c / (c + s), 6) if c + s else 0.0) for l, (c, s) in split.items()])
        return "\n".join(out) + "\n"
