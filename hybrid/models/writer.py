"""Write a Hugging Face-layout checkpoint with random weights for any supported config.

The tensor names come from the same family weight map the loader reads (per-expert names, as real
checkpoints store them), so a written checkpoint loads back through the normal path. One shard per
decoder layer keeps peak memory at one layer's weights; an index file lists the shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybrid.models.families import family_for
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
        if moe:
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
                            fp8_block: tuple[int, int] | None = None) -> Path:
    """Writes config.json, model-XXXXX-of-YYYYY.safetensors shards and their index into out_dir.
    Norm scales are 1, biases 0, everything else N(0, std). `device` generates the numbers (a GPU
    is much faster for big presets); they are written from host memory. fp8_block (e.g. (128, 128)):
    linear weights as float8_e4m3fn with `weight_scale_inv` block scales and the quantization_config
    DeepSeek-V3 publishes (hybrid.models.fp8); the de-quantized values are what a loader must see."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups, cfg = _tensors_by_layer(raw_config)
    gen = torch.Generator(device=device).manual_seed(seed)
    order = [None] + [i for i in range(cfg.num_layers)]
    n = len(order)
    weight_map, total = {}, 0
    for k, layer in enumerate(tqdm(order, desc="writing shards", disable=not progress)):
        tensors = {}
        for name, shape in groups.get(layer, []):
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            elif name.endswith(".bias"):
                t = torch.zeros(shape, dtype=dtype)
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
        shard = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    if fp8_block is not None:
        raw_config = dict(raw_config, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                                           "quant_method": "fp8", "weight_block_size": list(fp8_block)})
    (out / "config.json").write_text(json.dumps(raw_config, indent=2))
    return out
