"""Static KV cache: max_batch slots x max_context positions per layer, allocated once.

Layout per layer: k, v [S, C + 1, Hkv, hd]. Column C is a spare that padding tokens (position -1)
write into; queries only attend to columns <= their own position < C, so it is never read. That keeps
every write a fixed-shape index_copy_, which CUDA graphs need.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, num_layers: int, max_batch: int, max_context: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if max_batch <= 0 or max_context <= 0:
            raise ValueError("max_batch and max_context must be positive")
        self.max_batch, self.max_context = max_batch, max_context
        shape = (num_layers, max_batch, max_context + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, model, max_batch: int, max_context: int) -> "StaticKVCache":
        c = model.cfg
        return cls(c.num_layers, max_batch, max_context, c.num_kv_heads, c.head_dim, model.dtype, model.device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """slots [B], positions [B, T] (-1 = padding), k/v [B, T, Hkv, hd]."""
        C1 = self.max_context + 1
        col = torch.where(positions >= 0, positions, self.max_context)  # [B, T]
        flat = (slots[:, None] * C1 + col).reshape(-1)  # [B*T]
        kc = self.k[layer].view(-1, *self.k.shape[-2:])  # [S*(C+1), Hkv, hd]
        vc = self.v[layer].view(-1, *self.v.shape[-2:])
        kc.index_copy_(0, flat, k.reshape(-1, *k.shape[-2:]).to(kc.dtype))
        vc.index_copy_(0, flat, v.reshape(-1, *v.shape[-2:]).to(vc.dtype))

    def read(self, layer: int, slots: torch.Tensor, kv_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v [B, Hkv, L, hd] for the first L = kv_len (default max_context) positions of each slot."""
        L = self.max_context if kv_len is None else min(kv_len, self.max_context)
        k = self.k[layer][slots, :L].transpose(1, 2)
        v = self.v[layer][slots, :L].transpose(1, 2)
        return k, v
