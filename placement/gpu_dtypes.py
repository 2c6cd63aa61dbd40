"""The GPU dtype of each non-expert part (placement.memory.GPU_PARTS), from `--gpu-dtype` and the budget.

    --gpu-dtype bf16|int8|int4|fp8   every part in that dtype, and the resident experts too (fp8: int8 residents,
                                     the same bytes with a scale per 128 inputs instead of per 128 x 128)
    --gpu-dtype auto                 the most precise dtypes that leave room for resident experts; residents bf16

Resident experts (the "experts" entry, placement.memory.RESIDENT_PART) are held as int8 or int4 only when asked
for: quantized, more of them fit (a 4-bit one takes 27% of a bf16 one's bytes), but each adds its own rounding, so
auto keeps them in bf16, the most precise, and lets the budget decide how many.

auto starts every part at the top of its ladder and steps down, one part one step at a time, taking each time the
step that frees the most bytes, until the fixed part of VRAM (placement.memory.breakdown: weights, KV cache at
the requested context, staging, graph buffers, reserve) fits within (1 - RESIDENT_SHARE) of the budget; if even
the bottom of every ladder does not leave that room, it takes the first point at which the fixed part fits the
budget at all. The largest part is stepped down first because the error of a weight-only quantization is per
weight: the bytes freed per unit of precision given up is the same for every part, so taking the biggest step
first stops soonest, with the most parts left precise.

Ladders. A bf16 checkpoint: bf16 -> int8 -> int4 (group-wise, round to nearest: int8 loses almost nothing,
int4 is the byte budget's last resort). A block-FP8 checkpoint (DeepSeek-V3, Kimi-K2 as published): bf16 (its
values de-quantized, as without --gpu-dtype) -> fp8 (its bytes and block scales kept as they are: the same
values in half the bytes) -> int4; int8 would be larger than fp8 without being more precise than the FP8 values
it came from. Without a budget auto keeps bf16: the fastest prefill (no de-quantization) and nothing to fit.
RESIDENT_SHARE: a quarter of the card is kept for resident experts, which are what makes decode fast once the
weights fit (DESIGN.md, Placement); it is a rule of thumb, not a measured optimum.
"""

from __future__ import annotations

from dataclasses import replace

from placement.errors import UsageError
from placement.memory import GPU_KINDS, GPU_PARTS, RESIDENT_PART, MemorySettings, breakdown, gib

CHOICES = ("auto",) + GPU_KINDS
RESIDENT_SHARE = 0.25
LADDERS = {"bf16": ("bf16", "int8", "int4"), "fp8": ("bf16", "fp8", "int4")}


def checkpoint_kind(raw: dict) -> str:
    """'fp8' for a block-FP8 checkpoint's config.json (quantization_config quant_method fp8), else 'bf16'."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    return "fp8" if q.get("quant_method") == "fp8" else "bf16"


RESIDENT_OF = {"bf16": "bf16", "int8": "int8", "int4": "int4", "fp8": "int8"}  # --gpu-dtype -> residents' dtype


def uniform(kind: str) -> dict[str, str]:
    if kind not in GPU_KINDS:
        raise UsageError(f"--gpu-dtype must be one of {', '.join(CHOICES)}, got {kind!r}")
    return {**{p: kind for p in GPU_PARTS}, RESIDENT_PART: RESIDENT_OF[kind]}


def choose(cfg, settings: MemorySettings, gpu_budget: int | None, request: str, ckpt_kind: str = "bf16") -> dict[str, str]:
    """part -> GPU dtype for `request` (CHOICES). auto needs a budget (without one it keeps the top of the
    ladder: nothing asks for fewer bytes)."""
    if request != "auto":
        return uniform(request)
    ladder = LADDERS[ckpt_kind]
    level = {p: 0 for p in GPU_PARTS}
    if gpu_budget is None:
        return {p: ladder[0] for p in GPU_PARTS}

    def fixed(lv):
        return breakdown(cfg, replace(settings, gpu_dtypes={p: ladder[i] for p, i in lv.items()})).gpu_fixed

    room = (1 - RESIDENT_SHARE) * gpu_budget
    steps = [dict(level)]
    while fixed(level) > room:
        now = fixed(level)
        best, best_saved = None, 0
        for p in GPU_PARTS:
            if level[p] + 1 < len(ladder):
                saved = now - fixed({**level, p: level[p] + 1})
                if saved > best_saved:
                    best, best_saved = p, saved
        if best is None:
            break
        level[best] += 1
        steps.append(dict(level))
    if fixed(level) > room:  # no room for residents anywhere on the ladders: the most precise that fits at all
        level = next((lv for lv in steps if fixed(lv) <= gpu_budget), level)
    return {p: ladder[i] for p, i in level.items()}


def describe(dtypes: dict[str, str], parts_bytes: dict[str, int]) -> str:
    """'attention int4 7.21 GiB, shared int8 ...' for the parts that hold any bytes."""
    return ", ".join(f"{p} {dtypes.get(p, 'bf16')} {gib(parts_bytes[p])}" for p in GPU_PARTS if parts_bytes.get(p))


def resident_kind(dtypes: dict | None) -> str:
    """The resident experts' dtype in a gpu_dtypes dict (none given: bf16)."""
    return (dtypes or {}).get(RESIDENT_PART, "bf16")
