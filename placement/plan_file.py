"""The plan file `hybrid plan --out` writes and `generate/chat/serve --plan` read (JSON, validated).

    {"schema_version": 1, "kind": "hybrid-plan",
     "model": {"family", "num_layers", "num_experts", "topk", "hidden", "intermediate", "moe_layers": [..]},
     "settings": {"max_context", "max_batch", "cpu_dtype", "int4_group" (int4 only), "down_dtypes" (a GGUF file's
                  layers whose down has a CPU dtype of its own, one entry each; priced, informational), "layer_dtypes"
                  (the same for a mixed GGUF file's layers whose gate and up have one), "gpu_dtype_bytes",
                  "staging_slots", "ship_chunk", "kv_dtype", "reserve", "node_threads": [..], "prefill_tokens",
                  "profile", "stats": {..}},
     "gpu_bytes", "gpu_budget_bytes", "cpu_bytes", "cpu_budget_bytes",        # bytes
     "memory": {"gpu": {non_expert, kv_cache, staging, graph_buffers, reserve, resident_experts,
                        per_resident_expert}, "cpu": {experts, cold_experts, pinned_buffers, per_expert}},
     "layers": [{"layer": model layer index, "resident_experts": [expert ids], "predicted_saving_s": s}],
     "numa": [{"node", "threads", "f_start", "f_end", "bytes", "cold_bytes"}],
     "predicted_decode_tokens_per_s", "predicted_prefill_tokens_per_s"}

`predicted_saving_s` is the layer's predicted decode-step seconds saved by its resident experts. `staging_slots`
x `ship_chunk` is the ship lane's staging (chosen by placement.planner.choose_staging unless given), which the
runtime allocates as the plan says, since the plan's VRAM includes it. `kv_dtype` (bf16 or fp8) is the KV
cache's value dtype the plan priced; `--plan` runs use it (a different --kv-dtype is refused; plans without the
field: --kv-dtype's, default bf16). `int4_group` is the int4 experts' group size the plan priced; `--plan` runs load
with it (a different --int4-group is refused).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from cpu_kernels.dtypes import NAMES as CPU_DTYPE_NAMES
from placement.errors import UsageError
from placement.memory import KV_DTYPES
from placement.json_file import read_json, write_json

SCHEMA_VERSION = 1
KIND = "hybrid-plan"


@dataclass(frozen=True)
class LayerPlan:
    layer: int  # model layer index (an MoE layer)
    resident_experts: tuple[int, ...]
    predicted_saving_s: float = 0.0

    def __post_init__(self):
        ids = tuple(int(e) for e in self.resident_experts)
        if len(set(ids)) != len(ids) or any(e < 0 for e in ids):
            raise UsageError(f"plan layer {self.layer}: resident experts must be distinct ids >= 0")
        object.__setattr__(self, "resident_experts", ids)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Fields the runtime reads from a plan, with their types: a hand-edited "staging_slots": "4" was a traceback
# deep in loading; now it is named here.
_MODEL_INTS = ("num_layers", "num_experts", "topk", "hidden", "intermediate")
_SETTINGS_INTS = ("max_context", "max_batch", "staging_slots", "ship_chunk", "prefill_tokens")


def _check_types(plan) -> None:
    for name in _MODEL_INTS:
        if name in plan.model and not (_is_int(plan.model[name]) and plan.model[name] >= 0):
            raise UsageError(f"plan: model.{name} must be a non-negative integer, got {plan.model[name]!r}")
    moe = plan.model.get("moe_layers", [])
    if not (isinstance(moe, list) and all(_is_int(i) for i in moe)):
        raise UsageError(f"plan: model.moe_layers must be a list of layer indices, got {moe!r}")
    for name in _SETTINGS_INTS:
        if name in plan.settings and not (_is_int(plan.settings[name]) and plan.settings[name] >= 1):
            raise UsageError(f"plan: settings.{name} must be a positive integer, got {plan.settings[name]!r}")
    if "cpu_dtype" in plan.settings and plan.settings["cpu_dtype"] not in CPU_DTYPE_NAMES:
        raise UsageError(f"plan: settings.cpu_dtype must be one of {', '.join(CPU_DTYPE_NAMES)}, got "
                         f"{plan.settings['cpu_dtype']!r}")
    if "int4_group" in plan.settings and plan.settings["int4_group"] not in (32, 64, 128):
        raise UsageError(f"plan: settings.int4_group must be 32, 64 or 128, got {plan.settings['int4_group']!r}")
    if "kv_dtype" in plan.settings and plan.settings["kv_dtype"] not in KV_DTYPES:
        raise UsageError(f"plan: settings.kv_dtype must be {' or '.join(KV_DTYPES)}, got {plan.settings['kv_dtype']!r}")
    if "stats" in plan.settings and not isinstance(plan.settings["stats"], dict):
        raise UsageError(f"plan: settings.stats must be an object, got {plan.settings['stats']!r}")
    for lp in plan.layers:
        if not all(_is_int(e) for e in lp.resident_experts):
            raise UsageError(f"plan layer {lp.layer}: resident experts must be integer ids")


@dataclass(frozen=True)
class Plan:
    model: dict
    settings: dict
    gpu_bytes: int
    gpu_budget_bytes: int
    cpu_bytes: int
    cpu_budget_bytes: int
    memory: dict
    layers: tuple[LayerPlan, ...]
    numa: tuple
    predicted_decode_tokens_per_s: float
    predicted_prefill_tokens_per_s: float

    def __post_init__(self):
        _check_types(self)
        E = int(self.model.get("num_experts", 0))
        if E < 1:
            raise UsageError("plan: model.num_experts must be >= 1")
        for lp in self.layers:
            if any(e >= E for e in lp.resident_experts):
                raise UsageError(f"plan layer {lp.layer}: expert id out of range [0, {E})")
        if [lp.layer for lp in self.layers] != list(self.model.get("moe_layers", [])):
            raise UsageError("plan: layers do not match model.moe_layers")
        for name in ("gpu_bytes", "gpu_budget_bytes", "cpu_bytes", "cpu_budget_bytes"):
            if int(getattr(self, name)) < 0:
                raise UsageError(f"plan: {name} must be >= 0")
        if self.gpu_bytes > self.gpu_budget_bytes or self.cpu_bytes > self.cpu_budget_bytes:
            raise UsageError("plan: its memory exceeds its own budgets (edited by hand?)")
        for name in ("predicted_decode_tokens_per_s", "predicted_prefill_tokens_per_s"):
            v = float(getattr(self, name))
            if not (math.isfinite(v) and v > 0):
                raise UsageError(f"plan: {name} must be a positive number")

    def resident_of(self, layer: int) -> tuple[int, ...]:
        for lp in self.layers:
            if lp.layer == layer:
                return lp.resident_experts
        raise UsageError(f"plan has no MoE layer {layer}")

    def check_model(self, cfg, origin: str = "plan") -> None:
        """The plan was made for this model's shape (layers, experts, widths)."""
        moe = list(cfg.moe_layer_indices)
        want = {"num_layers": cfg.num_layers, "num_experts": cfg.num_experts, "topk": cfg.experts_per_token,
                "hidden": cfg.hidden_size, "intermediate": cfg.expert_intermediate_size, "moe_layers": moe}
        diff = [k for k, v in want.items() if self.model.get(k) != v]
        if diff:
            raise UsageError(f"{origin} was made for another model ({', '.join(f'{k} {self.model.get(k)} vs {want[k]}' for k in diff)}); "
                             "run `hybrid plan --model` on this checkpoint")

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "kind": KIND, "model": self.model, "settings": self.settings,
                "gpu_bytes": int(self.gpu_bytes), "gpu_budget_bytes": int(self.gpu_budget_bytes),
                "cpu_bytes": int(self.cpu_bytes), "cpu_budget_bytes": int(self.cpu_budget_bytes),
                "memory": self.memory,
                "layers": [{"layer": lp.layer, "resident_experts": list(lp.resident_experts),
                            "predicted_saving_s": lp.predicted_saving_s} for lp in self.layers],
                "numa": list(self.numa),
                "predicted_decode_tokens_per_s": float(self.predicted_decode_tokens_per_s),
                "predicted_prefill_tokens_per_s": float(self.predicted_prefill_tokens_per_s)}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json(), indent=1)

    @classmethod
    def from_json(cls, data, origin: str = "plan") -> "Plan":
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise UsageError(f"{origin}: not a placement plan (kind must be {KIND!r}; write one with `hybrid plan --out`)")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise UsageError(f"{origin}: schema_version {data.get('schema_version')!r} not supported "
                             f"(this build reads {SCHEMA_VERSION})")
        try:
            for x in data["layers"]:
                if not (isinstance(x.get("resident_experts"), list) and all(_is_int(e) for e in x["resident_experts"])):
                    raise UsageError(f"layer {x.get('layer')!r}: resident_experts must be a list of integer ids")
            layers = tuple(LayerPlan(int(x["layer"]), tuple(x["resident_experts"]), float(x.get("predicted_saving_s", 0)))
                           for x in data["layers"])
            return cls(dict(data["model"]), dict(data["settings"]), int(data["gpu_bytes"]), int(data["gpu_budget_bytes"]),
                       int(data["cpu_bytes"]), int(data["cpu_budget_bytes"]), dict(data["memory"]), layers,
                       tuple(data.get("numa", [])), float(data["predicted_decode_tokens_per_s"]),
                       float(data["predicted_prefill_tokens_per_s"]))
        except UsageError as exc:
            raise UsageError(f"{origin}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UsageError(f"{origin}: malformed ({type(exc).__name__}: {exc})") from None


def load_plan(path: str | os.PathLike) -> Plan:
    return Plan.from_json(read_json(path, "--plan"), origin=f"plan {str(Path(path).expanduser())!r}")
