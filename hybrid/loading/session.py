"""open_session: a model ready to generate, for `hybrid generate`, `chat`, `profile-routing` and the server.
The steps run in order (hybrid.loading): parse, check, load, place, report; then the engine warms up."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

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
    # CUDA: the device's memory after each start-up step (vram_mark), for `generate --json` to set beside the plan
    vram: list = field(default_factory=list)


def vram_mark(device, phase: str, marks: list) -> None:
    """Appends {phase, allocated, reserved, peak_allocated, device_used} (bytes) on a CUDA device: torch's own
    allocations and caching, and the device's used memory as nvidia-smi counts it (CUDA context, cuBLAS workspaces
    and other libraries included); nothing elsewhere."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    marks.append({"phase": phase, "allocated": torch.cuda.memory_allocated(device),
                  "reserved": torch.cuda.memory_reserved(device),
                  "peak_allocated": torch.cuda.max_memory_allocated(device), "device_used": total - free})


def open_session(args, max_batch: int = 1, log=lambda m: print(m, file=sys.stderr)) -> Session:
    notes = []  # said once the model is loaded, so that a refusal (checks, the CPU executor) stays one line
    config = without_cpu_residents(session_config_from_args(args, max_batch), notes.append)
    model_dir, demo = resolve_model_dir(config, log)
    cfg, config = check_before_load(model_dir, config)
    config = with_ship_staging(with_pricing_profile(config, notes.append), cfg)
    config = eager_for_online_replace(config, log)
    model, offload = load_weights(model_dir, config, progress=not demo)
    vram = []
    vram_mark(config.device, "weights", vram)
    for line in notes:
        log(line)
    tokenizer = load_tokenizer(model_dir)
    warn_vocab_mismatch(cfg.vocab_size, tokenizer.vocab_size, log)
    report_gpu_weights(model, log)
    if offload is not None and getattr(offload, "load_times", None) is not None:
        log(f"hybrid: {offload.load_times.line()}")
    engine = Engine(model, tokenizer, config=config.runtime)
    vram_mark(config.device, "kv_cache", vram)
    if offload is not None:
        report_placement(model, offload, place(engine, offload, config.hybrid, log, config.gpu_dtypes), log)
        vram_mark(config.device, "residents", vram)
    engine.warmup()  # keep start-up (CUDA context, graph capture, oneDNN kernel JIT) out of the printed tokens/s
    vram_mark(config.device, "warm_up", vram)
    return Session(engine, tokenizer, model_dir, demo, config.device, config.dtype, offload, vram)
