"""Which of a model's GPU-side matrices a GPU dtype quantizes, by part, and the step that swaps them for QWeights.

Parts (ModelConfig.gpu_matrices counts the same matrices from the config alone, for the planner):
    attention  q/k/v/o projections, MLA's q_a/q_b/kv_a/kv_b/o
    shared     the shared experts' gate/up/down (MoE layers)
    dense      the dense layers' MLP gate/up/down
    embed      the token embedding (also the head when the two are tied)
    head       the output head
A part's dtype is "bf16" (kept in the model's compute dtype) or a hybrid.models.qweight kind (int8, int4, fp8).
Biases, norms, routers and gates are never quantized: they are small and the router's choice is sensitive.
"""

from __future__ import annotations

from torch import nn

from hybrid.models.qweight import KINDS, QWeight, quantize_module_weight_

PARTS = ("attention", "shared", "dense", "embed", "head")
RESIDENTS = "experts"  # the dtypes' entry for resident routed experts: hybrid.offload.resident's, not a part here
KEEP = "bf16"  # the part stays in the compute dtype
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def check_dtypes(dtypes: dict[str, str]) -> dict[str, str]:
    for part, kind in dtypes.items():
        if part == RESIDENTS:
            continue
        if part not in PARTS:
            raise ValueError(f"unknown GPU weight part {part!r} (parts: {', '.join(PARTS)})")
        if kind != KEEP and kind not in KINDS:
            raise ValueError(f"GPU dtype of {part} must be {KEEP} or one of {', '.join(KINDS)}, got {kind!r}")
    return dtypes


def matrices(model: nn.Module) -> list[tuple[nn.Module, str, str, str]]:
    """(owning module, attribute, full name, part) of every quantizable matrix, in model order."""
    out = [(model, "embed", "embed", "embed")]
    for i, layer in enumerate(model.layers):
        for name in ATTENTION:
            lin = getattr(layer.attn, name, None)
            if lin is not None:
                out.append((lin, "weight", f"layers.{i}.attn.{name}.weight", "attention"))
        if layer.moe is not None and layer.moe.shared is not None:
            out += [(layer.moe.shared, n, f"layers.{i}.moe.shared.{n}", "shared") for n in MLP]
        if layer.mlp is not None:
            out += [(layer.mlp, n, f"layers.{i}.mlp.{n}", "dense") for n in MLP]
    if getattr(model, "lm_head", None) is not None:
        out.append((model, "lm_head", "lm_head", "head"))
    return out


def quantize_skeleton_(model: nn.Module, dtypes: dict[str, str], device) -> dict[str, QWeight]:
    """Replaces the (meta or empty) parameters of every part not kept in bf16 by empty QWeights on `device`,
    before anything is allocated for them; returns full name -> QWeight for the loader to fill."""
    check_dtypes(dtypes)
    out = {}
    for module, attr, name, part in matrices(model):
        kind = dtypes.get(part, KEEP)
        if kind != KEEP:
            out[name] = quantize_module_weight_(module, attr, kind, device)
    return out


def quantized(model: nn.Module) -> dict[str, QWeight]:
    """Full name -> QWeight of a model's quantized matrices."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QWeight)}


def dtypes_of(model: nn.Module) -> dict[str, str]:
    """part -> the dtype its matrices hold ("bf16" = the compute dtype; "mixed" if they differ)."""
    seen: dict[str, set] = {}
    for module, attr, _, part in matrices(model):
        w = getattr(module, attr)
        seen.setdefault(part, set()).add(w.kind if isinstance(w, QWeight) else KEEP)
    return {p: (k.pop() if len(k) == 1 else "mixed") for p, k in seen.items()}
