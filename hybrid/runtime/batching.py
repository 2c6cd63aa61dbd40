"""The generation loop: continuous batching over a fixed set of KV cache slots, for the CLI and the server.

Each `step()` (1) runs one prefill pass: the next chunk of every prompt that fits, admitting waiting sequences
into free slots, padded size (rows x longest chunk) at most `prefill_chunk` tokens, at least one chunk; a
sequence whose prompt is complete samples its first token; then (2) one batched decode step over every
sequence that has finished its prefill: sample, stream text, stop on a stop token, a stop string or a
length limit, retire. So sequences join and leave the decode batch at step boundaries, and a long prompt is
prefilled in chunks with decode steps in between. Chunk boundaries fall at fixed multiples of `prefill_chunk`
within each prompt, so how a prompt is split never depends on what else is running.

Prefix cache (where the steps keep one: EngineSteps.prefix_caching): a sequence takes the free slot that holds the
longest prefix of its prompt (what an earlier request left there) and prefills only the rest, from the first
position that slot lacks (its first chunk ends at the next multiple of `prefill_chunk`); a slot given back keeps
the prompt and the tokens fed back, as far as its positions hold them, for the next one (hybrid.runtime.prefix_cache).

Decode ahead: when every running row is greedy and the steps offer it (Engine.decode_ahead: on with CUDA
graphs), the loop keeps one step queued beyond the one whose tokens it is reading: step n+1 is queued, fed on
the device with step n's argmax tokens, before the host accepts step n's tokens, so the GPU does not sit idle
while the host reads tokens, streams text and launches the next graph. A row that stops at step n throws away
its share of step n+1; the rows still running keep theirs. Tokens are the ones a step-by-step loop gives.

The loop raises what the model raises, unless `isolate_errors` (the server): then a failing prefill,
sampling or detokenization fails only its own sequence, a failing decode step the sequences in it, each
through `on_error`. Subclasses hook metrics and output through the on_* methods.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections import deque

import torch

from hybrid.runtime.sampling import SamplingParams
from hybrid.runtime.streamer import TextStream

log = logging.getLogger("hybrid.runtime")


def check_token_ids(ids, vocab_size: int | None, index: int = 0) -> list[int]:
    """A prompt's token ids as plain ints, refused (ValueError, one line naming what to change) when there are
    none or one is not an integer in [0, vocab_size): such an id would fail deep in the model (the embedding
    lookup) after the prompt took a KV slot. vocab_size None: the ids' range is not checked (steps without a
    model behind them). How long a prompt may be is the caller's rule (the CLI's and the server's differ)."""
    out = []
    for pos, t in enumerate(ids):
        try:
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt {index}: the token id at position {pos} is {t!r}, not an integer") from None
    if not out:
        raise ValueError(f"prompt {index} is empty")
    if vocab_size is not None and not 0 <= min(out) <= max(out) < vocab_size:
        pos, bad = next((p, t) for p, t in enumerate(out) if not 0 <= t < vocab_size)
        raise ValueError(f"prompt {index}: token id {bad} at position {pos} is outside the vocabulary; "
                         f"ids must be in [0, {vocab_size})")
    return out


class Sequence:
    """One prompt's generation: its limits, its state in the loop and where its output goes (`sink`, for
    the caller's use)."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, sink=None,
                 stop_ids=None):
        self.id = next(Sequence._ids)
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.params = params
        self.sink = sink
        self.stop_ids = stop_ids  # None: the steps' EOS ids
        self.cancelled = False  # set by the server's event loop; read by the engine thread at step boundaries
        self.t_submit = time.monotonic()
        self.slot: int | None = None
        self.sampler = None  # (params, generator): the steps' per-sequence sampling state
        self.stream: TextStream | None = None  # None without a tokenizer: token ids only
        self.keep_special = False  # decode with control tokens kept (the server's tool-call / reasoning markers)
        self.prefilled = 0  # prompt tokens already in the slot's KV cache
        self.cached = 0  # of those, found there by the prefix cache when the sequence took its slot
        self.n_generated = 0  # sampled tokens, a final stop token included
        self.token_ids: list[int] = []  # generated tokens, the stop token left out
        self.last_token = -1
        self.finish_reason: str | None = None  # "stop" | "length"
        self.finished = False

    @property
    def text(self) -> str:
        return self.stream.text if self.stream is not None else ""


class Batcher:
    log = log  # where isolated errors are logged (the server names its own)

    def __init__(self, steps, prefill_chunk: int | None = None, isolate_errors: bool = False,
                 completion_in_context: bool = True):
        """steps: hybrid.runtime.steps.EngineSteps (or the server's adapter over it). prefill_chunk: None =
        a whole prompt per pass. completion_in_context: prompt + completion fit max_context (the server, as
        OpenAI counts it); False: only tokens fed back need a KV position, so the last token may be the one
        at max_context (the CLI)."""
        self.steps = steps
        self.prefill_chunk = prefill_chunk
        self.isolate_errors = isolate_errors
        self.completion_in_context = completion_in_context
        self.waiting: deque[Sequence] = deque()  # the server guards it with its lock (wait_lock)
        self.prefilling: list[Sequence] = []  # hold slots, prompts partly in
        self.running: list[Sequence] = []  # prefilled, decoding
        self.pending = None  # (batch, QueuedStep): queued ahead, its tokens not accepted yet

    # --- hooks (no-ops here) -----------------------------------------------------------------------
    def wait_lock(self):
        """Context manager around every access to `waiting` (the server's condition)."""
        return _NO_LOCK

    def on_started(self, seq: Sequence) -> None: ...

    def on_prefilled(self, n: int, done: bool) -> None: ...

    def on_generated(self, count: int, batch_size: int | None) -> None: ...

    def on_token(self, seq: Sequence, token: int | None, text: str) -> None:
        """A sampled token (None: the stop token, not part of the output) and the text that became final."""

    def on_finished(self, seq: Sequence) -> None: ...

    def on_error(self, seq: Sequence, message: str, status: int) -> None: ...

    def can_admit(self) -> bool:
        return bool(self.steps.free_slots)

    def take_slot(self, seq: Sequence) -> int:
        """A free slot for the sequence: with a prefix cache, the one holding the longest prefix of its prompt,
        whose tokens then need no prefill (seq.prefilled)."""
        if not getattr(self.steps, "prefix_caching", False):
            return self.steps.allocate_slot()
        slot, seq.prefilled = self.steps.allocate_slot_for(seq.prompt_ids)
        seq.cached = seq.prefilled
        return slot

    def open_sampler(self, seq: Sequence):
        """The sequence's sampling state, made once it holds a slot (the server's also takes its prompt and stop ids)."""
        return self.steps.sampler(seq.params)

    def release(self, seq: Sequence) -> None:
        """Give the sequence's slot back; with a prefix cache it keeps what its positions hold: the prompt, then
        every generated token fed back (the steps keep only as many ids as the slot has positions written)."""
        if seq.slot is None:
            return
        try:
            if getattr(self.steps, "prefix_caching", False):
                self.steps.free_slot(seq.slot, seq.prompt_ids + seq.token_ids)
            else:
                self.steps.free_slot(seq.slot)
        except Exception:  # noqa: BLE001 - a bookkeeping bug must not stop the other sequences
            if not self.isolate_errors:
                raise
            self.log.exception("freeing slot %s failed", seq.slot)
        seq.slot = None

    # --- the loop ----------------------------------------------------------------------------------
    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences, all or none: every prompt's ids are checked first (check_token_ids), so a bad one is
        refused with a ValueError before any sequence holds a slot. (The server checks requests itself and
        queues through its own override.)"""
        vocab_size = getattr(self.steps, "vocab_size", None)
        checked = [check_token_ids(s.prompt_ids, vocab_size, i) for i, s in enumerate(seqs)]
        for seq, ids in zip(seqs, checked):
            seq.prompt_ids = ids
        with self.wait_lock():
            self.waiting.extend(seqs)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.pending)

    def step(self) -> bool:
        """One iteration: the queued-ahead step's tokens, or a prefill pass then a decode step. True if any work."""
        if self.pending is not None:
            self._take_queued()
            return True
        progressed = self._prefill()
        progressed |= self._decode()
        return progressed

    def fail(self, seq: Sequence, message: str, status: int = 500) -> None:
        seq.finished = True
        self.release(seq)
        self.on_error(seq, message, status)

    def _peek_waiting(self) -> Sequence | None:
        # Only the loop pops or filters `waiting`, so the head seen here is the one popped next.
        with self.wait_lock():
            return self.waiting[0] if self.waiting else None

    def _start_next(self) -> Sequence | None:
        """Move the oldest waiting sequence into a slot; None if it failed to start."""
        with self.wait_lock():
            seq = self.waiting.popleft()
            self.prefilling.append(seq)  # always in some list: a shutdown finds it
        self.on_started(seq)
        try:
            seq.slot = self.take_slot(seq)
            seq.sampler = self.open_sampler(seq)
            if getattr(self.steps, "tokenizer", None) is not None:
                decode = self.steps.decode
                if seq.keep_special:
                    decode = lambda ids: self.steps.decode(ids, skip_special_tokens=False)  # noqa: E731
                seq.stream = TextStream(decode, seq.params.stop)
        except Exception as exc:  # noqa: BLE001 - fail this request, keep serving the others
            if not self.isolate_errors:
                raise
            self.log.exception("starting a sequence failed")
            self._fail_prefilling(seq, f"could not start the request: {exc}")
            return None
        return seq

    def _fail_prefilling(self, seq: Sequence, message: str) -> None:
        self.prefilling.remove(seq)
        self.fail(seq, message, 500)

    def _next_chunk(self, seq: Sequence, start: int | None = None) -> int:
        """Prompt tokens the sequence's next prefill pass takes from `start` (default: what it has prefilled): the
        rest, or up to the next multiple of prefill_chunk (a reused prefix may end anywhere; chunks keep their fixed
        boundaries)."""
        start = seq.prefilled if start is None else start
        left = len(seq.prompt_ids) - start
        return left if self.prefill_chunk is None else min(self.prefill_chunk - start % self.prefill_chunk, left)

    def cached_prefix(self, seq: Sequence) -> int:
        """Prompt tokens a waiting sequence would find in a slot if it took one now (0 without a prefix cache): sizes
        its first chunk when packing a prefill pass, so a subclass overriding take_slot overrides this too."""
        return self.steps.cached_prefix(seq.prompt_ids) if getattr(self.steps, "prefix_caching", False) else 0

    def _prefill(self) -> bool:
        """One prefill pass over the next chunk of as many sequences as fit (rows x longest chunk <=
        prefill_chunk, at least one row), admitting waiting ones into free slots; True if any work."""
        batch: list[Sequence] = []
        width, progressed = 0, False
        while True:
            if len(batch) < len(self.prefilling):
                seq, new = self.prefilling[len(batch)], False
            else:
                seq, new = (self._peek_waiting() if self.can_admit() else None), True
                if seq is None:
                    break
            w = max(width, self._next_chunk(seq, self.cached_prefix(seq) if new else None))
            if batch and self.prefill_chunk is not None and w * (len(batch) + 1) > self.prefill_chunk:
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
            self.on_prefilled(n, complete)
            if complete:
                done.append(seq)
                done_logits.append(logits)
        if not done:
            return True
        tokens = self._sample(torch.stack(done_logits), done)  # [B, V] in
        for seq, token in zip(done, tokens):
            self.prefilling.remove(seq)
            if token is None:  # its sampling failed: answered, slot freed
                continue
            self.running.append(seq)  # before accepting: a crash in between must not lose it
            self._accept(seq, token)
            if seq.finished:
                self.running.remove(seq)
        self.on_generated(sum(t is not None for t in tokens), None)
        return True

    def _forward_prefill(self, batch: list[Sequence], sizes: list[int]) -> list[tuple]:
        """Prefill the batch in one pass if the steps batch prefill, else (or if that fails) one by one, so a
        request that breaks the model (or a batch too big for memory) fails alone instead of taking its batch
        mates along. (Retrying is safe: no slot's length advances on failure, so the same positions are
        simply rewritten.)"""
        chunks = [s.prompt_ids[s.prefilled : s.prefilled + n] for s, n in zip(batch, sizes)]
        if len(batch) > 1 and self.steps.batch_prefill:
            try:
                logits = self.steps.prefill([s.slot for s in batch], chunks)  # [B, V]
                return [(seq, n, logits[i]) for i, (seq, n) in enumerate(zip(batch, sizes))]
            except Exception as exc:  # noqa: BLE001
                if not self.isolate_errors:
                    raise
                self.log.warning("batched prefill of %d sequences failed (%s); retrying one by one", len(batch), exc)
        out = []
        for seq, n, chunk in zip(batch, sizes, chunks):
            try:
                out.append((seq, n, self.steps.prefill([seq.slot], [chunk])[0]))
            except Exception as exc:  # noqa: BLE001
                if not self.isolate_errors:
                    raise
                self.log.exception("prefill failed")
                self._fail_prefilling(seq, f"prefill failed: {exc}")
        return out

    def _decode(self) -> bool:
        """One decode step over all running sequences (queued ahead when all are greedy); False if none."""
        if not self.running:
            return False
        batch = self.running
        slots, last = [s.slot for s in batch], [s.last_token for s in batch]
        if self.steps.decode_ahead and all(s.params.greedy for s in batch):
            self.pending = (list(batch), self.steps.decode_queue(slots, last))
            return True
        try:
            logits = self.steps.decode_step(slots, last)  # [B, V]
        except Exception as exc:  # noqa: BLE001
            if not self.isolate_errors:
                raise
            self.log.exception("decode step failed")
            for seq in batch:
                self.fail(seq, f"decode step failed: {exc}", 500)
            self.running = []
            return True
        tokens = self._sample(logits, batch)
        for seq, token in zip(batch, tokens):
            if token is not None:  # (None: its sampling failed, the sequence is answered and finished)
                self._accept(seq, token)
        self.running = [s for s in batch if not s.finished]
        self.on_generated(sum(t is not None for t in tokens), len(batch))
        return True

    def _queue_more(self, batch: list[Sequence]) -> bool:
        """Whether to queue another device-fed step behind the queued one: the batch is unchanged, no waiting
        prompt could take a slot, some row could still use the token and every row has a position left."""
        lengths = self.steps.lengths
        return (len(batch) == len(self.running) and all(a is b for a, b in zip(batch, self.running))
                and not (self._peek_waiting() is not None and self.can_admit())
                and any(s.n_generated + 2 <= s.max_tokens for s in batch)
                and all(lengths[s.slot] < self.steps.max_context for s in batch)
                and self.steps.can_feed([s.slot for s in batch]))

    def _take_queued(self) -> None:
        batch, step = self.pending
        # queue the next step first, so the GPU keeps working while the host takes this one's tokens
        self.pending = (batch, self.steps.decode_queue([s.slot for s in batch])) if self._queue_more(batch) else None
        taken = 0
        for seq, token in zip(batch, step.tokens()):
            if not seq.finished:  # a row that stopped one step earlier drops what was queued past its end
                self._accept(seq, token)
                taken += 1
        self.running = [s for s in self.running if not s.finished]
        self.on_generated(taken, len(batch))

    def _sample(self, logits, seqs: list[Sequence]) -> list[int | None]:
        """One token per row of logits [B, V]. Isolating errors, a failed batched call is retried row by row so
        only the sequences whose own sampling fails are answered with an error (None in their place): one
        request's parameters must never fail its batch mates."""
        try:
            return self.steps.sample(logits, [s.sampler for s in seqs])
        except Exception as exc:  # noqa: BLE001
            if not self.isolate_errors:
                raise
            self.log.warning("batched sampling of %d rows failed (%s); sampling row by row", len(seqs), exc)
        out: list[int | None] = []
        for i, seq in enumerate(seqs):
            try:
                out.append(self.steps.sample(logits[i : i + 1], [seq.sampler])[0])
            except Exception as exc:  # noqa: BLE001
                self.log.exception("sampling failed")
                self.fail(seq, f"sampling failed: {exc}", 500)
                out.append(None)
        return out

    def _accept(self, seq: Sequence, token: int) -> None:
        try:
            self._account(seq, token)
        except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer choking on an id: fail only this one
            if not self.isolate_errors:
                raise
            self.log.exception("handling a generated token failed")
            self.fail(seq, f"could not decode the output: {exc}", 500)

    def _account(self, seq: Sequence, token: int) -> None:
        """One sampled token: stream its text, or end the sequence (stop token, stop string, length)."""
        seq.n_generated += 1
        seq.last_token = token
        stream = seq.stream
        stop_ids = self.steps.eos_token_ids if seq.stop_ids is None else seq.stop_ids
        reason = None
        if token in stop_ids:
            text = stream.finish() if stream is not None else ""
            reason, token = "stop", None
        else:
            seq.token_ids.append(token)
            text = stream.push(token) if stream is not None else ""
            # the room a completion has: prompt + completion <= max_context, or one more token where the
            # last one is never fed back
            room = self.steps.max_context - len(seq.prompt_ids) + (0 if self.completion_in_context else 1)
            if stream is not None and stream.stopped:
                reason = "stop"
            elif seq.n_generated >= seq.max_tokens or seq.n_generated >= room:
                text += stream.finish() if stream is not None else ""
                reason = "length"
        self.on_token(seq, token, text)
        if reason is None:
            return
        seq.finish_reason = reason
        seq.finished = True
        self.release(seq)
        self.on_finished(seq)

    def run(self) -> None:
        """Step until every sequence has ended (the CLI's use; the server steps from its own thread). However
        it ends (the model or a stream callback raising, KeyboardInterrupt) the sequences still in the loop
        are dropped and their slots freed, so the engine's next call finds every slot it had. Waiting
        prompts with no free slot and nothing running that could free one raise instead of spinning."""
        try:
            while self.busy:
                if not self.step():
                    raise RuntimeError(self._stuck_message())
        finally:
            self.drop_all()

    def _stuck_message(self) -> str:
        return (f"{len(self.waiting)} prompt(s) wait for a KV slot, but none is free and nothing running could free "
                "one: every slot is held outside this generation (an open Conversation, or allocate_slot() "
                "without free_slot()); free one first")

    def drop_all(self) -> None:
        """Forget every sequence the loop holds, waiting or started, freeing their slots (an exit before they
        ended). Each release is tried even if another one fails: one bookkeeping bug must not leak the rest."""
        with self.wait_lock():
            self.waiting.clear()
        held, self.prefilling, self.running, self.pending = self.prefilling + self.running, [], [], None
        for seq in held:
            seq.finished = True
            try:
                self.release(seq)
            except Exception:  # noqa: BLE001 - keep freeing the others; the exit's own error is the one to see
                self.log.exception("freeing slot %s failed", seq.slot)


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_LOCK = _NoLock()
