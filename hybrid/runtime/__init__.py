"""Generation runtime: static KV cache, engine (prefill / decode_step / generate), sampling, CUDA
graphs for decode, tokenizer, and the demo checkpoint. The engine API is documented in engine.py."""

from hybrid.runtime.config import RuntimeConfig
from hybrid.runtime.engine import Completion, Engine, Stats
from hybrid.runtime.kv_cache import StaticKVCache
from hybrid.runtime.sampling import SamplingParams, sample

__all__ = ["RuntimeConfig", "Completion", "Engine", "Stats", "StaticKVCache", "SamplingParams", "sample"]
