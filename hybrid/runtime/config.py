"""RuntimeConfig: how an Engine runs a model (not what the model is: that is ModelConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeConfig:
    max_batch: int = 8  # KV-cache slots = sequences decoded together
    max_context: int = 4096  # positions per slot (prompt + generated)
    eager: bool | None = None  # None: CUDA graphs for decode on a GPU, eager elsewhere

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")

    def kv_cache_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        """Bytes of the static cache (K and V, one spare column per slot)."""
        return 2 * num_layers * self.max_batch * (self.max_context + 1) * num_kv_heads * head_dim * dtype_bytes
