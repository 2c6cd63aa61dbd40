"""Rotary position embeddings (RoPE) and the frequency scalings used by the supported configs.

Formulas: RoFormer (Su et al. 2021) for the base frequencies; position interpolation ("linear",
Chen et al. 2023); YaRN (Peng et al. 2023, sec. 3.2-3.4: NTK-by-parts ramp between beta_fast and
beta_slow rotations plus the 0.1 ln(s) + 1 attention temperature); Llama 3.1's smoothed band scaling.
Cos/sin are computed in fp32 from integer positions and only then cast, as the reference does, so bf16
results match it bit for bit.
"""

from __future__ import annotations

import math

import torch

from hybrid.models.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [hd/2] fp32, attention scaling applied to cos/sin)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    base = rope.theta ** exponent  # [hd/2]
    inv = 1.0 / base
    if rope.kind == "default":
        return inv, 1.0
    if rope.kind == "linear":
        return inv / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3(inv, rope), 1.0
    return _yarn(base, rope, head_dim)


def _llama3(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between smoothly mixed.
    old = rope.original_max_position
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    mixed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(band, mixed, scaled)


def _yarn(base: torch.Tensor, rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    s = rope.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attn = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attn = mscale(s, rope.mscale) / mscale(s, rope.mscale_all_dim)
    else:
        attn = mscale(s)

    def dim_for_rotations(rotations: float) -> float:
        # The dimension index whose wavelength fits `rotations` times into the original context.
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_for_rotations(rope.beta_fast), dim_for_rotations(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the original frequency), 0: interpolate by s
    inv = (1.0 / (s * base)) * (1 - keep) + (1.0 / base) * keep
    return inv, float(attn)


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many leading dims of each head are rotated: all of them unless partial_rotary_factor < 1
    (GLM-4.5: half), int(hd * factor) as the reference truncates it."""
    return int(head_dim * rope.partial_rotary_factor)


class Rotary(torch.nn.Module):
    """cos/sin for integer positions: forward(positions [B, T]) -> (cos, sin) each [B, T, rd], rd =
    rotary_dim(rope, hd) (= hd without partial rotary); the frequencies are those of an rd-dim head."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        inv, self.scaling = inv_frequencies(rope, rotary_dim(rope, head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, hd/2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, hd]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd]; cos/sin [B, T, rd], rd <= hd. Rotates the two halves of the first rd dims (the
    HF/NeoX layout; rd = hd: the whole head), the remaining hd - rd pass through (partial rotary)."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
