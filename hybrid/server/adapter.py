"""The only module that touches the model runtime's API (hybrid.runtime + hybrid.models).

`Runtime` is the runtime's EngineSteps (what the generation loop drives: slots, prefill, decode steps,
decode(ids) -> text, eos_token_ids) plus what the routes use:

    vocab_size, max_token_chars;  encode(text) / encode_chat(messages) -> ids

    expert_split() -> {layer: (cold experts run on the CPU, shipped)} for /metrics

`load_runtime` opens the model through hybrid.loading.session, as `hybrid generate` does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybrid.runtime.steps import EngineSteps

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


class Runtime(EngineSteps):
    def __init__(self, engine, tokenizer, batch_prefill: str = "on"):
        if batch_prefill not in BATCH_PREFILL:
            raise ValueError(f"batch_prefill must be one of {BATCH_PREFILL}, got {batch_prefill!r}")
        # One padded forward for several prompts instead of one pass each (on a GPU: one Python loop of
        # small ops and one read of each expert's weights instead of B); BENCHMARKS.md has the server
        # figures. "off" = one prompt per pass.
        super().__init__(engine, tokenizer, batch_prefill=batch_prefill == "on")
        # Every step's tokens go to the clients, and cancellations and new requests join at each step
        # boundary, so the server samples on the host after every step.
        self.decode_ahead = False
        # Prompt token ids index the embedding table, so its size (not the tokenizer's) is the bound.
        self.vocab_size = engine.model.cfg.vocab_size
        # The most characters of text one token can stand for, if the tokenizer bounds it: prompts
        # longer than max_context times this are refused by size alone (server/prompt_limits.py).
        self.max_token_chars = max_token_chars(tokenizer)

    # tokenizer (called from worker threads and the engine thread; the tokenizers library is thread-safe
    # for encode/decode, which take no mutable state)
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

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
    """Open the model the way `hybrid generate` does (hybrid.loading.session: --model or the demo,
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
        from hybrid.loading.session import open_session

        s = open_session(opts, max_batch=opts.max_batch, log=log)
        engine, tokenizer, model_dir = s.engine, s.tokenizer, s.model_dir
    return Runtime(engine, tokenizer, getattr(opts, "batch_prefill", "on")), Path(model_dir).resolve().name


def _open_exact(opts, log):
    import torch

    from hybrid.errors import UsageError
    from hybrid.models import ModelLoadError, load_model
    from hybrid.loading.parse import hybrid_config_from_args
    from hybrid.runtime.demo import DEMO_NOTICE, ensure_demo_checkpoint
    from hybrid.runtime.engine import Engine
    from hybrid.loading.parse import resolve_device
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
