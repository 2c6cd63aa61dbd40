"""Static KV cache: max_batch slots x max_context positions per layer, allocated once.

What a token stores is the attention kind's layout (ModelConfig.kv_layout: buffer name -> per-token shape):
grouped-query attention keeps k, v [L, S, C + 1, Hkv, hd]; Multi-head Latent Attention keeps one
`latent` [L, S, C + 1, kv_lora_rank + qk_rope_head_dim] (the compressed KV and the rope key, nothing
expanded per head). Column C is a spare that padding tokens (position -1) write into; queries only
attend to columns <= their own position < C, so it is never read. That keeps every write a fixed-shape
index_copy_, which CUDA graphs need.

Value dtype (`kv_dtype`, the `--kv-dtype` flag): "bf16" keeps the model's dtype (bf16 on a GPU, fp32 on the
CPU); "fp8" stores float8 e4m3 (1 byte a value, half of bf16), as vLLM's `--kv-cache-dtype fp8` does with its
default scale: one per-tensor scale constant of 1.0 (FP8_SCALE; nothing is divided or multiplied), so a value is
stored as itself rounded to e4m3 (3 mantissa bits: a relative error of at most 2^-4), and values beyond +-448
(FP8_MAX, e4m3's largest finite value) saturate there. They are clamped before the cast: e4m3fn has no infinity,
and casts have treated an overflow differently (older torch releases made it NaN; torch 2.13 and Triton's
satfinite saturate). Whether a model's K, V (or latent) stay inside +-448 is the model's matter: with a constant
scale, larger ones lose their size. Reads return the model's dtype
(every e4m3 value is exact in bf16), and every path attends to the values as stored, a fresh prefill included
(`as_stored`), so what a position holds is still a function of the tokens up to it (hybrid.runtime.prefix_cache's
exactness). MLA's latent takes fp8 the same way: it is written and read only through write/read. The GPU's fused
decode kernels (hybrid.gpu_kernels.attention) read and write fp8 caches; Triton's e4m3 conversions need compute
capability 8.9 or later (Ada, Hopper), so an older GPU is refused (`check_kv_dtype`).
"""

from __future__ import annotations

import torch

from placement.memory import KV_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448: larger magnitudes saturate here
FP8_SCALE = 1.0  # stored = value / scale: one constant for every tensor (vLLM's default), so the identity
FP8_MIN_CAPABILITY = (8, 9)  # Triton's float8e4nv loads and stores


def storage_dtype(kv_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """--kv-dtype -> the cache's element dtype for a model computing in `dtype`."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return FP8 if kv_dtype == "fp8" else dtype


def check_kv_dtype(kv_dtype: str, device) -> None:
    """Refuses (one line) an fp8 cache on a GPU older than compute capability 8.9, where the fused decode
    kernels cannot convert e4m3."""
    from hybrid.errors import UsageError

    device = torch.device(device)
    if kv_dtype != "fp8" or device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < FP8_MIN_CAPABILITY:
        raise UsageError(f"--kv-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}: use --kv-dtype bf16")


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x as an fp8 cache stores it (scale 1.0): clamped to +-FP8_MAX, rounded to the nearest e4m3 value."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


class StaticKVCache:
    def __init__(self, num_layers: int, max_batch: int, max_context: int, num_kv_heads: int = 0, head_dim: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 layout: dict[str, tuple[int, ...]] | None = None, kv_dtype: str = "bf16"):
        """layout: buffer name -> per-token shape (ModelConfig.kv_layout); default: K and V of
        num_kv_heads x head_dim, the grouped-query layout. dtype: the model's (what read returns);
        kv_dtype: "bf16" stores that dtype, "fp8" float8 e4m3 (module docstring)."""
        if max_batch <= 0 or max_context <= 0:
            raise ValueError("max_batch and max_context must be positive")
        if layout is None:
            if num_kv_heads <= 0 or head_dim <= 0:
                raise ValueError("give num_kv_heads and head_dim, or a layout")
            layout = {"k": (num_kv_heads, head_dim), "v": (num_kv_heads, head_dim)}
        check_kv_dtype(kv_dtype, device)
        self.max_batch, self.max_context = max_batch, max_context
        self.layout = dict(layout)
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.fp8 = storage_dtype(kv_dtype, dtype) == FP8
        self.buffers = {name: torch.zeros((num_layers, max_batch, max_context + 1, *shape),
                                          dtype=storage_dtype(kv_dtype, dtype), device=device)
                        for name, shape in self.layout.items()}

    @classmethod
    def for_model(cls, model, max_batch: int, max_context: int, kv_dtype: str = "bf16") -> "StaticKVCache":
        c = model.cfg
        return cls(c.num_layers, max_batch, max_context, dtype=model.dtype, device=model.device, layout=c.kv_layout,
                   kv_dtype=kv_dtype)

    @property
    def k(self) -> torch.Tensor:  # grouped-query layout
        return self.buffers["k"]

    @property
    def v(self) -> torch.Tensor:
        return self.buffers["v"]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def as_stored(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """values as a read of them after a write returns them: the same tensors unless the cache is fp8
        (then rounded through e4m3, clamped). A fresh prefill attends to these instead of reading back."""
        if not self.fp8:
            return values
        return tuple(to_fp8(v).to(v.dtype) for v in values)

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
            val = val.reshape(-1, *buf.shape[3:])
            if self.fp8:  # as bytes: torch's CPU index_copy_ has no float8 kernel
                dst.view(torch.uint8).index_copy_(0, flat, to_fp8(val).view(torch.uint8))
            else:
                dst.index_copy_(0, flat, val.to(dst.dtype))

    def read(self, layer: int, slots: torch.Tensor, kv_len: int | None) -> tuple[torch.Tensor, ...]:
        """-> one [B, L, *shape] per buffer (layout order) for the first L = kv_len (default max_context)
        positions of each slot, in the model's dtype."""
        L = self.max_context if kv_len is None else min(kv_len, self.max_context)
        return tuple(buf[layer][slots, :L].to(self.dtype) for buf in self.buffers.values())
