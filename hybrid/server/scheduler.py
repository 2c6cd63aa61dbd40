"""The engine thread: the runtime's generation loop (hybrid.runtime.batching.Batcher) behind a queue.

One thread owns the model and steps the loop: each iteration it drops sequences whose clients went away
and frees their slots, then runs one prefill pass (chunks of at most `prefill_chunk` padded tokens, so a
long prompt is prefilled in chunks with decode steps in between) and one batched decode step; see the
loop's module for the rules. Errors are isolated per request, and every step is counted in the metrics.

The event loop never waits on this thread: it submits sequences (non-blocking, or 429 when the queue
is full), and the thread pushes events back through each sequence's `sink` (a thread-safe callback).
Every accepted sequence ends with exactly one terminal event, "done" or "error" (even when the model
raises or the server shuts down) unless its client cancelled it, in which case nobody is listening.

Logprobs travel with the text: each "text" event carries the records (hybrid.runtime.sampling.TokenLogprob)
of the tokens sampled since the previous event, "done" the rest; a sequence whose prompt is scored (echo with
logprobs) first gets a "prompt" event with the prompt's records. Its sampler is opened once it holds a slot
(the prompt for the repetition penalty, its stop ids for min_tokens) and closed with the slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from hybrid.runtime.batching import Batcher, Sequence
from hybrid.server.metrics import Metrics

__all__ = ["Event", "QueueFull", "Scheduler", "Sequence"]

log = logging.getLogger("hybrid.server")


@dataclass
class Event:
    kind: str  # "prompt" (the prompt's logprobs), "text" (a delta), "done" (terminal), "error" (terminal)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" on done
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    status: int = 500  # HTTP status for an error event
    logprobs: list | None = None  # TokenLogprob records (only when the request asked for logprobs)


class QueueFull(Exception):
    pass


class Scheduler(Batcher):
    def __init__(self, runtime, metrics: Metrics, max_queue: int, prefill_chunk: int):
        super().__init__(runtime, prefill_chunk=prefill_chunk, isolate_errors=True)
        self.runtime = runtime  # hybrid.server.adapter.Runtime
        self.log = log
        self.metrics = metrics
        self.max_queue = max_queue
        self._cond = threading.Condition()  # guards `waiting`
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- event-loop side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hybrid-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():  # the engine thread, the sampler's only user, ended
            self._shutdown_sampling()

    def _shutdown_sampling(self) -> None:
        """Stop the sampler's grammar mask threads (a runtime without a BatchSampler has none)."""
        sampling = getattr(self.runtime, "sampling", None)
        if sampling is not None:
            sampling.shutdown()

    @property
    def alive(self) -> bool:
        # _stopping is set before a crashing loop fails its requests, so a client that got the
        # crash's 500 sees 503 here right after, not a thread that is still unwinding.
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue all choices of a request together, or none (QueueFull)."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise QueueFull
            self.waiting.extend(seqs)
            self._cond.notify()

    def cancel(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            s.cancelled = True
        with self._cond:
            self._cond.notify()

    def stats(self) -> dict:
        prefilling = len(self.prefilling)
        engine_stats = getattr(getattr(self.runtime, "engine", None), "stats", None)
        prefix = {k: int(getattr(engine_stats, k, 0)) for k in ("prefix_lookups", "prefix_hits", "prefix_tokens_reused")}
        return {"running": len(self.running) + prefilling, "prefilling": prefilling,
                "waiting": len(self.waiting), "free_slots": self.runtime.free_slots,
                "max_batch": self.runtime.max_batch, **prefix}

    # --- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self.busy):
                        self._cond.wait()
                    if self._stopping:
                        break
                self._reap_cancelled()
                if not self.step() and self.waiting:
                    # Waiting work, no free slot, nothing holding one: a leaked slot. Say so and
                    # back off instead of spinning a core; cancellations can still be reaped.
                    log.error("no free KV slot and nothing running: %d sequences stuck waiting",
                              len(self.waiting))
                    with self._cond:
                        self._cond.wait(1.0)
        except BaseException:  # noqa: BLE001 - a bug here must not strand any request
            log.exception("engine loop crashed")
            self._fail_all("the engine stopped unexpectedly", 500)
            raise
        self._fail_all("the server is shutting down", 503)

    def _reap_cancelled(self) -> None:
        for seq in self.running + self.prefilling:
            if seq.cancelled:
                self.metrics.sequence_cancelled()
                seq.finished = True
                self.release(seq)
        self.running = [s for s in self.running if not s.finished]
        self.prefilling = [s for s in self.prefilling if not s.finished]
        with self._cond:
            gone = [s for s in self.waiting if s.cancelled]
            if gone:  # never started: no slot to free, but they count as cancelled all the same
                self.waiting = deque(s for s in self.waiting if not s.cancelled)
        for seq in gone:
            self.metrics.sequence_cancelled()
            seq.finished = True

    def _fail_all(self, message: str, status: int) -> None:
        with self._cond:
            self._stopping = True
            pending = list(self.waiting) + self.running + self.prefilling
            self.waiting.clear()
        self.running, self.prefilling = [], []
        for seq in pending:
            if not seq.finished:
                self.fail(seq, message, status)

    # --- the loop's hooks: slots and samplers ------------------------------------------------------
    def take_slot(self, seq: Sequence) -> int:
        """A scored prompt takes an empty slot: the prefix cache's tokens would skip the prefill that scores them."""
        if seq.params.prompt_logprobs is not None:
            return self.steps.allocate_slot()
        return super().take_slot(seq)

    def cached_prefix(self, seq: Sequence) -> int:
        return 0 if seq.params.prompt_logprobs is not None else super().cached_prefix(seq)

    def open_sampler(self, seq: Sequence):
        ends = self.runtime.eos_token_ids if seq.stop_ids is None else seq.stop_ids
        return self.runtime.open_sampler(seq.params, seq.prompt_ids, seq.slot, ends)

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        if seq.sampler is not None:
            self.runtime.close_sampler(seq.sampler)

    # --- the loop's hooks: metrics and events ------------------------------------------------------
    def wait_lock(self):
        return self._cond

    def on_started(self, seq: Sequence) -> None:
        self.metrics.observe_sequence(queue_wait_s=time.monotonic() - seq.t_submit)

    def on_prefilled(self, n: int, done: bool) -> None:
        self.metrics.prefilled(n, done=done)

    def on_generated(self, count: int, batch_size: int | None) -> None:
        if batch_size is None:
            self.metrics.generated(count)
        else:
            self.metrics.generated(count, batch_size=batch_size)

    def on_token(self, seq: Sequence, token: int | None, text: str) -> None:
        if seq.n_generated == 1:
            self.metrics.observe_sequence(ttft_s=time.monotonic() - seq.t_submit)
            if seq.params.prompt_logprobs is not None:
                seq.sink(Event("prompt", logprobs=seq.sampler.prompt_records))
        records = None
        if seq.params.logprobs is not None:
            records = seq.sampler.records
            if token is None and records:  # the stop token ends the text and is not part of it
                records.pop()
        if text:
            if records is not None:
                records = seq.sampler.take_records()
            seq.sink(Event("text", text=text, logprobs=records))

    def on_finished(self, seq: Sequence) -> None:
        self.metrics.observe_sequence(duration_s=time.monotonic() - seq.t_submit)
        records = seq.sampler.take_records() if seq.params.logprobs is not None else None
        seq.sink(Event("done", finish_reason=seq.finish_reason, prompt_tokens=len(seq.prompt_ids),
                       completion_tokens=seq.n_generated, logprobs=records))

    def on_error(self, seq: Sequence, message: str, status: int) -> None:
        if not seq.cancelled:
            seq.sink(Event("error", error=message, status=status))
