"""open_session: a model ready to generate, for `hybrid generate`, `chat`, `profile-routing` and the server.
The steps run in order (hybrid.loading): parse, check, load, place, report; then the engine warms up."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from hybrid.loading.check import check_before_load, eager_for_online_replace, warn_vocab_mismatch
from hybrid.loading.load import load_tokenizer, load_weights, resolve_model_dir
from hybrid.loading.parse import session_config_from_args
from hybrid.loading.place import place
from hybrid.loading.report import report_placement
from hybrid.runtime.engine import Engine


@dataclass
class Session:
    engine: object
    tokenizer: object
    model_dir: str
    demo: bool
    device: torch.device
    dtype: torch.dtype
    offload: object = None  # hybrid.offload.Offload when cold experts live on the CPU


def open_session(args, max_batch: int = 1, log=lambda m: print(m, file=sys.stderr)) -> Session:
    config = session_config_from_args(args, max_batch)
    model_dir, demo = resolve_model_dir(config, log)
    cfg, config = check_before_load(model_dir, config)
    config = eager_for_online_replace(config, log)
    model, offload = load_weights(model_dir, config, progress=not demo)
    tokenizer = load_tokenizer(model_dir)
    warn_vocab_mismatch(cfg.vocab_size, tokenizer.vocab_size, log)
    engine = Engine(model, tokenizer, config=config.runtime)
    if offload is not None:
        report_placement(model, offload, place(engine, offload, config.hybrid, log), log)
    engine.warmup()  # keep start-up (CUDA context, graph capture, oneDNN kernel JIT) out of the printed tokens/s
    return Session(engine, tokenizer, model_dir, demo, config.device, config.dtype, offload)
