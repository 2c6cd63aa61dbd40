"""The only module that touches the model runtime's API (hybrid.runtime + hybrid.models).

`Runtime` wraps an engine and its tokenizer into what the scheduler and the routes use:

    max_batch, max_context, vocab_size, eos_token_ids, max_token_chars
    encode(text) / encode_chat(messages) -> ids;  decode(ids) -> text
    allocate_slot() -> slot;  free_slot(slot);  free_slots (count)
    prefill(slots, chunks) -> logits [B, V];  decode_step(slots, tokens) -> logits [B, V]
    sampler(SamplingParams) -> per-sequence sampling state;  sample(logits [B, V], samplers) -> ids

    expert_split() -> {layer: (cold experts run on the CPU, shipped)} for /metrics

`load_runtime` opens the model through hybrid.runtime.session, as `hybrid generate` does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybrid.server.schemas import SamplingParams

SEED_MOD = 1 << 64  # torch.Generator.manual_seed takes 0..2**64-1; OpenAI seeds may be negative


BATCH_PREFILL = ("on", "off")
# Unicode composition (NFC/NFKC) can shrink text before it is tokenized, at most ~3x (three Hangul
# jamo -> one syllable); normalizers that can delete text (strip, replace by "") give no bound at all.
NORMALIZER_SHRINK = 4
SHRINKING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Prepend", "Replace", "Sequence"}


def _walk(spec):
    """Every object in a tokenizer.json component, nested Sequences included."""
    if isinstance(spec, dict):
        yield spec
        for v in spec.values():
            yield from _walk(v)
    elif isinstance(spec, list):
        for v in spec:
            yield from _walk(v)


def _types(spec) -> set:
    return {d.get("type") for d in _walk(spec)}


def max_token_chars(tokenizer) -> int | None:
    """Characters of text one token covers at most, or None where the tokenizer gives no such bound.
    A bound holds only for tokenizers that turn every input byte into some token (byte-level BPE, BPE
    with byte fallback: Qwen, Mixtral, OLMoE, the demo); then a token covers at most as many characters
    as its vocabulary string has (byte-level strings: one character per byte)."""
    declared = getattr(tokenizer, "max_token_chars", None)
    if declared is not None:
        return declared
    hf = getattr(tokenizer, "tok", None)  # hybrid.runtime.tokenizer.Tokenizer wraps a tokenizers.Tokenizer
    try:
        spec = json.loads(hf.to_str())
        longest = max(len(t) for t in hf.get_vocab(with_added_tokens=True))
    except Exception:  # noqa: BLE001 - no bound: the prefix check still bounds the work
        return None
    model, pre, norm = spec.get("model") or {}, spec.get("pre_tokenizer"), spec.get("normalizer")
    every_byte = model.get("type") == "BPE" and (model.get("byte_fallback") or "ByteLevel" in _types(pre))
    drops_text = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"} & _types(pre) or \
        '"removed"' in json.dumps(pre)
    if not every_byte or drops_text:
        return None
    if norm is None:
        return longest
    deletes = any(isinstance(r, dict) and r.get("type") == "Replace" and not r.get("content")
                  for r in _walk(norm))
    if deletes or not _types(norm) <= SHRINKING_NORMALIZERS:
        return None
    return longest * NORMALIZER_SHRINK


class Runtime:
    def __init__(self, engine, tokenizer, batch_prefill: str = "on"):
        from hybrid.runtime.sampling import SamplingParams as EngineSampling, sample

        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch = engine.max_batch
        self.max_context = engine.max_context
        # Prompt token ids index the embedding table, so its size (not the tokenizer's) is the bound.
        self.vocab_size = engine.model.cfg.vocab_size
        self.eos_token_ids = frozenset(engine.default_stop_ids())
        # The most characters of text one token can stand for, if the tokenizer bounds it: prompts
        # longer than max_context times this are refused by size alone (server/prompt_limits.py).
        self.max_token_chars = max_token_chars(tokenizer)
        self._EngineSampling, self._sample = EngineSampling, sample
        # One padded forward for several prompts instead of one pass each (on a GPU: one Python loop of
        # small ops and one read of each expert's weights instead of B). Measured on the 2-core dev box,
        # demo model, 16 streaming clients, two alternating pairs of `bench.serve_load` runs: 11.9-12.5 vs
        # 8.2-10.2 req/s, TTFT p50 0.21-0.25 vs 0.42-0.47 s (the second pair in
        # bench/results/dev/serve_load_c16_stream_prefill_{on,off}.json). "off" = one prompt per pass.
        if batch_prefill not in BATCH_PREFILL:
            raise ValueError(f"batch_prefill must be one of {BATCH_PREFILL}, got {batch_prefill!r}")
        self.batch_prefill = batch_prefill == "on"

    # tokenizer (called from worker threads and the engine thread; the tokenizers library is thread-safe
    # for encode/decode, which take no mutable state)
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # KV slots and model steps (engine thread only)
    def allocate_slot(self) -> int:
        return self.engine.allocate_slot()

    def free_slot(self, slot: int) -> None:
        self.engine.free_slot(slot)

    @property
    def free_slots(self) -> int:
        return self.engine.free_slots

    def prefill(self, slots: list[int], chunks: list[list[int]]):
        """Append chunks[i] to slot i's cache, all in one forward -> logits [B, V] after each chunk.
        Several slots at once only when `batch_prefill`; the scheduler asks one by one otherwise.
        On failure no slot's length has advanced, so a retry rewrites the same positions."""
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
        logits = eng.forward(ids, pos, torch.tensor(slots, dtype=torch.long), last_only=True)  # [B, V]
        for slot, chunk in zip(slots, chunks):
            eng.lengths[slot] += len(chunk)
        return logits

    def decode_step(self, slots: list[int], tokens: list[int]):
        return self.engine.decode_step(slots, tokens)  # [B, V] fp32, reused next step: sample at once

    # sampling: one seeded generator per sequence, so batching does not change a seeded draw
    def sampler(self, p: SamplingParams):
        seed = None if p.seed is None else p.seed % SEED_MOD
        params = self._EngineSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=seed)
        return params, params.generator(self.engine.device)

    def sample(self, logits, samplers) -> list[int]:
        return self._sample(logits, [s[0] for s in samplers], [s[1] for s in samplers])

    @property
    def device_type(self) -> str | None:
        """'cuda' or 'cpu' (for /metrics: hybrid_device_info, and what 'shipped' means on this run)."""
        dev = getattr(self.engine, "device", None)
        return None if dev is None else str(getattr(dev, "type", dev))

    # hybrid layer: per MoE layer, cold experts run on the CPU vs shipped to the GPU (cumulative)
    def expert_split(self) -> dict[int, tuple[int, int]]:
        """Read from each expert executor that keeps such counters (hybrid.offload's LayerStats);
        empty for a plain model, so /metrics then shows no hybrid series at all."""
        out = {}
        for i, layer in enumerate(getattr(self.engine.model, "layers", ())):
            stats = getattr(getattr(getattr(layer, "moe", None), "experts", None), "stats", None)
            if stats is not None and hasattr(stats, "cpu_experts") and hasattr(stats, "shipped_experts"):
                out[i] = (int(stats.cpu_experts), int(stats.shipped_experts))
        return out


EXACT_DTYPE = "float64"


def load_runtime(opts, log=lambda m: print(m, file=sys.stderr, flush=True)) -> tuple[Runtime, str]:
    """Open the model the way `hybrid generate` does (hybrid.runtime.session: --model or the demo,
    --device, --dtype, --eager, the hybrid-expert flags) with `opts.max_batch` KV slots.
    -> (runtime, served model name).

    --dtype float64 is the server's addition, for exactness checks: fp32 GEMMs round differently at
    different batch sizes (gemv vs gemm blocking, grouped-GEMM group sizes), and a MoE router turns
    those last-bit differences into different experts at near-ties, so only in fp64 is greedy output
    reliably identical batched and alone. It loads the plain model (no hybrid layer, no CUDA graphs).
    """
    if opts.dtype == EXACT_DTYPE:
        engine, tokenizer, model_dir = _open_exact(opts, log)
    else:
        from hybrid.runtime.session import open_session

        s = open_session(opts, max_batch=opts.max_batch, log=log)
        engine, tokenizer, model_dir = s.engine, s.tokenizer, s.model_dir
    return Runtime(engine, tokenizer, getattr(opts, "batch_prefill", "on")), Path(model_dir).resolve().name


def _open_exact(opts, log):
    import torch

    from hybrid.errors import UsageError
    from hybrid.models import ModelLoadError, load_model
    from hybrid.offload.build import hybrid_config_from_args
    from hybrid.runtime.demo import DEMO_NOTICE, ensure_demo_checkpoint
    from hybrid.runtime.engine import Engine
    from hybrid.runtime.session import resolve_device
    from hybrid.runtime.tokenizer import Tokenizer

    if hybrid_config_from_args(opts) is not None:
        raise UsageError("--dtype float64 loads the plain model; it cannot be combined with the hybrid-expert flags")
    model_dir = opts.model
    if not model_dir:
        model_dir = str(ensure_demo_checkpoint(progress_print=log))
        log(DEMO_NOTICE.format(path=model_dir))
    try:
        model = load_model(model_dir, device=resolve_device(opts.device), dtype=torch.float64, progress=False)
        tokenizer = Tokenizer(model_dir)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    return Engine(model, tokenizer, max_batch=opts.max_batch, max_context=opts.max_context, eager=True), \
        tokenizer, model_dir
