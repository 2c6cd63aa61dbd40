"""The generate loop behind Engine.generate: admit prompts into free slots (prefill), decode all
active slots together, sample, apply stop tokens / stop strings / length limits, stream text."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.runtime.sampling import SamplingParams, sample


@dataclass
class _Request:
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    completion: "object"
    slot: int = -1
    last: int = -1
    emitted: int = 0  # characters of text already streamed


def _text_of(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids) if engine.tokenizer is not None else ""


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
        engine.free_slot(self.slot)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_generation(engine, prompts, max_new_tokens, sampling, stop_token_ids, stop_strings, stream,
                   conversation: Conversation | None = None):
    from hybrid.runtime.engine import Completion

    if conversation is not None and len(prompts) != 1:
        raise ValueError("a conversation continues exactly one prompt")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    stop_ids = set(engine.default_stop_ids() if stop_token_ids is None else stop_token_ids)
    stop_strings = [s for s in stop_strings if s]
    if stop_strings and engine.tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    hold = max((len(s) for s in stop_strings), default=1) - 1  # chars that might start a stop string

    requests = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if len(ids) >= engine.max_context:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; max_context is {engine.max_context}")
        requests.append(_Request(i, p, p.generator(engine.device), Completion(prompt_token_ids=ids)))
    waiting = list(requests)
    active: list[_Request] = []

    def finish(r: _Request, reason: str):
        c = r.completion
        c.finish_reason = reason
        if engine.tokenizer is not None:
            full = _text_of(engine, c.token_ids)
            cut = min((full.find(s) for s in stop_strings if s in full), default=-1)
            c.text = full[:cut] if cut >= 0 else full
            if stream and len(c.text) > r.emitted:
                stream(r.index, -1, c.text[r.emitted:])  # flush what was held back
        if conversation is not None and r.slot == conversation.slot:
            # what the slot now holds: the prompt and every generated token fed back through the model
            conversation.held = (c.prompt_token_ids + c.token_ids)[:engine.lengths[r.slot]]
        else:
            engine.free_slot(r.slot)
        active.remove(r)

    def accept(r: _Request, token: int):
        c = r.completion
        if token in stop_ids:
            finish(r, "stop")
            return
        c.token_ids.append(token)
        r.last = token
        delta = ""
        if engine.tokenizer is not None:
            full = _text_of(engine, c.token_ids)
            if stop_strings and any(s in full for s in stop_strings):
                if stream:
                    stream(r.index, token, "")
                finish(r, "stop")
                return
            safe = len(full) - hold
            if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                safe = min(safe, len(full) - 1)
            if safe > r.emitted:
                delta, r.emitted = full[r.emitted:safe], safe
        if stream:
            stream(r.index, token, delta)
        if len(c.token_ids) >= max_new_tokens:
            finish(r, "length")
        elif engine.lengths[r.slot] >= engine.max_context:
            finish(r, "length")

    while waiting or active:
        while waiting and (engine.free_slots or conversation is not None):
            r = waiting.pop(0)
            ids = r.completion.prompt_token_ids
            if conversation is not None:
                r.slot = conversation.slot
                # keep the held prefix (at least one prompt token is prefilled, for its logits)
                keep = min(_common_prefix(conversation.held, ids), len(ids) - 1)
                engine.lengths[r.slot] = keep
                conversation.held = ids[:keep]
                ids = ids[keep:]
            else:
                r.slot = engine.allocate_slot()
            active.append(r)
            logits = engine.prefill(r.slot, ids)
            accept(r, sample(logits[None], [r.params], [r.generator])[0])
        if not active:
            continue
        batch = list(active)
        logits = engine.decode_step([r.slot for r in batch], [r.last for r in batch])
        tokens = sample(logits, [r.params for r in batch], [r.generator for r in batch])
        for r, t in zip(batch, tokens):
            accept(r, t)
    return [r.completion for r in requests]
