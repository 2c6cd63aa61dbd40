"""open_session: a model ready to generate, for `hybrid generate`, `chat`, `profile-routing` and the server.
The steps run in order (hybrid.loading): parse, check, load, place, report; then the engine warms up."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from hybrid.loading.check import (check_before_load, eager_for_online_replace, warn_vocab_mismatch,
                                  without_cpu_residents)
from hybrid.loading.load import load_tokenizer, load_weights, resolve_model_dir
from hybrid.loading.parse import session_config_from_args, with_pricing_profile, with_ship_staging
from hybrid.loading.place import place
from hybrid.loading.report import report_gpu_weights, report_placement
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
    notes = []  # said once the model is loaded, so that a refusal (checks, the CPU executor) stays one line
    config = without_cpu_residents(session_config_from_args(args, max_batch), notes.append)
    model_dir, demo = resolve_model_dir(config, log)
    cfg, config = check_before_load(model_dir, config)
    config = with_ship_staging(with_pricing_profile(config, notes.append), cfg)
    config = eager_for_online_replace(config, log)
    model, offload = load_weights(model_dir, config, progress=not demo)
    for line in notes:
        log(line)
    tokenizer = load_tokenizer(model_dir)
    warn_vocab_mismatch(cfg.vocab_size, tokenizer.vocab_size, log)
    report_gpu_weights(model, log)
    if offload is not None and getattr(offload, "load_times", None) is not None:
        log(f"hybrid: {offload.load_times.line()}")
    engine = Engine(model, tokenizer, config=config.runtime)
    if offload is not None:
        report_placement(model, offload, place(engine, offload, config.hybrid, log, config.gpu_dtypes), log)
    engine.warmup()  # keep start-up (CUDA context, graph capture, oneDNN kernel JIT) out of the printed tokens/s
    return Session(engine, tokenizer, model_dir, demo, config.device, config.dtype, offload)
