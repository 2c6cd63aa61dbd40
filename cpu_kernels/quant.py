"""Weight quantization for the CPU executor (pure torch; the packed formats the kernels read).

int8: per output channel (row) symmetric: q = round(w / s), s = max|w_row| / 127, q in [-127, 127]
      (never -128, so the AVX2 sign trick and VNNI sums stay exact); w ~ q * s.
int4: per row and group of `group` reduction values (32, 64 or 128): s = max|w_group| / 7,
      q = clamp(round(w / s), -8, 7), stored as the nibble q + 8. Within each 64-value chunk of a row the
      32 bytes hold values 0..31 in their low nibbles and 32..63 in their high nibbles, so one 32-byte
      load unpacks to 64 consecutive values with one AND and one shift. w ~ (nibble - 8) * s.
Rounding is round-half-to-even, as in the kernels' on-the-fly activation quantization.
"""

from __future__ import annotations

import torch

GROUP_SIZES = (32, 64, 128)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] -> (q int8 [..., R, K], scale fp32 [..., R])."""
    wf = w.float()
    amax = wf.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(wf * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """u uint8 [..., R, K] with values 0..15, K % 64 == 0 -> [..., R, K/2] (layout in the module doc)."""
    *lead, K = u.shape
    c = u.reshape(*lead, K // 64, 2, 32)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*lead, K // 2).contiguous()


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    *lead, H = p.shape
    c = p.reshape(*lead, H // 32, 32)
    return torch.stack([c & 0x0F, c >> 4], dim=-2).reshape(*lead, H * 2)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, K] (K % 64 == 0, K % group == 0) -> (packed uint8 [..., R, K/2], scale [..., R, K/group])."""
    if group not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group}")
    *lead, R, K = w.shape
    if K % 64 or K % group:
        raise ValueError(f"int4: reduction length {K} must be a multiple of 64 and of the group {group}")
    wg = w.float().reshape(*lead, R, K // group, group)
    amax = wg.abs().amax(-1)
    inv = torch.where(amax > 0, 7.0 / amax, torch.zeros_like(amax))
    q = torch.round(wg * inv[..., None]).clamp(-8, 7)
    u = (q + 8).to(torch.uint8).reshape(*lead, R, K)
    return pack_nibbles(u), amax / 7.0


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    q = unpack_nibbles(packed).float() - 8.0
    return q * scale.repeat_interleave(group, dim=-1)
