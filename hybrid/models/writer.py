"""Write a Hugging Face-layout checkpoint with random weights for any supported config.

The tensor names come from the same family weight map the loader reads (per-expert names, as real
checkpoints store them; gpt-oss's fused tensors, optionally in MXFP4 as published), so a written checkpoint
loads back through the normal path. One shard per decoder layer keeps peak memory at one layer's weights; an
index file lists the shards. The shards are written into a hidden folder beside the destination and renamed into
place at the end: a full disk or a signal leaves no half checkpoint (and an earlier one at that path intact).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from hybrid.models.families import family_for
from hybrid.models import mxfp4 as mx
from hybrid.models.fp8 import SCALE_SUFFIX, quantize
from hybrid.models.transformer import MoETransformer


def _tensors_by_layer(raw_config: dict) -> tuple[dict[int | None, list[tuple[str, tuple]]], object]:
    family = family_for(raw_config)
    cfg = family.parse_config(raw_config)
    with torch.device("meta"):
        skeleton = MoETransformer(cfg, build_experts=False)
    groups: dict[int | None, list[tuple[str, tuple]]] = {}
    from hybrid.models.loader import _template

    for name, p in skeleton.named_parameters():
        key, layer = _template(name)
        groups.setdefault(layer, []).append((family.weights[key].format(i=layer), tuple(p.shape)))
    E, F_, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    for i, moe in enumerate(cfg.moe_layers):
        if moe and family.fused_layout == "interleaved":  # gpt-oss: fused only, as transformers stores it
            fused = {k: v.format(i=i) for k, v in family.fused_experts.items()}
            groups[i] += [(fused["gate_up"], (E, D, 2 * F_)), (fused["down"], (E, F_, D)),
                          (fused["gate_up_bias"], (E, 2 * F_)), (fused["down_bias"], (E, D))]
        elif moe:
            for e in range(E):
                for w, shape in (("w_gate", (F_, D)), ("w_up", (F_, D)), ("w_down", (D, F_))):
                    groups[i].append((family.experts[w].format(i=i, e=e), shape))
    return groups, cfg


def fp8_quantized(name: str, shape: tuple) -> bool:
    """Which tensors a block-FP8 checkpoint stores in float8 (DeepSeek-V3's published layout): every linear
    layer's matrix (attention, dense and shared MLPs, experts); embeddings, head, router, norms and the
    score bias stay bf16 / fp32. A writer's choice only: the loader reads the dtypes from the files."""
    return len(shape) == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


@torch.no_grad()
def write_random_checkpoint(out_dir: str | Path, raw_config: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                            std: float = 0.02, device: str = "cpu", progress: bool = False,
                            fp8_block: tuple[int, int] | None = None, mxfp4: bool = False) -> Path:
    """Writes config.json, model-XXXXX-of-YYYYY.safetensors shards and their index into out_dir.
    Norm scales are 1, biases 0, everything else N(0, std). `device` generates the numbers (a GPU
    is much faster for big presets); they are written from host memory. fp8_block (e.g. (128, 128)):
    linear weights as float8_e4m3fn with `weight_scale_inv` block scales and the quantization_config
    DeepSeek-V3 publishes (hybrid.models.fp8); the de-quantized values are what a loader must see. mxfp4
    (gpt-oss): the experts' gate_up / down as MXFP4 `_blocks` + `_scales` (cpu_kernels.quant.quantize_mxfp4 of
    the random weights, one expert at a time) with the quantization_config openai/gpt-oss publishes."""
    final = Path(out_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    try:
        _write(out, raw_config, seed, dtype, std, device, progress, fp8_block, mxfp4)
        _move_into_place(out, final)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return final


def _move_into_place(new: Path, final: Path) -> None:
    """Renames the finished folder `new` to `final`; a folder already there is renamed away first and removed
    after, so `final` always holds one whole checkpoint."""
    if not final.exists():
        new.rename(final)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
    old.rmdir()
    final.rename(old)
    try:
        new.rename(final)
    except BaseException:
        old.rename(final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write(out: Path, raw_config: dict, seed, dtype, std, device, progress, fp8_block, mxfp4) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    groups, cfg = _tensors_by_layer(raw_config)
    family = family_for(raw_config)
    if mxfp4 and family.fused_layout != "interleaved":
        raise ValueError(f"mxfp4 checkpoints are gpt-oss's; {cfg.family} is not written in MXFP4")
    mx_names = {family.fused_experts[k].format(i=i) for i in cfg.moe_layer_indices for k in ("gate_up", "down")} \
        if mxfp4 else set()
    gen = torch.Generator(device=device).manual_seed(seed)
    order = [None] + [i for i in range(cfg.num_layers)]
    n = len(order)
    weight_map, total = {}, 0
    # one step per tensor, and per expert of an MXFP4 stack (each is drawn and quantized on its own: seconds apiece
    # on a CPU), so the bar moves however the work is split
    steps = sum(shape[0] if name in mx_names else 1 for layer in order for name, shape in groups.get(layer, []))
    bar = tqdm(total=steps, desc="writing tensors", unit="tensor", disable=not progress)
    for k, layer in enumerate(order):
        tensors = {}
        for name, shape in groups.get(layer, []):
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            elif name.endswith(".bias"):
                t = torch.zeros(shape, dtype=dtype)
            elif name in mx_names:
                for suffix, v in _mxfp4_experts(shape, std, gen, device, bar.update).items():
                    tensors[name + suffix] = v
                    total += v.numel()
                continue
            else:
                t = torch.empty(shape, device=device).normal_(0.0, std, generator=gen)
                if fp8_block is not None and fp8_quantized(name, shape):
                    q, scale_inv = quantize(t, fp8_block)
                    tensors[name + SCALE_SUFFIX] = scale_inv.cpu()
                    total += scale_inv.numel() * 4
                    t = q
                t = t.to(dtype).cpu() if t.dtype == torch.float32 else t.cpu()
            tensors[name] = t.contiguous()
            total += t.numel() * t.element_size()
            bar.update(1)
        shard = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
        del tensors
    bar.close()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    if mxfp4:
        from hybrid.models.presets import MXFP4_QUANTIZATION

        raw_config = dict(raw_config, quantization_config=MXFP4_QUANTIZATION)
    if fp8_block is not None:
        raw_config = dict(raw_config, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                                           "quant_method": "fp8", "weight_block_size": list(fp8_block)})
    (out / "config.json").write_text(json.dumps(raw_config, indent=2))


def _mxfp4_experts(shape: tuple, std: float, gen: torch.Generator, device, done=lambda n: None) -> dict[str, torch.Tensor]:
    """A fused expert tensor of transformers' layout ([E, D, 2F] gate_up / [E, F, D] down: inputs first) as
    published MXFP4 {"_blocks": [E, R, K/32, 16], "_scales": [E, R, K/32]} of its rows [E, R, K] (R outputs,
    K inputs), drawn and quantized one expert at a time on `device` (quantize_mxfp4 makes its code table with
    the default device, set here: a GPU quantizes a gpt-oss-120b layer in seconds, 2 CPU cores in minutes)."""
    from cpu_kernels.quant import quantize_mxfp4

    E, K, R = shape
    blocks = torch.empty(E, R, K // mx.BLOCK, mx.BLOCK // 2, dtype=torch.uint8)
    scales = torch.empty(E, R, K // mx.BLOCK, dtype=torch.uint8)
    with torch.device(device):
        for e in range(E):
            b, s = quantize_mxfp4(torch.empty(R, K, device=device).normal_(0.0, std, generator=gen))
            blocks[e], scales[e] = b.cpu(), s.cpu()
            done(1)
    return {mx.BLOCKS: blocks, mx.SCALES: scales}
