"""Load: the checkpoint directory (--model, else the demo shipped in the package), then the model, with every
expert in the CPU executor when the hybrid flags are on, and its tokenizer."""

from __future__ import annotations

from hybrid.loading.parse import SessionConfig


def resolve_model_dir(config: SessionConfig, log) -> tuple[str, bool]:
    """(checkpoint directory, whether it is the built-in demo); the demo is announced in one line."""
    if config.model:
        return config.model, False
    from hybrid.runtime.demo import demo_checkpoint, demo_notice

    path = demo_checkpoint()
    log(demo_notice(path))
    return str(path), True


def load_weights(model_dir: str, config: SessionConfig, progress: bool):
    """-> (model, offload); offload is None for a plain model (all experts on its device)."""
    if config.hybrid is None:
        from hybrid.models import load_model

        return load_model(model_dir, device=config.device, dtype=config.dtype, progress=progress,
                          gpu_dtypes=config.gpu_dtypes), None
    from hybrid.offload.build import load_hybrid

    return load_hybrid(model_dir, config.device, config.dtype, config.hybrid, progress=progress,
                       gpu_dtypes=config.gpu_dtypes)


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer; a GGUF file's from its metadata, written once as tokenizer files beside the
    other caches ($HYBRID_CACHE/gguf-tokenizers, keyed by the file's path, size and mtime)."""
    from hybrid.models.gguf import is_gguf
    from hybrid.runtime.tokenizer import Tokenizer

    if is_gguf(model_dir):
        return Tokenizer(str(gguf_tokenizer_dir(model_dir)))
    return Tokenizer(model_dir)


def gguf_tokenizer_dir(path: str):
    import hashlib
    import shutil
    import tempfile
    from pathlib import Path

    from cpu_kernels.knobs import knobs
    from hybrid.models.checkpoints import open_cached
    from hybrid.models.gguf import write_tokenizer_files

    p = Path(path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    out = Path(knobs().cache).expanduser() / "gguf-tokenizers" / key
    if (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=out.parent))
    try:
        write_tokenizer_files(open_cached(path), tmp)
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer.json").is_file():  # not another process's finished copy
            raise
    return out
