"""Generation runtime: static KV cache, engine (prefill / decode_step / generate), sampling, CUDA
graphs for decode, tokenizer, and the demo checkpoint. The engine API is documented in engine.py.

The names below are imported on first use (PEP 562), so that `from hybrid.runtime.config import RuntimeConfig`
(what the command-line parsers read for their defaults) does not import torch: `hybrid serve --help` answers at
once."""

from __future__ import annotations

import importlib

_WHERE = {"RuntimeConfig": "config", "Completion": "engine", "Engine": "engine", "Stats": "engine",
          "StaticKVCache": "kv_cache", "SamplingParams": "sampling", "sample": "sampling"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'hybrid.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hybrid.runtime.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
