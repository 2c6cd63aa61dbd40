"""Which MoE layers of a GGUF checkpoint reach the CPU executor as the file's own blocks, not de-quantized.

Fourteen GGUF block types are held exactly by a format of the CPU executor (cpu_kernels/quant.py, module doc): Q4_0
by q4_0 (and by int4 in groups of 32, at 5 bits a weight), Q8_0 by q8_0, Q2_K by q2_k, Q3_K by q3_k, Q4_K by q4_k, Q5_K
by q5_k, Q6_K by q6_k, IQ4_XS by iq4_xs, IQ2_XXS by iq2_xxs, IQ3_XXS by iq3_xxs, IQ3_S by iq3_s, IQ1_S by iq1_s, IQ1_M by iq1_m and MXFP4 by mxfp4. When the executor packs into that format (the load's CPU
format), each of a layer's expert weights (gate, up and down, or the fused gate_up and down) of that type goes to the
experts factory as a weight source over the memory-mapped file (cpu_kernels.moe.gguf_blocks: views, no copy), and the
executor computes with exactly the file's values; a layer's down may keep a format of its own (a Q4_K_M file's Q6_K
downs as q6_k among Q4_K gates and ups kept as q4_k, a Q4_0 down as q4_0); a weight of another block type than the
layer's format, and float weights (F32, F16, BF16) are de-quantized and the executor packs them into the load's
format, which changes a block type's values; iq3_xxs, iq3_s, iq1_s and iq1_m have no quantizer, so a gate or up of another
type in a layer whose format is one of them is refused by the executor, naming --cpu-dtype (a down takes a format of
its own, down_format). A file of mixed layers loaded without --cpu-dtype keeps each layer in the format of its own gate and up
blocks where one holds them (layer_format), so no layer is re-quantized. One log line per load says which layers'
weights went which way and why.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybrid.models.errors import ModelLoadError
from hybrid.models.gguf.checkpoint import GgufCheckpoint
from hybrid.models.gguf.dequant import GGML_QUANT_SIZES, type_name
from hybrid.models.gguf.names import ExpertTensor, expert_tensors

# GGUF type -> the CPU executor's (dtype, group) that holds its blocks exactly at the file's size
LOSSLESS = {"Q4_0": ("q4_0", 32), "Q8_0": ("q8_0", 32), "Q4_K": ("q4_k", 32), "Q5_K": ("q5_k", 32), "Q6_K": ("q6_k", 32),
            "Q2_K": ("q2_k", 32), "Q3_K": ("q3_k", 32), "IQ4_XS": ("iq4_xs", 32), "IQ2_XXS": ("iq2_xxs", 32),
            "IQ3_XXS": ("iq3_xxs", 32), "IQ3_S": ("iq3_s", 32), "IQ1_S": ("iq1_s", 32), "IQ1_M": ("iq1_m", 32),
            "MXFP4": ("mxfp4", 32)}
# GGUF type -> the other formats that hold its blocks exactly too: Q4_0's nibbles and fp16 scales are int4's in groups of
# 32 (at 5 bits a weight, its scales in fp32); the 32-value types llama-quantize falls back to where a row is not whole
# 256-value blocks (a Q4_K_M file's downs of 1408 columns, Qwen1.5-MoE's, DeepSeek-V2-Lite's, GLM-4.5-Air's), Q5_0 and
# IQ4_NL, are q8_0's blocks with the same fp16 d (at 8.5 bits a weight for 5.5 / 4.5: exact, not the file's size)
ALSO_EXACT = {"Q4_0": (("int4", 32),), "Q5_0": (("q8_0", 32),), "IQ4_NL": (("q8_0", 32),)}
_CONVERTED = ("Q5_0", "IQ4_NL")  # types whose blocks are converted into their format's bytes (cpu_kernels.moe.gguf_blocks)
# GGUF type -> the CPU executor's format a file of it defaults to: every block type's exact one (Q8_0's, Q6_K's, Q5_K's,
# Q4_0's, Q4_K's, IQ4_XS's, Q3_K's, IQ3_S's, IQ3_XXS's, Q2_K's, IQ2_XXS's, IQ1_M's and IQ1_S's are the file's 8.5, 6.56,
# 5.5, 4.5, 4.5, 4.25, 3.44, 3.44, 3.06, 2.63, 2.06, 1.75 and 1.56 bits), so
# the experts' DRAM stays the file's size; a block type no format holds is de-quantized and re-quantized into the
# smallest format of at least its bits that has a quantizer from floats (IQ2_XS's 2.31 and IQ2_S's 2.56 bits into
# q2_k's 2.63, TQ2_0's 2.06 and TQ1_0's 1.69 into iq2_xxs's 2.06); float experts
# default to bf16.
NEAREST = {**LOSSLESS,
           "IQ2_XS": ("q2_k", 32), "IQ2_S": ("q2_k", 32),
           "TQ2_0": ("iq2_xxs", 32), "TQ1_0": ("iq2_xxs", 32),
           "BF16": ("bf16", 0), "F16": ("bf16", 0), "F32": ("bf16", 0)}
WEIGHTS = ("w_gate", "w_up", "w_down", "gate_up")  # ExpertTensor.which of expert weights (not biases)


def cpu_format(dtype: str, group: int) -> tuple[str, int]:
    """The CPU executor's format as LOSSLESS names them: (dtype, int4 group; mxfp4 always 32, others 0)."""
    exact = {d for d, _ in LOSSLESS.values()}
    return dtype, group if dtype == "int4" else 32 if dtype in exact else 0


def format_name(fmt: tuple[str, int]) -> str:
    return f"int4 group {fmt[1]}" if fmt[0] == "int4" else fmt[0]


def exact_formats(kind: str) -> tuple[tuple[str, int], ...]:
    """Every CPU format that holds a GGUF type's blocks exactly, its default (LOSSLESS) first."""
    return ((LOSSLESS[kind],) if kind in LOSSLESS else ()) + ALSO_EXACT.get(kind, ())


def weight_types(ckpt: GgufCheckpoint, tensors: list[ExpertTensor]) -> dict[str, str]:
    """A layer's expert weight tensors: which -> GGUF type name."""
    return {e.which: type_name(ckpt.tensors[e.name].ggml_type) for e in tensors if e.which in WEIGHTS}


class LayerChoice(NamedTuple):
    """How a layer's expert weights reach the CPU executor: `kept` (ExpertTensor.which) as the file's blocks, the
    others (`redone`, which -> GGUF type) de-quantized and re-quantized, `why` (None when none is); `down`: the
    down's own format (dtype, group) where it is not the layer's (down_format), else None; `fmt`: the layer's own
    format where it is not the load's (layer_format: a file of mixed types loaded in its own formats), else None."""

    kept: tuple[str, ...]
    redone: dict[str, str]
    why: str | None
    down: tuple[str, int] | None = None
    fmt: tuple[str, int] | None = None
    converted: str | None = None  # the down's GGUF type where its blocks are converted to its format's (ALSO_EXACT)


def why_not(kind: str) -> str:
    """Why a GGUF type's blocks are not held by the load's format (a short clause)."""
    if exact_formats(kind):
        return f"{kind} blocks are held exactly by --cpu-dtype {' or '.join(map(format_name, exact_formats(kind)))} only"
    return f"no CPU format holds {kind} as stored"


def down_format(kind: str, fmt: tuple[str, int]) -> tuple[str, int]:
    """The format a layer's down of GGUF type `kind` is packed in beside the layer's format `fmt` (a down may have
    a dtype of its own, cpu_kernels.dtypes.DOWN_DTYPES, beside any quantized one): the exact one of its type where
    there is one (a Q4_K_M file's Q6_K down in q6_k beside its q4_k gate and up), else the layer's (also where the
    layer's holds it exactly: a Q4_0 down in int4 group 32 beside int4 gates and ups). A down no format holds beside a
    layer's format without a quantizer (FILE_ONLY_DTYPES: an IQ2_S down among IQ3_XXS gates and ups) is re-quantized
    into its type's NEAREST format where that may be a down (q2_k), else q8_0 (a float down), not refused."""
    from cpu_kernels.dtypes import DOWN_DTYPES, FILE_ONLY_DTYPES

    if fmt[0] == "bf16" or fmt in exact_formats(kind):
        return fmt
    exact = next(iter(exact_formats(kind)), None)
    if exact is not None and exact[0] in DOWN_DTYPES:
        return exact
    if fmt[0] in FILE_ONLY_DTYPES:
        near = NEAREST.get(kind)
        return near if near is not None and near[0] in DOWN_DTYPES else cpu_format("q8_0", 32)
    return fmt


def layer_format(types: dict[str, str], fmt: tuple[str, int], own: bool) -> tuple[str, int]:
    """The format a layer's gate and up are packed in: with `own` (a file loaded in the formats of its own blocks,
    no --cpu-dtype given) the exact one of their type where they share one that has it (a UD file's layers of Q4_K
    gates among IQ1_S ones keep q4_k), else the load's."""
    kinds = {t for w, t in types.items() if w != "w_down"}
    if own and len(kinds) == 1 and (kind := kinds.pop()) in LOSSLESS:
        return cpu_format(*LOSSLESS[kind])
    return fmt


def choose_layer(types: dict[str, str], fmt: tuple[str, int], own: bool = False) -> LayerChoice:
    """A layer's expert weights (which -> GGUF type) under the load's format (or, `own`, the layer's: layer_format):
    the down in down_format's, each weight kept where its format holds its type exactly."""
    lf = layer_format(types, fmt, own)
    down = down_format(types["w_down"], lf) if "w_down" in types else lf
    held = {w: (down if w == "w_down" else lf) for w in types}
    kept = tuple(w for w, t in types.items() if held[w] in exact_formats(t))
    redone = {w: t for w, t in types.items() if w not in kept}
    why = "; ".join(why_not(t) for t in sorted(set(redone.values()))) or None
    kind = types.get("w_down")
    converted = kind if "w_down" in kept and kind in _CONVERTED else None
    return LayerChoice(kept, redone, why, down if down != lf else None, lf if lf != fmt else None, converted)


def choose(ckpt: GgufCheckpoint, experts: dict[int, list[ExpertTensor]], fmt: tuple[str, int],
           own: bool = False) -> dict[int, LayerChoice]:
    """MoE layer -> which of its expert weights are repacked as they are, which are de-quantized and why (`own`:
    each layer in the format of its own gate and up blocks where one holds them, layer_format)."""
    return {i: choose_layer(weight_types(ckpt, tensors), fmt, own) for i, tensors in sorted(experts.items())}


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, start = [], None
    for j, i in enumerate(layers):
        if start is None:
            start = i
        if j + 1 == len(layers) or layers[j + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out)


def describe(choice: dict[int, LayerChoice], fmt: tuple[str, int]) -> str:
    """The load's one line: which layers were repacked losslessly, which de-quantized and re-quantized and why, and
    in which only some weights were kept (named, with the types of the others)."""
    groups: dict[tuple, list[int]] = {}
    for i, c in choice.items():
        own = ("" if c.fmt is None else f"; in {format_name(c.fmt)}") + \
            ("" if c.down is None else f"; w_down in {format_name(c.down)}") + \
            ("" if c.converted is None else f"{', its' if c.down else '; w_down'} {c.converted} values as "
             f"{format_name(ALSO_EXACT[c.converted][0])} blocks")
        key = ("all", own) if c.why is None else ("none", c.why, own) if not c.kept else (
            "some", c.kept, tuple(f"{w} {t}" for w, t in c.redone.items()), c.why, own)
        groups.setdefault(key, []).append(i)
    parts = []
    for key, layers in groups.items():
        if key[0] == "all":
            parts.append(f"layers {_ranges(layers)} repacked losslessly (the file's blocks as they are{key[1]})")
        elif key[0] == "none":
            parts.append(f"layers {_ranges(layers)} de-quantized and re-quantized ({key[1]}{key[2]})")
        else:
            parts.append(f"layers {_ranges(layers)}: {', '.join(key[1])} repacked losslessly, {', '.join(key[2])} "
                         f"de-quantized and re-quantized ({key[3]}{key[4]})")
    return f"GGUF experts for the CPU executor ({format_name(fmt)}): " + "; ".join(parts)


# where a kept block type's fp16 scales sit in its block: d, and dmin beside it for the K-quants with minimums (IQ1_M has
# no d field: _block_scales rebuilds it from its scales words)
_SCALE_BYTES = {"Q4_0": slice(0, 2), "Q8_0": slice(0, 2), "Q4_K": slice(0, 4), "Q5_K": slice(0, 4),
                "Q6_K": slice(208, 210), "Q2_K": slice(80, 84), "Q3_K": slice(108, 110), "IQ4_XS": slice(0, 2),
                "IQ2_XXS": slice(0, 2), "IQ3_XXS": slice(0, 2), "IQ3_S": slice(0, 2), "IQ1_S": slice(0, 2), "Q5_0": slice(0, 2), "IQ4_NL": slice(0, 2)}


def _block_scales(kind: str, raw: torch.Tensor) -> torch.Tensor:
    """Blocks raw uint8 [..., bytes] of a kept type -> their fp16 scales [..., 1 or 2] (IQ1_M: d from the top nibbles
    of its scales words, cpu_kernels.quant.iq1_m_d)."""
    if kind == "IQ1_M":
        from cpu_kernels import quant

        return quant.iq1_m_d(raw[..., quant.IQ1_M_VALUE_BYTES:])
    return raw[..., _SCALE_BYTES[kind]].contiguous().view(torch.float16)


def _checked(ckpt: GgufCheckpoint, e: ExpertTensor, kind: str, raw: torch.Tensor) -> None:
    """The de-quantizing load's NaN/Inf refusal, on the blocks: a value is finite where its block's fp16 scales are
    (Q4_0, Q8_0, Q6_K, Q3_K, IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: d; Q4_K, Q5_K, Q2_K: d and dmin); an MXFP4 exponent of 255
    is e8m0's NaN."""
    if kind == "MXFP4":
        bad = int((raw[..., 0] == 255).sum())
    else:
        bad = int((~torch.isfinite(_block_scales(kind, raw))).any(-1).sum())
    if bad:
        raise ModelLoadError(f"tensor {e.name!r} in {ckpt.tensors[e.name].file.name}: {bad} block(s) with a NaN/Inf "
                             "scale; the checkpoint is corrupt")


def sources(ckpt: GgufCheckpoint, tensors: list[ExpertTensor], F: int) -> dict:
    """{"w_gate", "w_up", "w_down"} -> a weight source over the blocks in the file (views, no copy) of each expert
    weight among `tensors`, for an experts factory that hands them to cpu_kernels.CpuMoE; a fused gate_up [E, 2F, D]
    is split into its two row halves."""
    from cpu_kernels.moe import gguf_blocks

    out = {}
    for e in tensors:
        if e.which not in WEIGHTS:
            continue
        t = ckpt.tensors[e.name]
        kind = type_name(t.ggml_type)
        E, R, K = e.shape
        raw = t.raw().view(E, R, K // GGML_QUANT_SIZES[t.ggml_type][0], -1)
        _checked(ckpt, e, kind, raw)
        if e.which == "gate_up":
            out["w_gate"], out["w_up"] = (gguf_blocks(e.name, raw[:, :F], kind), gguf_blocks(e.name, raw[:, F:], kind))
        else:
            out[e.which] = gguf_blocks(e.name, raw, kind)
    return out


def file_types(ckpt: GgufCheckpoint) -> set[str]:
    """The GGUF types of every MoE layer's expert weights in the file (tensors it lacks are left out: the load
    refuses those, by name)."""
    return set(expert_bytes_by_type(ckpt))


def expert_bytes_by_type(ckpt: GgufCheckpoint) -> dict[str, int]:
    """The file's MoE expert weight bytes per GGUF type (unsloth's mixed files use several)."""
    from hybrid.models.gguf.dequant import nbytes

    cfg, have = ckpt.config, ckpt.tensors.__contains__
    out: dict[str, int] = {}
    for i in cfg.moe_layer_indices:
        for e in expert_tensors(cfg, i, have):
            if e.which in WEIGHTS and have(e.name):
                t = ckpt.tensors[e.name]
                out[type_name(t.ggml_type)] = out.get(type_name(t.ggml_type), 0) + nbytes(t.ggml_type, t.shape)
    return out


def choose_file(ckpt: GgufCheckpoint, fmt: tuple[str, int], own: bool = False) -> dict[int, LayerChoice]:
    """choose over every MoE layer of the file (the expert tensors it has)."""
    cfg, have = ckpt.config, ckpt.tensors.__contains__
    return choose(ckpt, {i: expert_tensors(cfg, i, have) for i in cfg.moe_layer_indices}, fmt, own)


def own_dtypes(ckpt: GgufCheckpoint, fmt: tuple[str, int], own: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(downs, gates and ups): the CPU dtype of each MoE layer's down that is not in the load's format (its own,
    down_format, or its layer's, layer_format), and of each layer's gate and up that is not (layer_format), one entry
    per such layer: what `hybrid plan` and the DRAM check price beside the load's format."""
    choice = choose_file(ckpt, fmt, own).values()
    downs = tuple(d for d in ((c.down or c.fmt or fmt)[0] for c in choice) if d != fmt[0])
    return downs, tuple(c.fmt[0] for c in choice if c.fmt is not None)


class DefaultFormat(NamedTuple):
    """What a GGUF file's CPU experts default to when the user names no --cpu-dtype: `dtype` and `group` (int4's)
    from NEAREST for `follows`, the type holding most of the expert bytes; `only`: every expert block is of that
    type; `exact`: and it is a lossless one, so the executor holds the file's values."""

    dtype: str
    group: int
    follows: str
    only: bool
    exact: bool


def default_format(ckpt: GgufCheckpoint) -> DefaultFormat | None:
    """The CPU format this file's experts default to (DefaultFormat), or None: float experts (bf16, as any
    checkpoint's), no expert, or a type NEAREST lacks (the load then names it)."""
    sizes = expert_bytes_by_type(ckpt)
    if not sizes:
        return None
    follows = max(sizes, key=sizes.get)
    if follows not in NEAREST:
        return None
    dtype, group = NEAREST[follows]
    if dtype == "bf16":
        return None
    only = len(sizes) == 1
    return DefaultFormat(dtype, group, follows, only, only and follows in LOSSLESS)
