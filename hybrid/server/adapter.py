"""The only module that touches the model runtime's API (hybrid.runtime + hybrid.models).

`Runtime` wraps an engine and its tokenizer into what the scheduler and the routes use:

    max_batch, max_context, vocab_size, eos_token_ids
    encode(text) / encode_chat(messages) -> ids;  decode(ids) -> text
    allocate_slot() -> slot;  free_slot(slot);  free_slots (count)
    prefill(slot, ids) -> logits [V];  decode_step(slots, tokens) -> logits [B, V]
    sampler(SamplingParams) -> per-sequence sampling state;  sample(logits [B, V], samplers) -> ids

`load_runtime` builds one from a checkpoint directory (or the demo checkpoint).
"""

from __future__ import annotations

from hybrid.server.schemas import SamplingParams

SEED_MOD = 1 << 64  # torch.Generator.manual_seed takes 0..2**64-1; OpenAI seeds may be negative


class Runtime:
    def __init__(self, engine, tokenizer):
        from hybrid.runtime.sampling import SamplingParams as EngineSampling, sample

        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch = engine.max_batch
        self.max_context = engine.max_context
        # Prompt token ids index the embedding table, so its size (not the tokenizer's) is the bound.
        self.vocab_size = engine.model.cfg.vocab_size
        self.eos_token_ids = frozenset(engine.default_stop_ids())
        self._EngineSampling, self._sample = EngineSampling, sample

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

    def prefill(self, slot: int, ids: list[int]):
        return self.engine.prefill(slot, ids)  # [V] fp32

    def decode_step(self, slots: list[int], tokens: list[int]):
        return self.engine.decode_step(slots, tokens)  # [B, V] fp32, reused next step: sample at once

    # sampling: one seeded generator per sequence, so batching does not change a seeded draw
    def sampler(self, p: SamplingParams):
        seed = None if p.seed is None else p.seed % SEED_MOD
        params = self._EngineSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=seed)
        return params, params.generator(self.engine.device)

    def sample(self, logits, samplers) -> list[int]:
        return self._sample(logits, [s[0] for s in samplers], [s[1] for s in samplers])


DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")


def load_runtime(model_dir: str | None, plan: str | None, max_batch: int, max_context: int,
                 dtype: str = "auto") -> tuple[Runtime, str]:
    """-> (runtime, served model name). model_dir None = the demo checkpoint (built on first use).

    dtype "auto" = bfloat16 on a GPU, float32 on the CPU. float64 exists for exactness checks: fp32
    GEMMs round differently at different batch sizes (gemv vs gemm blocking, grouped-GEMM group
    sizes), and a MoE router turns those last-bit differences into different experts at near-ties,
    so only in fp64 is greedy output reliably identical batched and alone.
    """
    import sys
    from pathlib import Path

    import torch

    from hybrid.errors import UsageError
    from hybrid.models import ModelLoadError, load_model
    from hybrid.runtime import Engine
    from hybrid.runtime.tokenizer import Tokenizer

    if plan is not None:
        raise UsageError(f"--plan {plan}: expert placement plans are not supported by this runtime yet "
                         "(the placement planner has not landed); serve without --plan")
    if model_dir is None:
        from hybrid.runtime.demo import DEMO_NOTICE, ensure_demo_checkpoint

        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - stdout announces the port
        model_dir = ensure_demo_checkpoint(progress_print=log)
        log(DEMO_NOTICE.format(path=model_dir))
    if dtype not in DTYPES:
        raise UsageError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    try:
        model = load_model(model_dir, device=device, dtype=getattr(torch, dtype), progress=False)
        tokenizer = Tokenizer(model_dir)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    engine = Engine(model, tokenizer, max_batch=max_batch, max_context=max_context)
    return Runtime(engine, tokenizer), Path(model_dir).resolve().name
