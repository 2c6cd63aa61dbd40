"""A checkpoint of any supported format, by path: a Hugging Face directory (config.json + safetensors,
hybrid.models.loader) or a GGUF file (llama.cpp's format, any part of a split one: hybrid.models.gguf).

    family, cfg, raw = read_config(path)     # config only
    cfg = check_checkpoint(path)             # + every tensor's name, shape and dtype, nothing allocated
    model = load_model(path, device=..., dtype=..., experts_factory=..., gpu_dtypes=...)

A GGUF file is opened once per process and path (gguf-py parses a 150 K-token vocabulary in seconds; the
file is memory-mapped, so keeping it open costs no memory) and re-opened when its size or mtime changes.
"""

from __future__ import annotations

import functools
from pathlib import Path

from hybrid.models import loader
from hybrid.models.errors import ModelLoadError
from hybrid.models.gguf import is_gguf, load_gguf, open_gguf
from hybrid.models.gguf.load import check_gguf


@functools.lru_cache(maxsize=4)
def _opened(path: str, size: int, mtime_ns: int):
    return open_gguf(path)


def open_cached(path) -> object:
    """The GgufCheckpoint at `path`, parsed once while the file is unchanged."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise ModelLoadError(f"model file not found: {path} ({exc.strerror})") from None
    return _opened(str(p), st.st_size, st.st_mtime_ns)


def read_config(path):
    """(family, ModelConfig, raw config dict) of a checkpoint directory or GGUF file."""
    if is_gguf(path):
        ckpt = open_cached(path)
        return ckpt.family, ckpt.config, ckpt.raw_config
    return loader.read_config(path)


def check_checkpoint(path):
    """The ModelConfig, after the checkpoint's tensors are checked against it (no tensor data read)."""
    if is_gguf(path):
        return check_gguf(open_cached(path))
    return loader.check_checkpoint(path)


def load_model(path, *, mxfp4_experts: bool = False, experts_cached=None, cpu_format=None, layer_formats: bool = False,
               **kwargs):
    """hybrid.models.loader.load_model for a directory, hybrid.models.gguf.load_gguf for a GGUF file (either skips
    the experts of the layers `experts_cached` says a packed cache holds). cpu_format: (dtype, int4 group) of the CPU executor an experts_factory packs
    for: a GGUF file's expert blocks that it holds exactly (Q4_0 in int4 group 32, MXFP4 in mxfp4) reach the
    factory as they are, the others de-quantized (hybrid.models.gguf.repack); a directory's MXFP4 experts
    follow mxfp4_experts. --cpu-dtype mxfp4 is refused for a GGUF file without MXFP4 experts. layer_formats: a GGUF
    file's layers each in the format of its own gate and up blocks (load_gguf)."""
    if not is_gguf(path):
        return loader.load_model(path, mxfp4_experts=mxfp4_experts, experts_cached=experts_cached, **kwargs)
    from hybrid.models.gguf.repack import file_types

    ckpt = open_cached(path)
    if mxfp4_experts:
        kinds = file_types(ckpt)
        if "MXFP4" not in kinds:
            raise ModelLoadError(f"{Path(path).name}: --cpu-dtype mxfp4 keeps MXFP4 experts as published; this file's "
                                 f"experts are {', '.join(sorted(kinds))}, which would be de-quantized, so choose "
                                 "bf16, int8 or int4")
        cpu_format = ("mxfp4", 32)
    return load_gguf(ckpt, cpu_format=cpu_format, experts_cached=experts_cached, layer_formats=layer_formats, **kwargs)
