"""Load: the checkpoint directory (the demo is built on first use), then the model, with every expert in the
CPU executor when the hybrid flags are on, and its tokenizer."""

from __future__ import annotations

from hybrid.loading.parse import SessionConfig


def resolve_model_dir(config: SessionConfig, log) -> tuple[str, bool]:
    """(checkpoint directory, whether it is the random-weight demo)."""
    if config.model:
        return config.model, False
    from hybrid.runtime.demo import DEMO_NOTICE, ensure_demo_checkpoint

    model_dir = str(ensure_demo_checkpoint(progress_print=log))
    log(DEMO_NOTICE.format(path=model_dir))
    return model_dir, True


def load_weights(model_dir: str, config: SessionConfig, progress: bool):
    """-> (model, offload); offload is None for a plain model (all experts on its device)."""
    if config.hybrid is None:
        from hybrid.models import load_model

        return load_model(model_dir, device=config.device, dtype=config.dtype, progress=progress), None
    from hybrid.offload.build import load_hybrid

    return load_hybrid(model_dir, config.device, config.dtype, config.hybrid, progress=progress)


def load_tokenizer(model_dir: str):
    from hybrid.runtime.tokenizer import Tokenizer

    return Tokenizer(model_dir)
