"""Static KV cache: max_batch slots x max_context positions per layer, allocated once.

What a token stores is the attention kind's layout (ModelConfig.kv_layout: buffer name -> per-token shape):
grouped-query attention keeps k, v [L, S, C + 1, Hkv, hd]; Multi-head Latent Attention keeps one
`latent` [L, S, C + 1, kv_lora_rank + qk_rope_head_dim] (the compressed KV and the rope key, nothing
expanded per head). Column C is a spare that padding tokens (position -1) write into; queries only
attend to columns <= their own position < C, so it is never read. That keeps every write a fixed-shape
index_copy_, which CUDA graphs need.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, num_layers: int, max_batch: int, max_context: int, num_kv_heads: int = 0, head_dim: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 layout: dict[str, tuple[int, ...]] | None = None):
        """layout: buffer name -> per-token shape (ModelConfig.kv_layout); default: K and V of
        num_kv_heads x head_dim, the grouped-query layout."""
        if max_batch <= 0 or max_context <= 0:
            raise ValueError("max_batch and max_context must be positive")
        if layout is None:
            if num_kv_heads <= 0 or head_dim <= 0:
                raise ValueError("give num_kv_heads and head_dim, or a layout")
            layout = {"k": (num_kv_heads, head_dim), "v": (num_kv_heads, head_dim)}
        self.max_batch, self.max_context = max_batch, max_context
        self.layout = dict(layout)
        self.buffers = {name: torch.zeros((num_layers, max_batch, max_context + 1, *shape), dtype=dtype, device=device)
                        for name, shape in self.layout.items()}

    @classmethod
    def for_model(cls, model, max_batch: int, max_context: int) -> "StaticKVCache":
        c = model.cfg
        return cls(c.num_layers, max_batch, max_context, dtype=model.dtype, device=model.device, layout=c.kv_layout)

    @property
    def k(self) -> torch.Tensor:  # grouped-query layout
        return self.buffers["k"]

    @property
    def v(self) -> torch.Tensor:
        return self.buffers["v"]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, *values: torch.Tensor,
              step: dict | None = None):
        """slots [B], positions [B, T] (-1 = padding), one tensor [B, T, *shape] per buffer, in layout order.
        step: a dict that lives for one forward step (the same slots and positions in every layer): the write
        index is computed by the first layer and reused (4 fewer kernels per layer in decode graphs)."""
        flat = step.get("kv_flat") if step is not None else None
        if flat is None:
            C1 = self.max_context + 1
            col = torch.where(positions >= 0, positions, self.max_context)  # [B, T]
            flat = (slots[:, None] * C1 + col).reshape(-1)  # [B*T]
            if step is not None:
                step["kv_flat"] = flat
        for buf, val in zip(self.buffers.values(), values, strict=True):
            dst = buf[layer].view(-1, *buf.shape[3:])  # [S*(C+1), *shape]
            dst.index_copy_(0, flat, val.reshape(-1, *buf.shape[3:]).to(dst.dtype))

    def read(self, layer: int, slots: torch.Tensor, kv_len: int | None) -> tuple[torch.Tensor, ...]:
        """-> one [B, L, *shape] per buffer (layout order) for the first L = kv_len (default max_context)
        positions of each slot."""
        L = self.max_context if kv_len is None else min(kv_len, self.max_context)
        return tuple(buf[layer][slots, :L] for buf in self.buffers.values())
