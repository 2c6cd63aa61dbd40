"""The engine thread: continuous batching over a fixed set of KV cache slots.

One thread owns the model. Each iteration it (1) drops sequences whose clients went away and frees their
slots, (2) runs one prefill pass: the next chunk of every prompt that fits, admitting waiting ones into
free slots, padded size (rows x longest chunk) at most `prefill_chunk` tokens, at least one chunk, and
(3) runs one batched decode step over every sequence that has finished its prefill. So sequences join
and leave the decode batch at step boundaries, a burst of short prompts is prefilled in one pass, and a
long prompt is prefilled in chunks (the engine's prefill appends to what a slot holds) with decode steps
in between: running sequences wait at most one chunk's worth of prefill per token, however long the new
prompts are. Chunk boundaries fall at fixed multiples of `prefill_chunk` within each prompt, so how a
prompt is split never depends on what else is running.

The event loop never waits on this thread: it submits sequences (non-blocking, or 429 when the queue
is full), and the thread pushes events back through each sequence's `sink` (a thread-safe callback).
Every accepted sequence ends with exactly one terminal event, "done" or "error" (even when the model
raises or the server shuts down) unless its client cancelled it, in which case nobody is listening.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from hybrid.server.detok import TextStream
from hybrid.server.metrics import Metrics
from hybrid.server.schemas import SamplingParams

log = logging.getLogger("hybrid.server")


@dataclass
class Event:
    kind: str  # "text" (a delta), "done" (terminal), "error" (terminal)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" on done
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    status: int = 500  # HTTP status for an error event


class QueueFull(Exception):
    pass


class Sequence:
    """One choice of one request: a prompt, its limits, and where its output goes."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
                 sink: Callable[[Event], None]):
        self.id = next(Sequence._ids)
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.params = params
        self.sink = sink
        self.cancelled = False  # set by the event loop; read by the engine thread at step boundaries
        self.t_submit = time.monotonic()
        self.slot: int | None = None
        self.sampler = None  # the runtime's per-sequence sampling state (params + seeded generator)
        self.stream: TextStream | None = None
        self.prefilled = 0  # prompt tokens already in the slot's KV cache
        self.n_generated = 0
        self.last_token = -1
        self.finished = False


class Scheduler:
    def __init__(self, runtime, metrics: Metrics, max_queue: int, prefill_chunk: int):
        self.runtime = runtime  # hybrid.server.adapter.Runtime
        self.metrics = metrics
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()  # guarded by _cond
        self._prefilling: list[Sequence] = []  # engine thread only: hold slots, prompts partly in
        self._running: list[Sequence] = []  # engine thread only: prefilled, decoding
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
            if len(self._waiting) + len(seqs) > self.max_queue:
                raise QueueFull
            self._waiting.extend(seqs)
            self._cond.notify()

    def cancel(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            s.cancelled = True
        with self._cond:
            self._cond.notify()

    def stats(self) -> dict:
        prefilling = len(self._prefilling)
        return {"running": len(self._running) + prefilling, "prefilling": prefilling,
                "waiting": len(self._waiting), "free_slots": self.runtime.free_slots,
                "max_batch": self.runtime.max_batch}

    # --- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or self._running or self._prefilling):
                        self._cond.wait()
                    if self._stopping:
                        break
                self._reap_cancelled()
                progressed = self._prefill()
                progressed |= self._decode()
                if not progressed and self._waiting:
                    # Waiting work, no free slot, nothing holding one: a leaked slot. Say so and
                    # back off instead of spinning a core; cancellations can still be reaped.
                    log.error("no free KV slot and nothing running: %d sequences stuck waiting",
                              len(self._waiting))
                    with self._cond:
                        self._cond.wait(1.0)
        except BaseException:  # noqa: BLE001 - a bug here must not strand any request
            log.exception("engine loop crashed")
            self._fail_all("the engine stopped unexpectedly", 500)
            raise
        self._fail_all("the server is shutting down", 503)

    def _fail_prefilling(self, seq: Sequence, message: str) -> None:
        self._prefilling.remove(seq)
        self._fail(seq, message, 500)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is None:
            return
        try:
            self.runtime.free_slot(seq.slot)
        except Exception:  # noqa: BLE001 - a bookkeeping bug must not stop the other sequences
            log.exception("freeing slot %s failed", seq.slot)
        seq.slot = None

    def _reap_cancelled(self) -> None:
        for seq in self._running + self._prefilling:
            if seq.cancelled:
                self.metrics.sequence_cancelled()
                seq.finished = True
                self._release(seq)
        self._running = [s for s in self._running if not s.finished]
        self._prefilling = [s for s in self._prefilling if not s.finished]
        with self._cond:
            gone = [s for s in self._waiting if s.cancelled]
            if gone:  # never started: no slot to free, but they count as cancelled all the same
                self._waiting = deque(s for s in self._waiting if not s.cancelled)
        for seq in gone:
            self.metrics.sequence_cancelled()
            seq.finished = True

    def _peek_waiting(self) -> Sequence | None:
        # Only this thread pops or filters _waiting, so the head seen here is the one popped next.
        with self._cond:
            return self._waiting[0] if self._waiting else None

    def _start_next(self) -> Sequence | None:
        """Move the oldest waiting sequence into a free slot; None if it failed to start."""
        with self._cond:
            seq = self._waiting.popleft()
            self._prefilling.append(seq)  # always in some list: _fail_all finds it
        self.metrics.observe_sequence(queue_wait_s=time.monotonic() - seq.t_submit)
        try:
            seq.slot = self.runtime.allocate_slot()
            seq.sampler = self.runtime.sampler(seq.params)
            seq.stream = TextStream(self.runtime.decode, seq.params.stop)
        except Exception as exc:  # noqa: BLE001 - fail this request, keep serving the others
            log.exception("starting a sequence failed")
            self._fail_prefilling(seq, f"could not start the request: {exc}")
            return None
        return seq

    def _next_chunk(self, seq: Sequence) -> int:
        # Chunks start at multiples of prefill_chunk within each prompt, whatever else is batched.
        return min(self.prefill_chunk, len(seq.prompt_ids) - seq.prefilled)

    def _prefill(self) -> bool:
        """One prefill pass over the next chunk of as many sequences as fit (rows x longest chunk <=
        prefill_chunk, at least one row), admitting waiting ones into free slots; True if any work."""
        batch: list[Sequence] = []
        width, progressed = 0, False
        while True:
            if len(batch) < len(self._prefilling):
                seq, new = self._prefilling[len(batch)], False
            else:
                seq, new = (self._peek_waiting() if self.runtime.free_slots else None), True
                if seq is None:
                    break
            w = max(width, self._next_chunk(seq))
            if batch and w * (len(batch) + 1) > self.prefill_chunk:
                break  # would pad past the budget: next iteration, after a decode step
            if new:
                progressed = True
                if self._start_next() is None:
                    continue  # failed and answered; try the next one
            batch.append(seq)
            width = w
        if not batch:
            return progressed
        sizes = [self._next_chunk(s) for s in batch]
        rows = self._forward_prefill(batch, sizes)  # [(seq, chunk size, logits [V])] that succeeded
        done, done_logits = [], []  # sequences whose prompt is now complete sample their first token
        for seq, n, logits in rows:
            seq.prefilled += n
            complete = seq.prefilled == len(seq.prompt_ids)
            self.metrics.prefilled(n, done=complete)
            if complete:
                done.append(seq)
                done_logits.append(logits)
        if not done:
            return True
        tokens = self._sample(torch.stack(done_logits), done)  # [B, V] in
        for seq, token in zip(done, tokens):
            self._prefilling.remove(seq)
            if token is None:  # its sampling failed: answered, slot freed
                continue
            self._running.append(seq)  # before _emit: a crash in between must not lose it
            self._emit(seq, token)
            if seq.finished:
                self._running.remove(seq)
        self.metrics.generated(sum(t is not None for t in tokens))
        return True

    def _forward_prefill(self, batch: list[Sequence], sizes: list[int]) -> list[tuple]:
        """Prefill the batch in one pass if the runtime batches prefill, else (or if that fails) one by
        one, so a request that breaks the model (or a batch too big for memory) fails alone instead
        of taking its batch mates along. (Retrying is safe: the runtime advances no slot's length on
        failure, so the same positions are simply rewritten.)"""
        chunks = [s.prompt_ids[s.prefilled : s.prefilled + n] for s, n in zip(batch, sizes)]
        if len(batch) > 1 and self.runtime.batch_prefill:
            try:
                logits = self.runtime.prefill([s.slot for s in batch], chunks)  # [B, V]
                return [(seq, n, logits[i]) for i, (seq, n) in enumerate(zip(batch, sizes))]
            except Exception as exc:  # noqa: BLE001
                log.warning("batched prefill of %d sequences failed (%s); retrying one by one", len(batch), exc)
        out = []
        for seq, n, chunk in zip(batch, sizes, chunks):
            try:
                out.append((seq, n, self.runtime.prefill([seq.slot], [chunk])[0]))
            except Exception as exc:  # noqa: BLE001
                log.exception("prefill failed")
                self._fail_prefilling(seq, f"prefill failed: {exc}")
        return out

    def _decode(self) -> bool:
        """One decode step over all running sequences; False if there were none."""
        if not self._running:
            return False
        batch = self._running
        try:
            logits = self.runtime.decode_step([s.slot for s in batch], [s.last_token for s in batch])  # [B, V]
        except Exception as exc:  # noqa: BLE001
            log.exception("decode step failed")
            for seq in batch:
                self._fail(seq, f"decode step failed: {exc}", 500)
            self._running = []
            return True
        tokens = self._sample(logits, batch)
        for seq, token in zip(batch, tokens):
            if token is not None:  # (None: its sampling failed, the sequence is answered and finished)
                self._emit(seq, token)
        self._running = [s for s in batch if not s.finished]
        self.metrics.generated(sum(t is not None for t in tokens), batch_size=len(batch))
        return True

    def _sample(self, logits, seqs: list[Sequence]) -> list[int | None]:
        """One token per row of logits [B, V]. If the batched call fails, each row is sampled alone so
        only the sequences whose own sampling fails are answered with an error (None in their place):
        one request's parameters must never fail its batch mates."""
        try:
            return self.runtime.sample(logits, [s.sampler for s in seqs])
        except Exception as exc:  # noqa: BLE001
            log.warning("batched sampling of %d rows failed (%s); sampling row by row", len(seqs), exc)
        out: list[int | None] = []
        for i, seq in enumerate(seqs):
            try:
                out.append(self.runtime.sample(logits[i : i + 1], [seq.sampler])[0])
            except Exception as exc:  # noqa: BLE001
                log.exception("sampling failed")
                self._fail(seq, f"sampling failed: {exc}", 500)
                out.append(None)
        return out

    def _emit(self, seq: Sequence, token: int) -> None:
        """Account one generated token: stream its text, or end the sequence."""
        try:
            self._account(seq, token)
        except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer choking on an id: fail only this one
            log.exception("handling a generated token failed")
            self._fail(seq, f"could not decode the output: {exc}", 500)

    def _account(self, seq: Sequence, token: int) -> None:
        seq.n_generated += 1
        seq.last_token = token
        if seq.n_generated == 1:
            self.metrics.observe_sequence(ttft_s=time.monotonic() - seq.t_submit)
        reason = None
        if token in self.runtime.eos_token_ids:
            text = seq.stream.finish()
            reason = "stop"
        else:
            text = seq.stream.push(token)
            if seq.stream.stopped:
                reason = "stop"
            elif (seq.n_generated >= seq.max_tokens
                  or len(seq.prompt_ids) + seq.n_generated >= self.runtime.max_context):
                text += seq.stream.finish()
                reason = "length"
        if text:
            seq.sink(Event("text", text=text))
        if reason is None:
            return
        seq.finished = True
        self._release(seq)
        self.metrics.observe_sequence(duration_s=time.monotonic() - seq.t_submit)
        seq.sink(Event("done", finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
                       completion_tokens=seq.n_generated))

    def _fail(self, seq: Sequence, message: str, status: int) -> None:
        seq.finished = True
        self._release(seq)
        if not seq.cancelled:
            seq.sink(Event("error", error=message, status=status))

    def _fail_all(self, message: str, status: int) -> None:
        with self._cond:
            self._stopping = True
            pending = list(self._waiting) + self._running + self._prefilling
            self._waiting.clear()
        self._running, self._prefilling = [], []
        for seq in pending:
            if not seq.finished:
                self._fail(seq, message, status)
