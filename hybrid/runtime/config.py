"""RuntimeConfig: how an Engine runs a model (not what the model is: that is ModelConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from placement.memory import KV_DTYPES


@dataclass(frozen=True)
class RuntimeConfig:
    max_batch: int = 8  # KV-cache slots = sequences decoded together
    max_context: int = 4096  # positions per slot (prompt + generated)
    eager: bool | None = None  # None: CUDA graphs for decode on a GPU, eager elsewhere
    context_buckets: bool = True  # decode graphs per context bucket (False: each attends over max_context)
    # Greedy decode queues step n+1 (fed its tokens on the device) before the host reads step n's
    # (Engine.decode_queue); None: on with CUDA graphs, off when eager.
    decode_ahead: bool | None = None
    # A slot given back keeps its tokens' K/V; a later prompt sharing a long enough prefix with one prefills only
    # the rest (hybrid.runtime.prefix_cache). False: every prompt is prefilled whole, as before.
    prefix_cache: bool = True
    # KV-cache values: "bf16" keeps the model's dtype, "fp8" float8 e4m3 at half the bytes (hybrid.runtime.kv_cache)
    kv_dtype: str = "bf16"
    # Tokens of one prompt per model pass: a longer prompt is prefilled in pieces, each appended to its slot's
    # K/V, so prefill's activations (which placement.memory counts) stay those of this many tokens. Larger pieces
    # amortize each pass's expert copies over more tokens (prefill tok/s nearly doubled from 2,048 to 8,192).
    prefill_chunk: int = 8192

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_context < 2:
            raise ValueError(f"--max-context must be at least 2, got {self.max_context}")
        if self.prefill_chunk < 1:
            raise ValueError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
