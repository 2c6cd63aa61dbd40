"""Engine.generate: the CLI's client of the generation loop (hybrid.runtime.batching.Batcher). It checks the
prompts, runs them to the end through the loop (whole prompts per prefill, decode ahead where the engine
offers it, errors raised) and returns one Completion per prompt; a Conversation keeps its KV slot across
calls so that each turn prefills only what is new. Without one, the engine's prefix cache does the same across
calls for any prompt that starts as an earlier one did (hybrid.runtime.prefix_cache), as long as the slot that
prompt left is not taken by another in between."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybrid.runtime.batching import Batcher, Sequence
from hybrid.runtime.prefix_cache import common_prefix
from hybrid.runtime.steps import EngineSteps


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS / stop string) or "length"


@dataclass
class Conversation:
    """A KV slot kept across `generate` calls (multi-turn chat): each turn prefills only what its prompt
    adds after the longest prefix the slot already holds, instead of the whole conversation again."""

    slot: int
    held: list  # token ids whose K/V the slot holds, in order

    @classmethod
    def open(cls, engine) -> "Conversation":
        return cls(engine.allocate_slot(), [])

    def close(self, engine) -> None:
        """Give the slot back; what it holds stays in the engine's prefix cache for a later prompt."""
        engine.free_slot(self.slot, self.held)


class _EngineLoop(Batcher):
    """The loop as the CLI drives it: stream(index, token_id, text_delta) per generated token, text held
    back at the end flushed in one extra call with token_id -1; a conversation's slot kept, not freed."""

    def __init__(self, engine, stream, conversation: Conversation | None):
        super().__init__(EngineSteps(engine, engine.tokenizer), completion_in_context=False)
        self.engine, self.stream, self.conversation = engine, stream, conversation

    def can_admit(self) -> bool:
        return bool(self.engine.free_slots) or self.conversation is not None

    def take_slot(self, seq: Sequence) -> int:
        conv = self.conversation
        if conv is None:
            return super().take_slot(seq)
        # keep the held prefix (at least one prompt token is prefilled, for its logits)
        ids = seq.prompt_ids
        keep = min(common_prefix(conv.held, ids), len(ids) - 1)
        self.engine.lengths[conv.slot] = keep
        conv.held = ids[:keep]
        seq.prefilled = keep
        return conv.slot

    def release(self, seq: Sequence) -> None:
        conv = self.conversation
        if conv is not None and seq.slot == conv.slot:
            # what the slot now holds: the prompt and every generated token fed back through the model
            conv.held = (seq.prompt_ids + seq.token_ids)[:self.engine.lengths[seq.slot]]
            seq.slot = None
            return
        super().release(seq)

    def on_token(self, seq: Sequence, token: int | None, text: str) -> None:
        if self.stream is None:
            return
        if token is not None:
            self.stream(seq.sink, token, text)
        elif text:
            self.stream(seq.sink, -1, text)


def run_generation(engine, prompts, max_new_tokens, sampling, stop_token_ids, stop_strings, stream,
                   conversation: Conversation | None = None):

    if conversation is not None and len(prompts) != 1:
        raise ValueError("a conversation continues exactly one prompt")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    stop_ids = frozenset(engine.default_stop_ids() if stop_token_ids is None else stop_token_ids)
    stop_strings = tuple(s for s in stop_strings if s)
    if stop_strings and engine.tokenizer is None:
        raise ValueError("stop strings need a tokenizer")

    loop = _EngineLoop(engine, stream, conversation)
    seqs = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) >= engine.max_context:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; max_context is {engine.max_context}")
        if stop_strings:
            p = replace(p, stop=tuple(dict.fromkeys(stop_strings + p.stop)))
        seqs.append(Sequence(ids, max_new_tokens, p, sink=i, stop_ids=stop_ids))
    loop.submit(seqs)  # checks every prompt's ids (none, not ints, outside the vocabulary) before any takes a slot
    loop.run()  # frees the slots it took however it ends
    return [Completion(prompt_token_ids=s.prompt_ids, token_ids=s.token_ids, text=s.text,
                       finish_reason=s.finish_reason) for s in seqs]
