"""The generate loop behind Engine.generate: admit prompts into free slots (prefill), decode all
active slots together, sample, apply stop tokens / stop strings / length limits, stream text.

When every active row is greedy and the engine decodes ahead (Engine.decode_ahead: on with CUDA graphs), the
loop keeps one step queued beyond the one whose tokens it is reading: step n+1 is queued, fed on the device with
step n's argmax tokens, before the host accepts step n's tokens, so the GPU does not sit idle while the host reads
tokens, streams text and launches the next graph. A row that stops at step n (a stop token or string) throws away
its share of step n+1; the rows still running keep theirs. Tokens are the ones a step-by-step loop gives."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.runtime.sampling import SamplingParams, sample


@dataclass(eq=False)  # requests compare by identity (a batch is a list of them)
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

    def accept(r: _Request, token: int, length: int):
        """r's next token; length: what its slot holds once the step that made the token has run."""
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
        elif length >= engine.max_context:
            finish(r, "length")

    def queue_more(batch: list[_Request]) -> bool:
        """Whether to queue another device-fed step behind the queued one: the batch is unchanged, no waiting
        prompt could take a slot, some row could still use the token and every row has a position left."""
        return (len(batch) == len(active) and all(a is b for a, b in zip(batch, active))
                and not (waiting and engine.free_slots)
                and any(len(r.completion.token_ids) + 2 <= max_new_tokens for r in batch)
                and all(engine.lengths[r.slot] < engine.max_context for r in batch)
                and engine.can_feed([r.slot for r in batch]))

    pending = None  # (batch, QueuedStep): queued, its tokens not accepted yet
    while waiting or active or pending:
        if pending is not None:
            batch, step = pending
            # queue the next step first, so the GPU keeps working while the host takes this one's tokens
            pending = (batch, engine.decode_queue([r.slot for r in batch])) if queue_more(batch) else None
            for r, t, n in zip(batch, step.tokens(), step.lengths):
                if r in active:  # a row that stopped one step earlier drops what was queued past its end
                    accept(r, t, n)
            continue
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
            accept(r, sample(logits[None], [r.params], [r.generator])[0], engine.lengths[r.slot])
        if not active:
            continue
        batch = list(active)
        slots = [r.slot for r in batch]
        if getattr(engine, "decode_ahead", False) and all(r.params.greedy for r in batch):  # (stand-ins: no)
            pending = (batch, engine.decode_queue(slots, [r.last for r in batch]))
            continue
        logits = engine.decode_step(slots, [r.last for r in batch])
        tokens = sample(logits, [r.params for r in batch], [r.generator for r in batch])
        for r, t in zip(batch, tokens):
            accept(r, t, engine.lengths[r.slot])
    return [r.completion for r in requests]
