"""EngineSteps: the model steps the generation loop (hybrid.runtime.batching) drives, over an Engine.

    allocate_slot() -> slot;  free_slot(slot, held=None);  free_slots (count);  lengths[slot]
    allocate_slot_for(prompt_ids) -> (slot, prompt tokens it holds already);  cached_prefix(prompt_ids) -> int;
    prefix_caching (whether the engine keeps what free slots hold: hybrid.runtime.prefix_cache)
    prefill(slots, chunks) -> logits [B, V];  decode_step(slots, tokens) -> logits [B, V]
    decode_queue(slots, tokens=None) -> QueuedStep;  can_feed(slots);  decode_ahead
    sampler(SamplingParams) -> a sequence's (params, generator);  sample(logits [B, V], samplers) -> ids
    decode(ids) -> text (None without a tokenizer);  eos_token_ids;  max_batch, max_context, device;
    vocab_size (None: unknown)

The CLI drives it as it is; the server's adapter (hybrid.server.adapter.Runtime) adds the tokenizer's
request-side work on top.
"""

from __future__ import annotations

import time

from hybrid.runtime.sampling import SamplingParams, sample


class EngineSteps:
    def __init__(self, engine, tokenizer=None, batch_prefill: bool = False):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch = getattr(engine, "max_batch", None)
        self.max_context = engine.max_context
        self.device = engine.device
        # prompt ids index the embedding table, so its size (not the tokenizer's) bounds them (Batcher.submit);
        # None where the engine has no model config (test doubles): the ids' range is then not checked
        self.vocab_size = getattr(getattr(getattr(engine, "model", None), "cfg", None), "vocab_size", None)
        self.eos_token_ids = frozenset(engine.default_stop_ids())
        # several prompts in one padded forward (the server's bursts); one engine.prefill each otherwise
        self.batch_prefill = batch_prefill
        # greedy steps queued ahead of the host (Engine.decode_queue), where the engine offers them
        self.decode_ahead = bool(getattr(engine, "decode_ahead", False))
        # slots given back keep their tokens' K/V for later prompts (False: engines without it, test doubles)
        self.prefix_caching = getattr(engine, "prefix_cache", None) is not None

    # text
    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    # KV slots
    def allocate_slot(self) -> int:
        return self.engine.allocate_slot()

    def allocate_slot_for(self, prompt_ids: list[int]) -> tuple[int, int]:
        """(a free slot for this prompt, how many of its first tokens the slot holds already: with the prefix cache,
        those the prompt shares with what a request left there; else an empty slot, 0)."""
        if not self.prefix_caching:
            return self.engine.allocate_slot(), 0
        slot = self.engine.allocate_slot_for(prompt_ids)
        return slot, self.engine.lengths[slot]

    def cached_prefix(self, prompt_ids: list[int]) -> int:
        """The prompt tokens allocate_slot_for would find in a slot now (0 without the prefix cache)."""
        return self.engine.cached_prefix(prompt_ids) if self.prefix_caching else 0

    def free_slot(self, slot: int, held: list[int] | None = None) -> None:
        """held: the ids whose K/V the slot's positions hold, kept for later prompts with the prefix cache."""
        if self.prefix_caching:
            self.engine.free_slot(slot, held)
        else:
            self.engine.free_slot(slot)

    @property
    def free_slots(self) -> int:
        return self.engine.free_slots

    @property
    def lengths(self) -> list[int]:
        return self.engine.lengths

    # model steps
    def prefill(self, slots: list[int], chunks: list[list[int]]):
        """Append chunks[i] to slot i's cache -> logits [B, V] after each chunk. Several slots in one forward
        only when `batch_prefill`; the loop asks one by one otherwise. On failure no slot's length has
        advanced, so a retry rewrites the same positions."""
        import torch

        if len(slots) == 1:  # the engine's own path (causal flash SDPA)
            return self.engine.prefill(slots[0], chunks[0])[None]
        # Engine.prefill takes one slot; a burst of short prompts would cost one model pass each (and
        # on a GPU one Python loop of small ops each). So: one right-padded forward over all of them
        # (position -1 = padding, which writes nothing), more tokens per expert as well. Engine.forward
        # does not advance the slots' lengths (tokens held per slot), so this does.
        eng = self.engine
        B, T = len(chunks), max(len(c) for c in chunks)
        ids = torch.zeros(B, T, dtype=torch.long)  # [B, T]
        pos = torch.full((B, T), -1, dtype=torch.long)  # [B, T]
        for i, (slot, chunk) in enumerate(zip(slots, chunks)):
            start = eng.lengths[slot]
            if start + len(chunk) > eng.max_context:
                raise ValueError(f"{start + len(chunk)} tokens exceed max_context {eng.max_context}")
            ids[i, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
            pos[i, : len(chunk)] = torch.arange(start, start + len(chunk))
        t0 = time.perf_counter()
        logits = eng.forward(ids, pos, torch.tensor(slots, dtype=torch.long), last_only=True)  # [B, V]
        for slot, chunk in zip(slots, chunks):
            eng.lengths[slot] += len(chunk)
        st = getattr(eng, "stats", None)  # (test doubles keep none)
        if st is not None:  # counted as Engine.prefill counts: the prefix cache's savings are read against these
            eng._sync()  # sampling these logits waits for them anyway; here the pass is timed whole
            st.prefill_tokens += sum(map(len, chunks))
            st.prefill_s += time.perf_counter() - t0
        return logits

    def decode_step(self, slots: list[int], tokens: list[int]):
        return self.engine.decode_step(slots, tokens)  # [B, V] fp32, reused next step: sample at once

    def decode_queue(self, slots: list[int], tokens: list[int] | None = None):
        return self.engine.decode_queue(slots, tokens)

    def can_feed(self, slots: list[int]) -> bool:
        return self.engine.can_feed(slots)

    # sampling: one seeded generator per sequence, so batching does not change a seeded draw
    def sampler(self, p: SamplingParams):
        return p, p.generator(self.device)

    def sample(self, logits, samplers) -> list[int]:
        return sample(logits, [s[0] for s in samplers], [s[1] for s in samplers])
