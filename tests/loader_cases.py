"""A tiny valid checkpoint and helpers to break it, shared by the loader robustness tests."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

TINY = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 320, "hidden_size": 32,
        "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "hidden_act": "silu"}


def write_tiny(out: Path, seed: int = 0, single_file: bool = False) -> Path:
    """The tiny Qwen3-MoE checkpoint: sharded with an index (the writer's layout) or one model.safetensors."""
    import torch
    from safetensors.torch import load_file, save_file

    from hybrid.models.writer import write_random_checkpoint

    write_random_checkpoint(out, dict(TINY), seed=seed, dtype=torch.bfloat16)
    if single_file:
        tensors = {}
        for shard in sorted(out.glob("model-*.safetensors")):
            tensors.update(load_file(str(shard)))
            shard.unlink()
        (out / "model.safetensors.index.json").unlink()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def split(file: Path) -> tuple[dict, bytes]:
    """(header dict, data bytes) of a safetensors file."""
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(file: Path, header, data: bytes, header_bytes: bytes | None = None) -> None:
    """Writes a safetensors file from a (possibly broken) header and data; header_bytes overrides the JSON."""
    hb = header_bytes if header_bytes is not None else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))
