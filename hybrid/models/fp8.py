"""Block-wise FP8 checkpoints as DeepSeek-V3 / Kimi-K2 publish them.

config.json says so: "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[128, 128], "activation_scheme": "dynamic"}. Each quantized matrix `X.weight` [R, C] is stored as
float8_e4m3fn (safetensors dtype F8_E4M3) next to `X.weight_scale_inv` [ceil(R/128), ceil(C/128)] fp32,
and the real weight is w[r, c] = q[r, c] * scale_inv[r // 128, c // 128] (DeepSeek-V3's inference code,
weight_dequant). Which tensors are quantized is read from the files' dtypes, never from names.

The loader de-quantizes each tensor as it is streamed (fp32, then whatever its destination holds: the GPU
model's bf16, or the expert stack the CPU executor packs into bf16 / int8 / int4), so no de-quantized copy
of more than one layer's experts ever exists. Activations stay in the model's dtype ("dynamic" activation
scaling is an FP8-GEMM detail that de-quantized weights do not need).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid.models.errors import ModelLoadError

FP8_DTYPE = "F8_E4M3"  # safetensors' name for torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
E4M3_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class BlockFP8:
    block: tuple[int, int] = (128, 128)

    def __post_init__(self):
        if len(self.block) != 2 or min(self.block) < 1:
            raise ModelLoadError(f"config.json: fp8 weight_block_size must be two positive ints, got {list(self.block)}")


def quantization(raw: dict) -> BlockFP8 | None:
    """The checkpoint's weight quantization from config.json (a nested text_config's too); None if the
    weights are plain or MXFP4 (hybrid.models.mxfp4). Anything else is refused with what was found."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: hybrid.models.mxfp4
        return None
    if method != "fp8":
        raise ModelLoadError(f"config.json: quantization_config quant_method {method!r} is not supported "
                             "(supported: block-wise fp8 as DeepSeek-V3 publishes it, mxfp4 experts as gpt-oss; or de-quantize "
                              "to bf16)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"config.json: fp8 format {q.get('fmt')!r} is not supported (only e4m3)")
    block = q.get("weight_block_size")
    if not block:
        raise ModelLoadError("config.json: fp8 without weight_block_size (per-tensor fp8) is not supported")
    return BlockFP8(tuple(int(b) for b in block))


def scale_shape(shape, block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def pair_scales(ckpt: dict[str, tuple[Path, dict]], quant: BlockFP8 | None) -> dict[str, tuple[Path, dict]]:
    """Takes every `X.weight_scale_inv` out of the checkpoint index `ckpt` (name -> (file, header entry)),
    checks it against its F8_E4M3 weight, and returns weight name -> the scale's (file, entry)."""
    fp8 = [n for n, (_, e) in ckpt.items() if e["dtype"] == FP8_DTYPE]
    if fp8 and quant is None:
        raise ModelLoadError(f"tensor {fp8[0]!r} is float8_e4m3fn but config.json has no fp8 quantization_config")
    scales = {}
    for n in [n for n in ckpt if n.endswith(SCALE_SUFFIX)]:
        w = n[: -len(SCALE_SUFFIX)]
        if w not in ckpt or ckpt[w][1]["dtype"] != FP8_DTYPE:
            raise ModelLoadError(f"tensor {n!r}: a block scale without an fp8 weight {w!r}")
        scales[w] = ckpt.pop(n)
    for n in fp8:
        if n not in scales:
            raise ModelLoadError(f"fp8 tensor {n!r} has no block scale {n + SCALE_SUFFIX!r}")
        shape, (_, s) = ckpt[n][1]["shape"], scales[n]
        if len(shape) != 2:
            raise ModelLoadError(f"fp8 tensor {n!r}: expected a matrix, found shape {shape}")
        want = scale_shape(shape, quant.block)
        if tuple(s["shape"]) != want or s["dtype"] not in ("F32", "BF16"):
            raise ModelLoadError(f"tensor {n + SCALE_SUFFIX!r}: expected {list(want)} F32 block scales for "
                                 f"{list(shape)} in {list(quant.block)} blocks, found {s['shape']} {s['dtype']}")
    return scales


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q [R, C] float8_e4m3fn, scale_inv [ceil(R/b0), ceil(C/b1)] -> fp32 [R, C]."""
    R, C = q.shape
    b0, b1 = block
    if R % b0 == 0 and C % b1 == 0:  # the published shapes: one broadcast multiply, no expanded scale tensor
        out = q.float().view(R // b0, b0, C // b1, b1)
        out.mul_(scale_inv.float()[:, None, :, None])
        return out.view(R, C)
    s = scale_inv.float().repeat_interleave(b0, 0)[:R].repeat_interleave(b1, 1)[:, :C]
    return q.float() * s


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (q float8_e4m3fn [R, C], scale_inv fp32 [ceil(R/b0), ceil(C/b1)]): each block's largest
    magnitude maps to E4M3_MAX (the checkpoint writer's side; runs on w's device)."""
    R, C = w.shape
    b0, b1 = block
    Rp, Cp = -(-R // b0) * b0, -(-C // b1) * b1
    wp = torch.nn.functional.pad(w.float(), (0, Cp - C, 0, Rp - R)).view(Rp // b0, b0, Cp // b1, b1)
    amax = wp.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [R/b0, C/b1]
    scale_inv = amax / E4M3_MAX
    q = (wp / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(Rp, Cp)[:R, :C].contiguous(), scale_inv.float()
