"""The only module that touches the model runtime's API (hybrid.runtime + hybrid.models).

`Runtime` is the runtime's EngineSteps (what the generation loop drives: slots, prefill, decode steps,
decode(ids) -> text, eos_token_ids) plus what the routes use:

    vocab_size, max_token_chars;  encode(text) / encode_chat(messages, **template_kwargs) -> ids;
    token_piece(id) -> (text, bytes);  decode(ids, skip_special_tokens);  model_type and chat_template (which
        tool-call and reasoning formats apply: hybrid.server.tool_calls, hybrid.server.reasoning)
    open_sampler(params, prompt_ids, slot, end_ids) / close_sampler(s): a sequence's sampling state
        (hybrid.runtime.sampling.BatchSampler: penalties, logit bias, min_tokens, logprobs); a sequence
        whose prompt is scored (params.prompt_logprobs: echo with logprobs) is prefilled through
        Engine.forward with every position's logits, one prompt per pass

    expert_split() -> {layer: (cold experts run on the CPU, shipped)} for /metrics

`load_runtime` opens the model through hybrid.loading.session, as `hybrid generate` does.
"""

from __future__ import annotations

import json
import sys
import time
from functools import lru_cache
from pathlib import Path

import torch

from hybrid.runtime.sampling import SCORE_ROWS, BatchSampler, SamplingParams, SequenceSampler
from hybrid.runtime.steps import EngineSteps
from hybrid.server.config import BATCH_PREFILL, EXACT_DTYPE

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
        self.sampling = BatchSampler(self.vocab_size, self.device, rows=self.max_batch or 1)
        self.sampling.grammar_tokenizer = lambda: grammar_tokenizer(tokenizer, self.vocab_size, self.eos_token_ids)
        self._scoring: dict[int, SequenceSampler] = {}  # slot -> sampler whose prompt is being scored
        self._byte_level = _byte_level_decoder(tokenizer)  # str -> bytes of a token's vocabulary string, or None
        self.token_piece = lru_cache(maxsize=1 << 16)(self._token_piece)
        # what the tool-call and reasoning parsers are chosen by: the config's model_type and the template
        self.model_type = getattr(engine.model.cfg, "family", None)
        self.chat_template = getattr(tokenizer, "chat_template", None)

    # batched prefill, unless a prompt is being scored: its pass needs every position's logits
    @property
    def batch_prefill(self) -> bool:
        return self._batch_prefill and not self._scoring

    @batch_prefill.setter
    def batch_prefill(self, on: bool) -> None:
        self._batch_prefill = on

    # sampling (engine thread): one BatchSampler over every sequence's own options
    def sampler(self, p: SamplingParams) -> SequenceSampler:
        return self.open_sampler(p, (), None, self.eos_token_ids)

    def open_sampler(self, params: SamplingParams, prompt_ids, slot: int | None, end_ids) -> SequenceSampler:
        """A sequence's sampler: prompt_ids for the repetition penalty, end_ids (what would end it) masked until
        min_tokens; with params.prompt_logprobs its slot's prefill passes score the prompt."""
        s = self.sampling.open(params, prompt_ids, end_ids)
        if params.prompt_logprobs is not None and slot is not None:
            self._scoring[slot] = s
        return s

    def close_sampler(self, s: SequenceSampler) -> None:
        self.sampling.close(s)
        for slot, held in list(self._scoring.items()):
            if held is s:
                del self._scoring[slot]

    def sample(self, logits, samplers) -> list[int]:
        return self.sampling.sample(logits, samplers)

    def prefill(self, slots: list[int], chunks: list[list[int]]):
        scoring = self._scoring.get(slots[0]) if len(slots) == 1 else None
        if scoring is None:
            if any(s in self._scoring for s in slots):  # (batch_prefill is off meanwhile: not reached)
                raise RuntimeError("a scored prompt is prefilled alone")
            return super().prefill(slots, chunks)
        return self._score_prefill(slots[0], chunks[0], scoring)

    def _score_prefill(self, slot: int, chunk: list[int], s: SequenceSampler):
        """Prefill one chunk of a scored prompt through Engine.forward with every position's logits (in pieces
        of SCORE_ROWS tokens: memory), scoring each token -> logits [1, V] after the chunk. On failure the
        slot's length is restored and nothing is scored, so a retry rewrites the same positions."""
        eng = self.engine
        start = eng.lengths[slot]
        if start + len(chunk) > self.max_context:
            raise ValueError(f"{start + len(chunk)} tokens exceed max_context {self.max_context}")
        t0, scored, carry = time.perf_counter(), [], s.prompt_carry
        try:
            for lo in range(0, len(chunk), SCORE_ROWS):
                piece = chunk[lo : lo + SCORE_ROWS]
                pos = eng.lengths[slot]
                logits = eng.forward(torch.tensor([piece], dtype=torch.long),  # [1, T]
                                     torch.arange(pos, pos + len(piece))[None], torch.tensor([slot]),
                                     last_only=False)[0]  # [T, V]
                eng.lengths[slot] += len(piece)
                records, carry = s.score_prompt(piece, logits, carry)
                scored.extend(records)
        except BaseException:
            eng.lengths[slot] = start
            raise
        s.commit_prompt(scored, carry)
        if s.prompt_scored:
            self._scoring.pop(slot, None)  # the rest of its life is ordinary (batched prefill again)
        st = getattr(eng, "stats", None)
        if st is not None:  # counted as Engine.prefill counts them
            st.prefill_tokens += len(chunk)
            st.prefill_s += time.perf_counter() - t0
        return logits[-1:]

    def _token_piece(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """A token's text and UTF-8 bytes for logprobs. Byte-level BPE: the bytes its vocabulary string stands
        for (a token may hold part of a character: its text then shows U+FFFD, its bytes the truth)."""
        try:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        except TypeError:  # a tokenizer without the option
            text = self.tokenizer.decode([token_id])
        raw = None
        if self._byte_level is not None:
            raw = self._byte_level(self.tokenizer.tok.id_to_token(token_id))
        if raw is None:
            raw = text.encode("utf-8")
        return text, tuple(raw)

    # tokenizer (called from worker threads and the engine thread; the tokenizers library is thread-safe
    # for encode/decode, which take no mutable state)
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """template_kwargs reach the chat template as variables (`tools`, `enable_thinking`, ...)."""
        return self.tokenizer.encode_chat(messages, **template_kwargs)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """skip_special_tokens=False keeps control tokens (the markers a tool-call or reasoning parser reads)."""
        if skip_special_tokens:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

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


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """The llguidance tokenizer constrained decoding masks with: the tokenizer's own (`grammar_tokenizer()`, the
    test tokenizer's), else built from its tokenizers.Tokenizer JSON over the model's vocabulary size."""
    own = getattr(tokenizer, "grammar_tokenizer", None)
    if own is not None:
        return own()
    tok = getattr(tokenizer, "tok", None)
    if tok is None:
        raise ValueError("this model's tokenizer cannot drive constrained decoding (no tokenizer.json)")
    import llguidance

    return llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))


def _byte_level_decoder(tokenizer):
    """For a byte-level BPE tokenizer (GPT-2's byte-to-unicode alphabet), a function: vocabulary string ->
    its bytes (None for a string outside the alphabet, such as an added token); else None."""
    hf = getattr(tokenizer, "tok", None)
    try:
        spec = json.loads(hf.to_str())
    except Exception:  # noqa: BLE001 - not a tokenizers.Tokenizer: no byte-level strings to read
        return None
    if "ByteLevel" not in _types(spec.get("decoder")):
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1

    def to_bytes(piece: str | None):
        if piece is None or any(c not in table for c in piece):
            return None
        return bytes(table[c] for c in piece)
    return to_bytes




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
    from hybrid.runtime.demo import demo_checkpoint, demo_notice
    from hybrid.runtime.config import RuntimeConfig
    from hybrid.runtime.engine import Engine
    from hybrid.loading.parse import resolve_device
    from hybrid.runtime.tokenizer import Tokenizer

    if hybrid_config_from_args(opts) is not None:
        raise UsageError("--dtype float64 loads the plain model; it cannot be combined with the hybrid-expert flags")
    model_dir = opts.model
    if not model_dir:
        model_dir = str(demo_checkpoint())
        log(demo_notice())
    try:
        model = load_model(model_dir, device=resolve_device(opts.device), dtype=torch.float64, progress=False)
        tokenizer = Tokenizer(model_dir)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    config = RuntimeConfig(max_batch=opts.max_batch, max_context=opts.max_context, eager=True,
                           prefix_cache=not getattr(opts, "no_prefix_cache", False),
                           kv_dtype=getattr(opts, "kv_dtype", None) or "bf16")
    return Engine(model, tokenizer, config=config), tokenizer, model_dir
