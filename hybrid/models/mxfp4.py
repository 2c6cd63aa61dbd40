"""MXFP4 expert checkpoints as OpenAI publishes gpt-oss.

config.json says so: "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [...]}. Each
expert matrix `X` of a layer ([E, R, K] as the rows of its linear layers) is stored as `X_blocks` uint8 [E, R,
K/32, 16] (two e2m1 codes a byte, low nibble first) with `X_scales` uint8 [E, R, K/32] (a power-of-two
exponent, bias 127, per 32 values): gpt-oss's `mlp.experts.gate_up_proj_blocks` [E, 2F, D/32, 16] (even rows
gate, odd rows up) and `down_proj_blocks` [E, D, F/32, 16]; the biases are plain tensors
(transformers: integrations/mxfp4.py). The format's arithmetic is cpu_kernels.quant's (dequantize_mxfp4,
quantize_mxfp4); which tensors are MXFP4 is read from the files (U8 `_blocks` with their `_scales`).

The loader keeps the published bytes until a layer's experts are streamed: gate and up are separated by
selecting rows of the packed blocks (no float copy), then de-quantized a few experts at a time into the
layer's expert stack (the GPU model's bf16, or what the CPU executor packs into bf16 / int8 / int4), so no
de-quantized copy of more than one layer's experts exists.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid.models.errors import ModelLoadError

BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32  # values per scale (cpu_kernels.quant.MXFP4_BLOCK)
DEQUANT_CHUNK = 8  # experts de-quantized at once (fp32 staging for 8 experts, not for a layer)


def declared(raw: dict) -> bool:
    q = raw.get("quantization_config") or {}
    return q.get("quant_method") == "mxfp4"


def pair_scales(ckpt: dict[str, tuple[Path, dict]], is_declared: bool) -> dict[str, tuple[Path, dict]]:
    """Takes every `X_scales` out of the checkpoint index `ckpt` (name -> (file, header entry)), checks it
    against its `X_blocks` (U8, shape = the scales' + [16]) and returns blocks name -> the scales' entry."""
    blocks = [n for n, (_, e) in ckpt.items() if n.endswith(BLOCKS) and e["dtype"] == "U8"]
    if blocks and not is_declared:
        raise ModelLoadError(f"tensor {blocks[0]!r} is MXFP4 (uint8 blocks) but config.json has no mxfp4 "
                             "quantization_config")
    out = {}
    for n in [n for n in ckpt if n.endswith(SCALES)]:
        b = n[: -len(SCALES)] + BLOCKS
        if b not in ckpt:
            raise ModelLoadError(f"tensor {n!r}: MXFP4 scales without their blocks {b!r}")
        out[b] = ckpt.pop(n)
    for b in blocks:
        if b not in out:
            raise ModelLoadError(f"MXFP4 tensor {b!r} has no scales {b[: -len(BLOCKS)] + SCALES!r}")
        shape, (_, s) = ckpt[b][1]["shape"], out[b]
        if s["dtype"] != "U8" or list(s["shape"]) + [BLOCK // 2] != list(shape):
            raise ModelLoadError(f"tensor {b[: -len(BLOCKS)] + SCALES!r}: expected U8 {list(shape[:-1])} for blocks "
                                 f"{list(shape)}, found {s['dtype']} {s['shape']}")
    return out


def blocks_shape(experts: int, rows: int, k: int, name: str) -> tuple[int, int, int, int]:
    if k % BLOCK:
        raise ModelLoadError(f"tensor {name!r}: MXFP4 needs a reduction length that is a multiple of {BLOCK}, "
                             f"this config's is {k}")
    return (experts, rows, k // BLOCK, BLOCK // 2)


def dequantize_into(dst: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, rows=slice(None)) -> None:
    """dst [E, R', K] (any float dtype) = the MXFP4 matrix's rows `rows` (a slice of blocks [E, R, K/32, 16]
    and scales [E, R, K/32]: the row selection happens on the packed bytes), DEQUANT_CHUNK experts at a time."""
    from cpu_kernels.quant import dequantize_mxfp4

    for e0 in range(0, dst.shape[0], DEQUANT_CHUNK):
        e1 = e0 + DEQUANT_CHUNK
        dst[e0:e1].copy_(dequantize_mxfp4(blocks[e0:e1, rows], scales[e0:e1, rows], dst.dtype))


def check_scales(name: str, file: Path, scales: torch.Tensor) -> None:
    """Exponent 255 is NaN in the format (OCP E8M0); de-quantized it would be Inf. Refused as the loader refuses
    NaN/Inf weights (where the blocks are kept packed, so no float copy shows it)."""
    bad = int((scales == 255).sum())
    if bad:
        raise ModelLoadError(f"tensor {name!r} in {file.name}: {bad} MXFP4 scale(s) of 255 (NaN) of {scales.numel()}; "
                             "the checkpoint is corrupt")
