"""Engine: KV-cache slots, prefill, decode steps and a batched `generate` on top of a MoETransformer.

API (what the OpenAI server's continuous batching drives):

    engine = Engine(model, tokenizer, max_batch=8, max_context=4096, eager=None)   # or config=RuntimeConfig(...)
        # eager=None: CUDA graphs for decode on a GPU, eager on the CPU; eager=True turns graphs off.
        # Graphs are captured on the first decode_step (or engine.warmup()): buckets 1, 2, 4, ... up
        # to max_batch, attending over the whole max_context; rows of any slots in any order.
        # If a layer's expert executor is not `capturable`, graphs are turned off with a warning.
    slot = engine.allocate_slot()                   # a free KV slot (ValueError if none is free)
    slot = engine.allocate_slot_for(prompt_ids)     # one for this prompt: lengths[slot] of its first tokens are
        # there already (prefix cache: a slot given back keeps its tokens' K/V, hybrid.runtime.prefix_cache),
        # so prefill(slot, prompt_ids[engine.lengths[slot]:]) completes it. RuntimeConfig.prefix_cache=False: 0.
    logits = engine.prefill(slot, token_ids)        # [V] fp32 logits after the last prompt token.
        # Appends to what the slot already holds (multi-turn / chunked prefill); always eager.
    logits = engine.decode_step(slots, last_tokens) # [B, V] fp32: one token per slot at its next position.
        # Graph-captured on the GPU; the returned tensor is reused by the next step: consume it first.
    step = engine.decode_queue(slots, last_tokens)  # a greedy step, queued: step.tokens() waits for its argmax ids
    step = engine.decode_queue(slots)               # the next one, fed on the device by the step queued before
        # (same slots, nothing else in between): the GPU never waits for the host between greedy steps.
    engine.free_slot(slot, held=None)               # held: the ids its positions hold (prompt + tokens fed
        # back), kept for a later prompt that starts the same way; None: forgotten, overwritten on reuse
    engine.lengths[slot]                            # tokens held by a slot
    engine.forward(input_ids, positions, slots)     # raw batched forward (right padding, position -1)
    token_ids = sample(logits, [SamplingParams...], [generator...])   # hybrid.runtime.sampling

    results = engine.generate(prompts, max_new_tokens=64, sampling=SamplingParams(temperature=0),
                              stop_token_ids=None, stop_strings=(), stream=None)
        # prompts: list of str (needs the tokenizer) or list of token-id lists, any lengths; more
        # prompts than slots are queued and admitted as slots free up. sampling: one SamplingParams or
        # one per prompt (per-request seed). stop_token_ids=None: the model's and tokenizer's EOS ids.
        # stream(index, token_id, text_delta) is called for every generated token; text that could
        # still become a stop string or an incomplete UTF-8 character is held back and flushed with the
        # last token (or, when a stop token ends it, in one extra call with token_id -1). The deltas of a
        # prompt concatenate to its text (hybrid.runtime.streamer.TextStream, as the server streams).
        # -> list[Completion(prompt_token_ids, token_ids, text, finish_reason)], and engine.stats.
        # Each prompt takes the free slot holding the longest prefix of it (prefix cache), prefilling the rest.
        # Every prompt is checked before any takes a slot: ValueError for an empty or too long one or an id
        # outside [0, vocab_size). However a call ends (an error, KeyboardInterrupt, a stream callback that
        # raises to stop early) it frees the slots it took; the next call finds them all.

Shapes: B rows, T tokens, V vocab. The stop token itself is not part of token_ids or text.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from hybrid.runtime.config import RuntimeConfig
from hybrid.runtime.generation import Completion, run_generation
from hybrid.runtime.kv_cache import StaticKVCache, check_kv_dtype, storage_dtype
from hybrid.runtime.prefix_cache import PrefixCache
from hybrid.runtime.sampling import SamplingParams

StreamCallback = Callable[[int, int, str], None]
WARMUP_TOKENS_GPU = 2048 # prompt-sized shapes for the kernel selection and the CPU lane's buffers
WARMUP_TOKENS_CPU = 8


def spread_ids(n: int, vocab_size: int) -> list[int]:
    """n token ids spread over the vocabulary (a stride prime to it), so that many experts see rows: the dummy
    prompt of the warm-up and of the prefill benches."""
    return [(i * 7919 + 1) % vocab_size for i in range(n)]


@dataclass
class Stats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    prefix_lookups: int = 0  # prompts that searched the prefix cache for their slot (Engine.allocate_slot_for)
    prefix_hits: int = 0  # ... and found a cached prefix to continue from
    prefix_tokens_reused: int = 0  # prompt tokens those hits did not prefill (prefill_tokens counts the rest)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_lookups if self.prefix_lookups else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


class QueuedStep:
    """A greedy decode step queued on the device (Engine.decode_queue): its rows' argmax tokens reach the host
    through a page-locked copy behind it; tokens() waits for that copy, nothing else."""

    def __init__(self, engine: "Engine", slots: list[int], lengths: list[int], ids: torch.Tensor, t_queued: float):
        self.slots = list(slots)
        self.lengths = list(lengths)  # each slot's length once this step has run (its token's position + 1)
        self._engine, self._t_queued = engine, t_queued
        cuda = ids.device.type == "cuda"
        self._host = torch.empty(len(slots), dtype=torch.long, pin_memory=cuda)
        self._host.copy_(ids, non_blocking=cuda)
        self.done = torch.cuda.Event(enable_timing=True) if cuda else None  # timing: the benches' step times
        if cuda:
            self.done.record()
        self.done_s = None if cuda else time.perf_counter()  # CPU: the step ran inside decode_queue
        self._tokens = None

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def tokens(self) -> list[int]:
        """The step's greedy token per row (waits for the step; counted in engine.stats the first time)."""
        if self._tokens is None:
            if self.done is not None:
                self.done.synchronize()
                self.done_s = time.perf_counter()
            self._tokens = self._host.tolist()
            st, e = self._engine.stats, self._engine
            # time on the decode clock: from this step's queueing or the previous step's end, whichever is later
            # (queued steps overlap: each second counts once)
            st.decode_s += self.done_s - max(self._t_queued, e._decode_clock)
            e._decode_clock = self.done_s
        return self._tokens


def kv_cache_bytes(cfg, max_batch: int, max_context: int, dtype: torch.dtype, kv_dtype: str = "bf16") -> int:
    """Bytes of the static KV cache (one spare column per slot, see kv_cache.py; the attention kind's
    layout, as placement.memory counts it) for a model computing in `dtype`, values stored as `kv_dtype`."""
    value = torch.empty((), dtype=storage_dtype(kv_dtype, dtype)).element_size()
    return cfg.kv_values_per_token * max_batch * (max_context + 1) * value


def check_kv_cache_fits(cfg, max_batch: int, max_context: int, dtype: torch.dtype, device,
                        kv_dtype: str = "bf16") -> None:
    """Refuses a KV cache larger than the device's free memory before allocating it (a huge --max-context or
    --max-batch was an allocator traceback, or minutes of swapping), and an fp8 one on a GPU that cannot
    run it (kv_cache.check_kv_dtype)."""
    from hybrid.errors import TooLarge

    check_kv_dtype(kv_dtype, device)
    need = kv_cache_bytes(cfg, max_batch, max_context, dtype, kv_dtype)
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    if need > free:
        raise TooLarge(f"the KV cache for --max-context {max_context} x --max-batch {max_batch} needs "
                       f"{need / 2**30:,.1f} GiB on {device}, which has {free / 2**30:,.1f} GiB free; lower "
                       f"--max-context or --max-batch{' (or --kv-dtype fp8: half the bytes)' if kv_dtype != 'fp8' else ''}")


class Engine:
    def __init__(self, model, tokenizer=None, max_batch: int = RuntimeConfig.max_batch,
                 max_context: int = RuntimeConfig.max_context, eager: bool | None = None,
                 config: RuntimeConfig | None = None):
        """`config` (a RuntimeConfig) replaces the three keyword arguments when given."""
        config = config or RuntimeConfig(max_batch=max_batch, max_context=max_context, eager=eager)
        max_batch, max_context, eager = config.max_batch, config.max_context, config.eager
        self.config = config
        self.model, self.tokenizer = model, tokenizer
        self.device = model.device
        check_kv_cache_fits(model.cfg, max_batch, max_context, model.dtype, self.device, config.kv_dtype)
        self.cache = StaticKVCache.for_model(model, max_batch, max_context, config.kv_dtype)
        self.max_batch, self.max_context = max_batch, max_context
        self.lengths = [0] * max_batch
        self._free = list(range(max_batch - 1, -1, -1))  # allocate_slot takes from the end
        self.prefix_cache = PrefixCache() if config.prefix_cache else None  # what free slots still hold
        if eager is None:
            eager = self.device.type != "cuda"
        if not eager and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; pass eager=True")
        self.graphs = None
        blockers = [i for i, layer in enumerate(model.layers)
                    if layer.moe is not None and not getattr(layer.moe.experts, "capturable", False)]
        if not eager and blockers:
            # Loud, not silent: the executor would sync with the host inside the graph.
            import warnings
            warnings.warn(f"CUDA graphs off: the expert executor of layer {blockers[0]} is not capturable "
                          f"({type(model.layers[blockers[0]].moe.experts).__name__}, {model.dtype}); decoding eagerly")
            eager = True
        if not eager:
            from hybrid.runtime.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(model, self.cache, context=config.context_buckets)
        # Hybrid executors pin the GPU-launching thread off the CPU executor's cores while a step runs
        # (hybrid.offload.shared.Offload.launcher_pinned); a graph replay's CPU lane runs inside the step.
        self._step_context = next((layer.moe.experts.launcher_pinned for layer in model.layers if layer.moe is not None
                                   and hasattr(layer.moe.experts, "launcher_pinned")), contextlib.nullcontext)
        self.stats = Stats()
        self.warmup_s = 0.0
        # greedy steps queued ahead (Engine.decode_queue): with graphs unless the config says otherwise
        self.decode_ahead = self.graphs is not None if config.decode_ahead is None else config.decode_ahead
        self._fed = None  # (slots, lengths) a device-fed next step may continue from (decode_queue)
        self._eager_ids = None  # eager mode: the last queued step's argmax ids [B], on the device
        self._decode_clock = 0.0  # when the last queued step's tokens were ready (QueuedStep.tokens)

    def warmup(self, tokens: int | None = None) -> float:
        """Throw-away prefill of `tokens` dummy tokens and two decode steps through the same paths a request
        takes (CUDA context, cuBLAS/SDPA kernel selection for prompt-sized shapes, the CPU lane's pinned
        buffers grown to a prompt's rows, oneDNN JIT, graph capture), so the first request runs at warm
        speed. Default length: WARMUP_TOKENS_GPU on a GPU (its first long prefill was ~3x slower than the
        next), WARMUP_TOKENS_CPU on the CPU (nothing there is lazily sized by the prompt). Leaves no state:
        the slot is freed, stats zeroed, the hybrid layers' routing counters restored and online
        re-placement kept out of it. Returns the seconds it took (also in self.warmup_s)."""
        import copy

        t0 = time.perf_counter()
        if tokens is None:
            tokens = WARMUP_TOKENS_GPU if self.device.type == "cuda" else WARMUP_TOKENS_CPU
        tokens = max(1, min(tokens, self.max_context - 2))
        ids = spread_ids(tokens, self.model.cfg.vocab_size)
        executors = [layer.moe.experts for layer in self.model.layers if layer.moe is not None]
        saved = [(x, copy.deepcopy(x.stats)) for x in executors if hasattr(x, "stats")]
        offloads = {id(x.offload): x.offload for x in executors if getattr(x, "offload", None) is not None}
        replacers = {k: o.replacer for k, o in offloads.items()}
        for o in offloads.values():
            o.replacer = None  # dummy tokens must not move experts
        slot = self.allocate_slot()
        try:
            logits = self.prefill(slot, ids)
            nxt = int(logits.argmax())
            for _ in range(2):
                nxt = int(self.decode_step([slot], [nxt])[0].argmax())
        finally:
            self.free_slot(slot)
            for k, o in offloads.items():
                o.replacer = replacers[k]
            for x, stats in saved:
                x.stats = stats
        self.stats = Stats()
        self.warmup_s = time.perf_counter() - t0
        return self.warmup_s

    # -- slots ------------------------------------------------------------------------------------
    def allocate_slot(self) -> int:
        """A free slot, empty (lengths 0). With the prefix cache, one that caches nothing if there is one, else the
        least recently used: the cached prefixes most likely to be asked for again survive."""
        self._check_free()
        return self._take(self._free[-1] if self.prefix_cache is None else self.prefix_cache.victim(self._free), 0)

    def allocate_slot_for(self, prompt_ids: list[int]) -> int:
        """A free slot for this prompt, with lengths[slot] = how many of its first tokens the slot already holds: the
        free slot sharing the longest prefix with it (at least prefix_cache.MIN_REUSE tokens, never the whole
        prompt: its last token's logits are needed), else as allocate_slot. Counted in stats.prefix_*."""
        if self.prefix_cache is None:
            return self.allocate_slot()
        self._check_free()
        slot, keep = self.prefix_cache.choose(self._free, prompt_ids)
        st = self.stats
        st.prefix_lookups += 1
        st.prefix_hits += keep > 0
        st.prefix_tokens_reused += keep
        return self._take(slot, keep)

    def cached_prefix(self, prompt_ids: list[int]) -> int:
        """The tokens allocate_slot_for(prompt_ids) would find cached now (0 with the cache off); takes nothing."""
        if self.prefix_cache is None or not self._free:
            return 0
        return self.prefix_cache.choose(self._free, prompt_ids)[1]

    def _check_free(self) -> None:
        if not self._free:
            raise ValueError(f"all {self.max_batch} KV slots are in use")

    def _take(self, slot: int, keep: int) -> int:
        self._free.remove(slot)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(slot)  # the request owns its positions now
        self.lengths[slot] = keep
        return slot

    def free_slot(self, slot: int, held: list[int] | None = None) -> None:
        """Give a slot back. held: the token ids whose K/V its positions hold, in order (the prompt and the tokens fed
        back); with the prefix cache, the first lengths[slot] of them stay cached for a later prompt (positions
        written past them, such as a queued step past a stop token, are not in `held`, and ids past lengths[slot]
        were never written). None: what the slot holds is forgotten."""
        if slot in self._free or not 0 <= slot < self.max_batch:
            raise ValueError(f"slot {slot} is not allocated")
        if self.prefix_cache is not None:
            self.prefix_cache.store(slot, [] if held is None else held[: self.lengths[slot]])
        self.lengths[slot] = 0
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # -- model steps -------------------------------------------------------------------------------
    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                last_only: bool = False) -> torch.Tensor:
        """Raw eager forward; see hybrid.models.transformer for the conventions."""
        dev = self.device
        positions = positions.to(dev)
        kv_len = int(positions.max().item()) + 1
        return self.model(input_ids.to(dev), positions, slots.to(dev), self.cache, last_only=last_only,
                          kv_len=max(kv_len, 1))

    @torch.no_grad()
    def prefill(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        """Appends token_ids to the slot's K/V -> the last token's logits [V]; a prompt longer than the config's
        prefill_chunk runs in passes of that many tokens (the same K/V and logits up to summation order)."""
        start, n = self.lengths[slot], len(token_ids)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if start + n > self.max_context:
            raise ValueError(f"{start + n} tokens exceed max_context {self.max_context}")
        dev = self.device
        t0 = time.perf_counter()
        step = self.config.prefill_chunk
        with self._step_context():
            for a in range(0, n, step):
                b = min(n, a + step)
                ids = torch.tensor([token_ids[a:b]], dtype=torch.long, device=dev)  # [1, T]
                pos = torch.arange(start + a, start + b, device=dev)[None]  # [1, T]
                logits = self.model(ids, pos, torch.tensor([slot], device=dev), self.cache, last_only=True,
                                    kv_len=start + b, fresh=start + a == 0, tail=True)  # [1, V]
            self._sync()
        self.lengths[slot] += n
        self._fed = None  # the graphs' fed inputs are not this slot's next token any more
        self.stats.prefill_tokens += n
        self.stats.prefill_s += time.perf_counter() - t0
        return logits[0]

    @torch.no_grad()
    def decode_step(self, slots: list[int], last_tokens: list[int]) -> torch.Tensor:
        positions = [self.lengths[s] for s in slots]
        if max(positions) >= self.max_context:
            raise ValueError(f"a slot reached max_context {self.max_context}")
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.prepare(len(slots), positions)[1]:
            t0 = time.perf_counter()  # capture stays outside the timed step
        with self._step_context():
            if self.graphs is not None:
                logits = self.graphs.step(list(last_tokens), positions, list(slots))
            else:
                dev = self.device
                logits = self.model(torch.tensor(last_tokens, device=dev)[:, None],
                                    torch.tensor(positions, device=dev)[:, None], torch.tensor(slots, device=dev),
                                    self.cache, last_only=True, kv_len=max(positions) + 1)
            self._sync()
        for s in slots:
            self.lengths[s] += 1
        self._fed = None  # a host-sampled step: the next one is fed by the host too
        self.stats.decode_tokens += len(slots)
        self.stats.decode_steps += 1
        self.stats.decode_s += time.perf_counter() - t0
        return logits

    def can_feed(self, slots: list[int]) -> bool:
        """Whether decode_queue(slots) without tokens can continue the last queued step: the same slots in the
        same order, their lengths untouched since (no prefill, slot reuse or other step in between)."""
        return self._fed is not None and self._fed == (list(slots), [self.lengths[s] for s in slots])

    @torch.no_grad()
    def decode_queue(self, slots: list[int], last_tokens: list[int] | None = None) -> QueuedStep:
        """Queue one greedy decode step and return at once: -> QueuedStep, whose tokens() are each row's argmax
        token. last_tokens=None feeds it on the device with the greedy tokens of the step queued just before
        (can_feed must hold), so a greedy decode runs step n+1 right behind step n while the host reads step n's
        tokens; a caller that stops early (a stop token) discards what it queued past the end. The slots'
        lengths advance at once. Eager (no graphs) it runs the step before returning."""
        n = len(slots)
        positions = [self.lengths[s] for s in slots]
        if max(positions) >= self.max_context:
            raise ValueError(f"a slot reached max_context {self.max_context}")
        fed = last_tokens is None
        if fed and not self.can_feed(slots):
            raise ValueError("decode_queue without tokens continues the step queued just before on the same slots")
        if not fed and len(last_tokens) != n:
            raise ValueError(f"{len(last_tokens)} tokens for {n} slots")
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.prepare(n, positions)[1]:
            t0 = time.perf_counter()  # capture stays outside the decode clock
        with self._step_context():
            if self.graphs is not None:
                if fed:
                    self.graphs.replay(n, positions)
                else:
                    self.graphs.step(list(last_tokens), positions, list(slots))
                nxt = self.graphs.fed_ids(n)
            else:
                dev = self.device
                ids = self._eager_ids if fed else torch.tensor(last_tokens, device=dev)
                logits = self.model(ids[:, None], torch.tensor(positions, device=dev)[:, None],
                                    torch.tensor(slots, device=dev), self.cache, last_only=True,
                                    kv_len=max(positions) + 1)
                nxt = self._eager_ids = logits.argmax(-1)
            for s in slots:
                self.lengths[s] += 1
            step = QueuedStep(self, slots, [self.lengths[s] for s in slots], nxt, t0)
        self._fed = (list(slots), list(step.lengths))
        self.stats.decode_tokens += n
        self.stats.decode_steps += 1
        return step

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompts: list, max_new_tokens: int = 64,
                 sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
                 stop_token_ids: list[int] | None = None, stop_strings: tuple[str, ...] | list[str] = (),
                 stream: StreamCallback | None = None, conversation=None) -> list[Completion]:
        """conversation: a hybrid.runtime.generation.Conversation whose slot this (single) prompt continues;
        only the part of the prompt after what the slot already holds is prefilled. Prompts are checked before
        any takes a slot, and the slots taken are freed however the call ends (see the module's docstring)."""

        return run_generation(self, prompts, max_new_tokens, sampling, stop_token_ids, stop_strings, stream,
                              conversation)

    def default_stop_ids(self) -> list[int]:
        ids = list(self.model.cfg.eos_token_ids)
        if self.tokenizer is not None:
            ids += [t for t in self.tokenizer.eos_token_ids if t not in ids]
        return ids
