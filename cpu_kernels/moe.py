"""CpuMoE: the CPU expert executor of one MoE layer (the cold experts), over the compiled kernels.

Shapes: T tokens, E experts held here, K experts per token, D hidden, F expert intermediate.
Weights are packed once per NUMA node: each node holds a slice of F (gate/up rows, down columns) in
its own memory (first touch by its pinned threads), runs it with its own pool, and the partial outputs
are summed; no weight is stored twice. Packed layout: row-major [E, rows_p, ldk], zero padded, so
the first rows x k of each expert are the plain weight matrix the GPU lane can ship as a strided view.
On each node an expert's gate, up and down bytes lie back to back in one block (expert-major): the
ship lane moves an expert in one copy instead of three (a host->device copy of a few MiB runs well
below the link rate of large ones).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import threading
from collections.abc import Mapping

import torch

from . import _native, knee, quant
from .dtypes import CPU_DTYPES, DOWN_DTYPES, FILE_ONLY_DTYPES
from .memory import weight_buffer
from .reference import ACTIVATIONS, moe_forward
from .topology import Topology

DTYPES = {name: d.code for name, d in CPU_DTYPES.items()}  # cpu_kernels.dtypes: the one table
# the block formats: one scale (or exponent, or head) per block, activation block sums per 32 values
_BLOCK_DTYPES = ("mxfp4", "q8_0", "q4_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "iq2_xxs", "iq3_xxs",
                 "iq3_s", "iq1_s", "iq1_m")
# the super-block formats' head bytes per 256 values
_HEAD_BYTES = {"q2_k": quant.Q2_K_HEAD_BYTES, "q3_k": quant.Q3_K_HEAD_BYTES, "q4_k": quant.Q4_K_HEAD_BYTES,
               "q5_k": quant.Q5_K_HEAD_BYTES, "q6_k": quant.Q6_K_HEAD_BYTES, "iq4_xs": quant.IQ4_XS_HEAD_BYTES,
               "iq2_xxs": quant.IQ2_XXS_HEAD_BYTES, "iq3_xxs": quant.IQ3_XXS_HEAD_BYTES,
               "iq3_s": quant.IQ3_S_HEAD_BYTES, "iq1_s": quant.IQ1_S_HEAD_BYTES,
               "iq1_m": quant.IQ1_M_HEAD_BYTES}
log = logging.getLogger("cpu_kernels")
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ROW_ALIGN = 32
# Tokens per expert from which AMX beats the AVX-512 vector path: only the fallback when nothing was
# measured (the knee moves between machines and runs, BENCHMARKS.md): `hybrid calibrate` measures it into
# the profile (machine["amx_knee"]) and the hybrid runtime applies it with cpu_kernels.knee.set_default_knee.
# int4's AMX path (groups of 64 or 128, kern_amx.h) was no faster than the vector path up to 64 tokens per
# expert on the GPU box's host (BENCHMARKS.md, CPU kernels alone), so without a measured knee int4 stays on the
# vector path (AMX_NEVER); `hybrid calibrate` measures its knee like the others' and so turns it on where the
# tiles win, and amx_min_tokens= asks for it. mxfp4, q8_0, q4_0, the K-quants and int4 in groups of
# 32 always run on the vector path (no AMX kernel: with an AMX ISA they say so once, _say_vector_only).
AMX_NEVER = 1 << 30
AMX_KNEE = {"bf16": 16, "int8": 32, "int4": AMX_NEVER}
_SAID_VECTOR_ONLY: set = set()
# The packed layout's version: bump it whenever packing changes the bytes it writes, so that bytes packed
# before (a packed cache) are refused by from_packed instead of being run as something else.
PACK_FORMAT = 1


def _say_vector_only(dtype: str, isa: str) -> None:
    """The AMX build declines mxfp4, q8_0, q4_0, the K-quants and int4 in groups of 32 (half a 64-value K tile): every call runs its
    AVX-512 (amx_emu: AVX2) vector kernels, so prefill-sized batches run well below AMX speed. Said once per
    (dtype, ISA) and process."""
    if (dtype, isa) in _SAID_VECTOR_ONLY:
        return
    _SAID_VECTOR_ONLY.add((dtype, isa))
    log.warning("cpu_kernels: %s has no AMX kernel; ISA %s runs it on the vector (VNNI) path at every batch "
                "size, so large prefills run below AMX speed (bf16, int8 and int4 in groups of 64 or 128 use "
                "the AMX tiles)", dtype, isa)


def _ranges(key, shape, what: str) -> list[tuple[int, int]]:
    """A key slicing a source that stands for [E, rows, k] (ranges only; missing ones whole) -> (start, stop) of
    each of the three dims."""
    key = key if isinstance(key, tuple) else (key,)
    key = key + (slice(None),) * (3 - len(key))
    if len(key) != 3 or not all(isinstance(k, slice) and k.step in (None, 1) for k in key):
        raise TypeError(f"{what} slice by ranges only")
    return [k.indices(n)[:2] for k, n in zip(key, shape)]


def _block_range(key, shape, what: str, block: int = quant.MXFP4_BLOCK):
    """A block source's key (ranges over [E, R, K]) -> (experts, rows, blocks) slices; K on `block`-value blocks."""
    (e0, e1), (r0, r1), (k0, k1) = _ranges(key, shape, f"{what} weights")
    if k0 % block or (k1 % block and k1 != shape[2]):
        raise ValueError(f"{what} weights slice K on {block}-value blocks, got {k0}:{k1}")
    return slice(e0, e1), slice(r0, r1), slice(k0 // block, -(-k1 // block))


class _Mx4:
    """Published mxfp4 weights of E experts, blocks uint8 [E, R, K/32, 16] and scales [E, R, K/32], sliced
    like the float matrices [E, R, K] they stand for (K slices on 32-value block boundaries), without a copy.
    Strided views (a loader's row de-interleave) are taken as they are: packing copies a chunk at a time.
    order "gguf": the blocks pair the nibbles as a GGUF file's MXFP4 does (values j and j + 16 in byte j;
    quant.mxfp4_pairs_from_gguf), re-paired a chunk at a time as they are packed."""

    def __init__(self, name, blocks, scales, order: str = "ocp"):
        for what, t, nd in ((f"{name} blocks", blocks, 4), (f"{name} scales", scales, 3)):
            _check_tensor(what, t, nd, (torch.uint8,), contiguous=False)
        if blocks.shape[-1] != quant.MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
            raise ValueError(f"{name}: mxfp4 blocks {tuple(blocks.shape)} must be [E, R, K/32, 16] with scales "
                             f"[E, R, K/32], got scales {tuple(scales.shape)}")
        if order not in ("ocp", "gguf"):
            raise ValueError(f"{name}: mxfp4 nibble order must be 'ocp' or 'gguf', got {order!r}")
        self.blocks, self.scales, self.order = blocks, scales, order
        E, R, G = scales.shape
        self.shape = torch.Size((E, R, G * quant.MXFP4_BLOCK))

    def __getitem__(self, key):
        se, sr, g = _block_range(key, self.shape, "mxfp4")
        out = _Mx4.__new__(_Mx4)
        out.blocks, out.scales, out.order = self.blocks[se, sr, g], self.scales[se, sr, g], self.order
        out.shape = torch.Size((*out.scales.shape[:2], out.scales.shape[2] * quant.MXFP4_BLOCK))
        return out

    def published(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, scales) in the published (OCP) nibble order: the views themselves, or a re-paired copy."""
        if self.order == "ocp":
            return self.blocks, self.scales
        return quant.mxfp4_pairs_from_gguf(self.blocks), self.scales

    def dequantized(self) -> torch.Tensor:
        return quant.dequantize_mxfp4(*self.published())


class _GgufBlocks:
    """A GGUF tensor's expert blocks of one type, raw uint8 [E, R, K / VALUES, BYTES] (any strides: views of the
    file), sliced like the float matrices [E, R, K] they stand for (K slices on block boundaries), without a copy.
    The subclasses' types are a CPU format exactly (cpu_kernels.quant, module doc): packing takes their bytes as they
    are, a chunk of experts at a time (SRC: the compiled packer's source code, csrc/pack.h HY_SRC_*)."""

    TYPE, VALUES, BYTES = "", 32, 0

    def __init__(self, name, raw):
        _check_tensor(f"{name} {self.TYPE} blocks", raw, 4, (torch.uint8,), contiguous=False)
        if raw.shape[-1] != self.BYTES:
            raise ValueError(f"{name}: {self.TYPE} blocks must be [E, R, K/{self.VALUES}, {self.BYTES}], got "
                             f"{tuple(raw.shape)}")
        self.raw = raw
        E, R, G, _ = raw.shape
        self.shape = torch.Size((E, R, G * self.VALUES))

    def __getitem__(self, key):
        se, sr, g = _block_range(key, self.shape, self.TYPE, self.VALUES)
        return type(self)("", self.raw[se, sr, g])


class _Q40(_GgufBlocks):
    """Q4_0: fp16 d + 16 bytes of nibbles per 32 values; q4_0 exactly, and int4 in groups of 32 exactly."""

    TYPE, BYTES, SRC = "Q4_0", quant.Q4_0_BLOCK_BYTES, _native.PACK_SRC_Q4_0

    def dequantized(self) -> torch.Tensor:
        return quant.dequantize_q4_0(self.raw)


class _Q80(_GgufBlocks):
    """Q8_0: fp16 d + 32 int8 values per 32 values; q8_0 exactly."""

    TYPE, BYTES, SRC = "Q8_0", quant.Q8_0_BLOCK_BYTES, _native.PACK_SRC_Q8_0

    def dequantized(self) -> torch.Tensor:
        return quant.dequantize_q8_0(*quant.q8_0_parts(self.raw))


class _SuperBlocks(_GgufBlocks):
    """The 256-value super-block types (the K-quants, IQ4_XS), each a CPU dtype exactly: DTYPE; PARTS: the raw blocks
    -> that dtype's (values, heads) (cpu_kernels.quant); D_AT: where the fp16 d (and dmin) sit in a head, refused
    when not finite as the compiled packer refuses them (head_d)."""

    VALUES, DTYPE, D_AT = quant.QK_K, "", slice(0, 4)

    @classmethod
    def head_d(cls, heads: torch.Tensor) -> torch.Tensor:
        """Heads uint8 [..., G, head bytes] -> their fp16 d (and dmin) as fp32 [..., G, 1 or 2]."""
        return heads[..., cls.D_AT].contiguous().view(torch.float16).float()

    def dequantized(self) -> torch.Tensor:
        return quant.packed_dequantizers()[self.DTYPE](*type(self).PARTS(self.raw))


class _Q2K(_SuperBlocks):
    """Q2_K: 16 scale bytes, 64 bytes of 2-bit values, fp16 d and dmin per 256 values."""

    TYPE, BYTES, DTYPE, PARTS, D_AT = "Q2_K", quant.Q2_K_BLOCK_BYTES, "q2_k", quant.q2_k_parts, slice(16, 20)
    SRC = _native.PACK_SRC_Q2_K


class _Q3K(_SuperBlocks):
    """Q3_K: 32 bytes of high bits, 64 bytes of low bit pairs, 12 bytes of 6-bit scales, fp16 d per 256 values."""

    TYPE, BYTES, DTYPE, PARTS, D_AT = "Q3_K", quant.Q3_K_BLOCK_BYTES, "q3_k", quant.q3_k_parts, slice(12, 14)
    SRC = _native.PACK_SRC_Q3_K


class _Q4K(_SuperBlocks):
    """Q4_K: a 16-byte head + 128 bytes of nibbles per 256 values."""

    TYPE, BYTES, DTYPE, PARTS, SRC = "Q4_K", quant.Q4_K_BLOCK_BYTES, "q4_k", quant.q4_k_parts, _native.PACK_SRC_Q4_K


class _Q5K(_SuperBlocks):
    """Q5_K: a 48-byte head (q4_k's, then the fifth bits) + 128 bytes of nibbles per 256 values."""

    TYPE, BYTES, DTYPE, PARTS, SRC = "Q5_K", quant.Q5_K_BLOCK_BYTES, "q5_k", quant.q5_k_parts, _native.PACK_SRC_Q5_K


class _Q6K(_SuperBlocks):
    """Q6_K: 192 bytes of 6-bit values + an 18-byte head per 256 values."""

    TYPE, BYTES, DTYPE, PARTS, D_AT = "Q6_K", quant.Q6_K_BLOCK_BYTES, "q6_k", quant.q6_k_parts, slice(16, 18)
    SRC = _native.PACK_SRC_Q6_K


class _IQ4(_SuperBlocks):
    """IQ4_XS: an 8-byte head + 128 bytes of codebook indices per 256 values (the nibbles re-paired when packed)."""

    TYPE, BYTES, DTYPE, PARTS, D_AT = "IQ4_XS", quant.IQ4_XS_BLOCK_BYTES, "iq4_xs", quant.iq4_xs_parts, slice(0, 2)
    SRC = _native.PACK_SRC_IQ4_XS


class _IQ2X(_SuperBlocks):
    """IQ2_XXS: fp16 d + 64 bytes of codebook indices, sign indices and scales per 256 values."""

    TYPE, BYTES, DTYPE, PARTS, D_AT = "IQ2_XXS", quant.IQ2_XXS_BLOCK_BYTES, "iq2_xxs", quant.iq2_xxs_parts, slice(0, 2)
    SRC = _native.PACK_SRC_IQ2_XXS


class _IQ3X(_SuperBlocks):
    """IQ3_XXS: fp16 d + 64 bytes of codebook indices + 32 of sign indices and scales per 256 values."""

    TYPE, BYTES, DTYPE, PARTS, D_AT = "IQ3_XXS", quant.IQ3_XXS_BLOCK_BYTES, "iq3_xxs", quant.iq3_xxs_parts, slice(0, 2)
    SRC = _native.PACK_SRC_IQ3_XXS


class _IQ3S(_SuperBlocks):
    """IQ3_S: fp16 d + 64 bytes of codebook index low bits, 8 of their 9th bits, 32 of sign bits, 4 of scales per 256
    values."""

    TYPE, BYTES, DTYPE, PARTS, D_AT = "IQ3_S", quant.IQ3_S_BLOCK_BYTES, "iq3_s", quant.iq3_s_parts, slice(0, 2)
    SRC = _native.PACK_SRC_IQ3_S


class _IQ1S(_SuperBlocks):
    """IQ1_S: fp16 d + 32 bytes of codebook index low bits + 8 uint16 of their high bits, scales and delta signs per
    256 values."""

    TYPE, BYTES, DTYPE, PARTS, D_AT = "IQ1_S", quant.IQ1_S_BLOCK_BYTES, "iq1_s", quant.iq1_s_parts, slice(0, 2)
    SRC = _native.PACK_SRC_IQ1_S


class _IQ1M(_SuperBlocks):
    """IQ1_M: 32 bytes of codebook index low bits + 16 of their high bits and delta signs + 4 uint16 scales words
    holding the fp16 d's nibbles per 256 values."""

    TYPE, BYTES, DTYPE, PARTS, SRC = "IQ1_M", quant.IQ1_M_BLOCK_BYTES, "iq1_m", quant.iq1_m_parts, _native.PACK_SRC_IQ1_M

    @classmethod
    def head_d(cls, heads: torch.Tensor) -> torch.Tensor:
        """No d field: d rebuilt from the scales words' top nibbles (quant.iq1_m_d)."""
        return quant.iq1_m_d(heads)


_SUPER_BLOCKS = (_Q2K, _Q3K, _Q4K, _Q5K, _Q6K, _IQ4, _IQ2X, _IQ3X, _IQ3S, _IQ1S, _IQ1M)


_BLOCK_SOURCES = (_Mx4, _Q40, _Q80, *_SUPER_BLOCKS)  # weights kept in a block format of their own, never staged in floats


_AS_Q8_0 = {"Q5_0": quant.q8_0_blocks_from_q5_0, "IQ4_NL": quant.q8_0_blocks_from_iq4_nl}


def gguf_blocks(name: str, raw: torch.Tensor, ggml_type: str):
    """A GGUF tensor's expert blocks as a weight source CpuMoE packs without de-quantizing them: raw uint8
    [E, R, K/32, bytes per block] (a view of the file: no copy) of ggml_type "Q4_0" (dtype q4_0, or int4 with
    group_size 32), "Q8_0" (dtype q8_0), "Q4_K" (dtype q4_k; [E, R, K/256, 144]), "Q5_K" (dtype q5_k; [E, R, K/256, 176]), "Q2_K" (dtype q2_k; [E, R, K/256, 84]), "Q3_K" (dtype q3_k; [E, R, K/256, 110]), "Q6_K" (dtype q6_k; [E, R, K/256, 210]), "IQ4_XS" (dtype iq4_xs; [E, R, K/256, 136]), "IQ2_XXS" (dtype iq2_xxs; [E, R, K/256, 66]), "IQ3_XXS" (dtype iq3_xxs; [E, R, K/256, 98]), "IQ3_S" (dtype iq3_s; [E, R, K/256, 110]), "IQ1_S" (dtype iq1_s; [E, R, K/256, 50]), "IQ1_M" (dtype iq1_m; [E, R, K/256, 56]) or
    "MXFP4" (dtype mxfp4), or "Q5_0" / "IQ4_NL" (dtype q8_0: their values are Q8_0 blocks' with the same fp16 d, so
    they are converted to Q8_0's bytes, a copy of 34 bytes a block for 22 / 18, quant.q8_0_blocks_from_q5_0 /
    _iq4_nl). Sliceable like [E, R, K] (a fused gate_up's row halves are two views)."""
    kind = next((k for k in (_Q40, _Q80, *_SUPER_BLOCKS) if k.TYPE == ggml_type), None)
    if kind is not None:
        return kind(name, raw)
    if ggml_type in _AS_Q8_0:  # a lossless repack into Q8_0's blocks (a copy: the file's bytes are not Q8_0's)
        convert = _AS_Q8_0[ggml_type]
        _check_tensor(f"{name} {ggml_type} blocks", raw, 4, (torch.uint8,), contiguous=False)
        out = torch.empty((*raw.shape[:-1], quant.Q8_0_BLOCK_BYTES), dtype=torch.uint8)
        for e in range(raw.shape[0]):  # an expert at a time: the conversion's temporaries stay one expert's
            out[e] = convert(raw[e])
        return _Q80(name, out)
    if ggml_type == "MXFP4":
        _check_tensor(f"{name} MXFP4 blocks", raw, 4, (torch.uint8,), contiguous=False)
        if raw.shape[-1] != quant.GGUF_MXFP4_BLOCK_BYTES:
            raise ValueError(f"{name}: GGUF MXFP4 blocks must be [E, R, K/32, {quant.GGUF_MXFP4_BLOCK_BYTES}], got "
                             f"{tuple(raw.shape)}")
        return _Mx4(name, raw[..., 1:], raw[..., 0], order="gguf")
    raise ValueError(f"{name}: no CPU executor format holds GGUF {ggml_type} blocks as they are (Q4_0, Q8_0, "
                     "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, MXFP4; Q5_0 and IQ4_NL as "
                     "Q8_0)")


def _align(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def _check_tensor(name, t, ndim, dtypes, contiguous: bool = True):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _kpad_for(dtype: str, group_size: int) -> int:
    """K padding of every packed row: int4 rows hold whole groups, the K-quants' rows whole 256-value super-blocks,
    every other dtype whole 64-value chunks."""
    return max(64, group_size) if dtype == "int4" else quant.QK_K if dtype in _HEAD_BYTES else 64


def _layer_kpad(dtype: str, group_size: int, down_dtype: str) -> int:
    """K padding of every row of a layer: the larger of its dtypes' (a down of its own dtype is never int4, so
    group_size is the gate's and up's)."""
    return max(_kpad_for(dtype, group_size), _kpad_for(down_dtype, quant.MXFP4_BLOCK))


def _int4_order_for(isa: str, asked: str | None, group: int) -> str:
    """The AVX-512 kernels gain from the interleaved int4 order at 2-4 tokens per expert in groups of 64 and 128
    (one convert and scale per fold block instead of per group); in groups of 32 it reads half as fast as the
    natural order at 1-4 tokens (faster only from tens of tokens, where long prompts ship to the GPU anyway), and
    the AVX2 kernels gain nothing from it, so groups of 32, AVX2 and the ref ISA keep the natural order unless
    asked."""
    return asked or ("interleaved" if isa in ("amx", "amx_emu", "avx512_bf16") and group >= 64 else "natural")


def _split_f(F: int, topology: Topology, step: int) -> list[tuple[int, int]]:
    """Split F over the nodes in proportion to their threads, in multiples of the K padding."""
    total = topology.threads
    bounds, acc = [0], 0
    for n in topology.nodes[:-1]:
        acc += len(n)
        bounds.append(min(F, _align(round(F * acc / total), step)))
    bounds.append(F)
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _layout(isa: str, dtype: str, group_size: int, int4_order: str, F: int, topology: Topology,
            down_dtype: str | None = None) -> dict:
    down_dtype = down_dtype or dtype
    kpad = _layer_kpad(dtype, group_size, down_dtype)
    return dict(format=PACK_FORMAT, isa=isa, dtype=dtype,
                group_size=group_size if dtype in ("int4", *_BLOCK_DTYPES) else 0,
                int4_order=int4_order if dtype == "int4" else "", kpad=kpad, row_align=_ROW_ALIGN,
                slices=[[a, b] for a, b in _split_f(F, topology, kpad)],
                **({"down_dtype": down_dtype} if down_dtype != dtype else {}))


def packed_layout(F: int, dtype: str, group_size: int = 128, isa: str | None = None,
                  topology: Topology | None = None, threads=None, int4_order: str | None = None,
                  down_dtype: str | None = None) -> dict:
    """What the packed bytes of a layer of expert width F depend on besides its weights, as plain data: the
    format version, ISA, int4 order, K padding, row alignment and the F slice of every NUMA node (from the
    threads per node). The same weights pack to the same bytes under equal layouts, so a packed cache keys on
    it (computed before anything is packed, from CpuMoE's own arguments) and CpuMoE.from_packed refuses bytes
    packed under another."""
    isa = _native.resolve_isa(isa)
    topo = (topology if topology is not None else Topology.discover()).limit(threads)
    group = quant.MXFP4_BLOCK if dtype in _BLOCK_DTYPES else group_size
    return _layout(isa, dtype, group, _int4_order_for(isa, int4_order, group), F, topo, down_dtype)


class _Packed:
    """Bytes a CpuMoE packed before (its packed_state, e.g. read back from a packed cache), standing in for one
    of the weight stacks [E, rows, k]: from_packed copies them into node-local buffers with no conversion."""

    def __init__(self, state: Mapping, layout: dict, shape):
        self.state, self.layout, self.shape = state, layout, torch.Size(shape)


class NonFiniteWeights(ValueError):
    """The compiled packer read a NaN or Inf in expert `expert` (index among the experts packed) of `matrix`
    ("gate", "up" or "down"); nothing that holds it is run."""

    def __init__(self, matrix: str, expert: int):
        super().__init__(f"{matrix} weights of expert {expert} hold NaN or Inf")
        self.matrix, self.expert = matrix, expert


class ExpertRows:
    """E experts' matrices of one kind, [E, rows, k], as a checkpoint holds them: one 2-D tensor per expert (fp32,
    bf16 or fp16, any strides: memory-mapped views, no copy), or block-FP8 where scales[e] is given (float8_e4m3fn
    [R, C] and fp32/bf16 scales [ceil(R/b0), ceil(C/b1)], w = q * scale as hybrid.models.fp8 de-quantizes). The
    compiled packer reads them row by row (de-quantizing FP8 there), so no layer is staged whole in floats. Sliced
    like a [E, rows, k] tensor, by ranges, without a copy (a window into the experts' matrices)."""

    def __init__(self, mats, scales=None, block=(128, 128)):
        mats = list(mats)
        scales = [None] * len(mats) if scales is None else list(scales)
        if not mats or len(scales) != len(mats):
            raise ValueError(f"ExpertRows: {len(mats)} matrices with {len(scales)} scales")
        self.block = (int(block[0]), int(block[1]))
        R, C = mats[0].shape if isinstance(mats[0], torch.Tensor) and mats[0].dim() == 2 else (0, 0)
        for e, (t, s) in enumerate(zip(mats, scales)):
            _check_tensor(f"ExpertRows[{e}]", t, 2, _WEIGHT_DTYPES if s is None else (torch.float8_e4m3fn,), False)
            if tuple(t.shape) != (R, C):
                raise ValueError(f"ExpertRows[{e}] is {tuple(t.shape)}, expert 0 {(R, C)}")
            if s is not None:
                _check_tensor(f"ExpertRows[{e}] scales", s, 2, (torch.float32, torch.bfloat16), False)
                want = (-(-R // self.block[0]), -(-C // self.block[1]))
                if tuple(s.shape) != want:
                    raise ValueError(f"ExpertRows[{e}] scales are {tuple(s.shape)}, blocks of {self.block} need {want}")
        self.mats, self.scales, self.r0, self.c0 = mats, scales, 0, 0
        self.shape = torch.Size((len(mats), R, C))

    def __getitem__(self, key):
        (e0, e1), (a, b), (c, d) = _ranges(key, self.shape, "ExpertRows")
        out = ExpertRows.__new__(ExpertRows)
        out.mats, out.scales, out.block = self.mats[e0:e1], self.scales[e0:e1], self.block
        out.r0, out.c0 = self.r0 + a, self.c0 + c
        out.shape = torch.Size((len(out.mats), max(0, b - a), max(0, d - c)))
        return out

    def window(self, e: int) -> torch.Tensor:
        """Expert e's [rows, k] as stored (a view)."""
        _, rows, k = self.shape
        return self.mats[e][self.r0:self.r0 + rows, self.c0:self.c0 + k]

    def dense(self) -> torch.Tensor:
        """[E, rows, k] in one tensor: FP8 de-quantized to fp32, float experts in their dtype (fp32 if they differ)."""
        parts = []
        for e, s in enumerate(self.scales):
            if s is None:
                parts.append(self.window(e))
                continue
            R, C = self.mats[e].shape
            full = s.float().repeat_interleave(self.block[0], 0)[:R].repeat_interleave(self.block[1], 1)[:, :C]
            parts.append((self.mats[e].float() * full)[self.r0:self.r0 + self.shape[1], self.c0:self.c0 + self.shape[2]])
        if len({t.dtype for t in parts}) > 1:
            parts = [t.float() for t in parts]
        return torch.stack(parts)


class ExpertChunks:
    """E experts' float matrices of one kind, [E, rows, k], that exist a few experts at a time: read(e0, e1) ->
    float tensor [e1 - e0, R, K] of the whole matrices (e.g. a GGUF file's K-quant blocks de-quantized on demand).
    Sliced like a [E, rows, k] tensor, by ranges, into a window that reads nothing yet; dense() reads the window.
    The packers take a chunk of experts at a time (CpuMoE._PACK_CHUNK), so a layer is never held whole in floats."""

    def __init__(self, read, shape):
        self.read, self.shape = read, torch.Size(shape)
        self.e0, self.r0, self.c0 = 0, 0, 0

    def __getitem__(self, key):
        (e0, e1), (a, b), (c, d) = _ranges(key, self.shape, "ExpertChunks")
        out = ExpertChunks(self.read, self.shape)
        out.e0, out.r0, out.c0 = self.e0 + e0, self.r0 + a, self.c0 + c
        out.shape = torch.Size((max(0, e1 - e0), max(0, b - a), max(0, d - c)))
        return out

    def dense(self) -> torch.Tensor:
        """The window's values [E, rows, k] (read now)."""
        E, rows, k = self.shape
        return self.read(self.e0, self.e0 + E)[:, self.r0:self.r0 + rows, self.c0:self.c0 + k]


_SRC_CODE = {getattr(torch, name): i for i, name in enumerate(_native.PACK_SRC_DTYPES)}


def _pack_sources(w) -> list[tuple[int, int, _native.HyPackSrc, list]]:
    """w (a float tensor [E, rows, k], any strides, ExpertRows, or _Q40 / _Q80 / _Q2K / _Q3K / _Q4K / _Q5K / _Q6K / _IQ4 blocks) -> (first expert,
    experts, hy_pack_mat source, what it points into) for each run of experts stored alike (dtype, strides, scales):
    usually one run for all E."""
    E, rows, k = w.shape
    if isinstance(w, _GgufBlocks):  # raw blocks [E, rows, k/block, bytes]: one run, byte strides
        src = _native.HyPackSrc()
        ptrs = (ctypes.c_void_p * E)(*(w.raw.data_ptr() + e * w.raw.stride(0) for e in range(E)))
        src.w, src.wdtype, src.rs, src.cs = ptrs, w.SRC, w.raw.stride(1), w.raw.stride(2)
        src.rows, src.k = rows, k
        return [(0, E, src, [w, ptrs])]
    if isinstance(w, torch.Tensor):  # expert e at data_ptr + e * stride(0) elements
        size = w.element_size()
        views = [(w.data_ptr() + e * w.stride(0) * size, w.dtype, w.stride()[1:], None) for e in range(E)]
    else:  # (pointer, dtype, strides, FP8 scales' (pointer, dtype, strides) or None) of each expert's window
        views = [(v.data_ptr(), v.dtype, v.stride(), None if s is None else (s.data_ptr(), s.dtype, s.stride()))
                 for v, s in ((w.window(e), s) for e, s in enumerate(w.scales))]
    runs, e0 = [], 0
    for e in range(1, E + 1):
        if e < E and views[e][1:3] == views[e0][1:3] and (views[e][3] is None) == (views[e0][3] is None) and (
                views[e][3] is None or views[e][3][1:] == views[e0][3][1:]):
            continue
        _, dtype, (rs, cs), scale = views[e0]
        src = _native.HyPackSrc()
        ptrs = (ctypes.c_void_p * (e - e0))(*(v[0] for v in views[e0:e]))
        src.w, src.wdtype, src.rs, src.cs, src.rows, src.k = ptrs, _SRC_CODE[dtype], rs, cs, rows, k
        run_keep = [w, ptrs]
        if scale is not None:
            sptrs = (ctypes.c_void_p * (e - e0))(*(v[3][0] for v in views[e0:e]))
            src.s, src.sdtype, (src.srs, src.scs) = sptrs, _SRC_CODE[scale[1]], scale[2]
            src.r0, src.c0, (src.b0, src.b1) = w.r0, w.c0, w.block
            run_keep.append(sptrs)
        runs.append((e0, e - e0, src, run_keep))
        e0 = e
    return runs


@functools.lru_cache(maxsize=None)
def _one_node_machine() -> bool:
    """Whether the cpus this process may use sit on one NUMA node: then no page has a node to be first touched on,
    and the packing thread helps its pool (else only the node's pinned threads touch the node's pages)."""
    return len(Topology.discover().nodes) == 1


class HostJob:
    """A CpuMoE call as (fn, arg) for cuLaunchHostFunc; .run() calls it here (tests, CPU-only hosts)."""

    def __init__(self, moe: "CpuMoE", x, ids, wts, lmap, out, pin_cpu: int = -1):
        T, K = ids.shape
        self._keep = (moe, x, ids, wts, lmap, out)  # the job points into these
        self._lib = _native.load(moe.isa)
        self.job = _native.HyJob(ctypes.addressof(moe._layer), x.data_ptr(), ids.data_ptr(), wts.data_ptr(),
                                 lmap.data_ptr(), out.data_ptr(), _X_DTYPES[x.dtype], T, K, moe.num_experts,
                                 _X_DTYPES[out.dtype], int(pin_cpu), 0, int(ids.dtype == torch.int64), 0, 0)
        self.fn = ctypes.cast(self._lib.hy_host_job, ctypes.c_void_p).value  # address of the C host function
        self.arg = ctypes.addressof(self.job)

    def run(self) -> None:
        self._lib.hy_host_job(self.arg)

    @property
    def rc(self) -> int:
        return self.job.rc

    @property
    def runs(self) -> int:
        return self.job.runs

    @property
    def failures(self) -> int:
        return self.job.failures

    @property
    def busy_s(self) -> float:
        """Seconds spent computing over all runs (the C function's own clock, wherever it ran)."""
        return self.job.busy_ns * 1e-9


class MoEHandle:
    """Result of CpuMoE.submit; .wait() returns the output tensor (or raises the call's error)."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()


_executor_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _submit_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:  # calls queue in the library anyway; a few threads overlap their Python parts
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="cpu-moe")
        return _executor


class CpuMoE:
    """The CPU experts of one MoE layer: packs (and quantizes) their weights once, then runs calls.

    w_gate, w_up [E, F, D] and w_down [E, D, F] (fp32/bf16/fp16, contiguous) are the experts held here,
    whose global ids are expert_ids (default 0..E-1) out of num_experts (default max id + 1); tokens
    routed to other experts are skipped. dtype: "bf16" | "int8" (per-row scales) | "int4" (group_size
    32/64/128) | "mxfp4" (quantize_mxfp4 of the weights; D and F multiples of 32; CpuMoE.from_mxfp4 packs
    published blocks as they are, and gguf_blocks makes GGUF blocks of every type below a weight source) | "q8_0"
    (int8 in blocks of 32 with an fp16 scale each, quantize_q8_0; CpuMoE.from_q8_0 packs GGUF Q8_0 blocks as they
    are) | "q4_0" (llama.cpp's Q4_0, quantize_q4_0; CpuMoE.from_q4_0 packs GGUF Q4_0 blocks as they are, or as int4
    in groups of 32) | "q4_k" (llama.cpp's Q4_K, quantize_q4_k; rows padded to
    256 values; CpuMoE.from_q4_k packs GGUF Q4_K blocks as they are) | "q5_k" (llama.cpp's Q5_K, quantize_q5_k;
    from_q5_k) | "q2_k" (llama.cpp's Q2_K, quantize_q2_k; from_q2_k) | "q3_k" (llama.cpp's Q3_K, quantize_q3_k; from_q3_k) | "q6_k" (llama.cpp's Q6_K, quantize_q6_k; rows
    padded to 256 values; CpuMoE.from_q6_k packs GGUF Q6_K blocks as they are) | "iq4_xs" (llama.cpp's IQ4_XS,
    quantize_iq4_xs; rows padded to 256 values; from_iq4_xs). One kind of blocks may stand beside float
    matrices (a GGUF layer whose down is of another type: its values quantized, the blocks kept). threads /
    topology: the cpus used (default: every allowed cpu, NUMA nodes from sysfs).
    isa: force "amx" | "avx512_bf16" | "avx2" | "ref" (default: HYBRID_CPU_ISA or the best available).
    activation: "silu" | "gelu" | "swiglu_oai" (alpha, limit). b_gate, b_up [E, F] and b_down [E, D]: optional
    per-expert biases (gpt-oss), kept in fp32 whatever dtype: expert(x) = down(act(gate x + b_gate,
    up x + b_up)) + b_down, weighted by the routing weight. amx_min_tokens: tokens per expert from
    which the AMX path is used (default: the knee measured for dtype). int4_order: "interleaved" (the stored
    order whose kernel lanes each hold one group for a whole fold block, cpu_kernels/quant.py) or "natural" (one
    group per chunk); default: interleaved on the AVX-512 and AMX builds (and amx_emu, which stands in for AMX) in
    groups of 64 and 128, natural in groups of 32 and on AVX2 and ref. w_gate, w_up, w_down may also be ExpertRows (a checkpoint's per-expert matrices as
    read, block-FP8 too), packed without a float copy of the layer. packer: "native" (default: bf16, int8, int4,
    q8_0, q4_0, iq4_xs and GGUF blocks are packed by the compiled packer, csrc/pack.h, on the node's pool, a NaN or Inf refused with NonFiniteWeights)
    or "torch" (the PyTorch reference of cpu_kernels/quant.py, byte for byte the same; mxfp4 always). Attributes:
    isa, nbytes (packed weight bytes), topology; packed_weights() exposes the one packed copy for the GPU lane.
    """

    def __init__(self, w_gate, w_up, w_down, dtype: str = "bf16", group_size: int = 128, threads=None,
                 topology: Topology | None = None, expert_ids=None, activation: str = "silu",
                 isa: str | None = None, num_experts: int | None = None, amx_min_tokens: int | None = None,
                 alpha: float = 1.702, limit: float = 7.0, b_gate=None, b_up=None, b_down=None,
                 int4_order: str | None = None, packer: str = "native", down_dtype: str | None = None):
        # float tensors, ExpertRows (a checkpoint's own per-expert matrices) or ExpertChunks (read a few experts
        # at a time); _Mx4 (from_mxfp4: the published
        # blocks, never a float copy), _Q40 / _Q80 / _Q2K / _Q3K / _Q4K / _Q5K / _Q6K / _IQ4 (from_q4_0 / ... / from_iq4_xs,
        # gguf_blocks); _Packed
        # (from_packed)
        # Each matrix packs on its own: float kinds mix with each other and with blocks (a GGUF layer whose down is
        # of a type the dtype does not hold: quantized from its values, the others kept as they are); gate and up
        # are of one kind, the down may be of another where down_dtype holds it.
        down_dtype = dtype if down_dtype is None else down_dtype
        kind = [type(w) if isinstance(w, (*_BLOCK_SOURCES, _Packed, ExpertRows, ExpertChunks)) else torch.Tensor
                for w in (w_gate, w_up, w_down)]
        floats = {torch.Tensor, ExpertRows, ExpertChunks}
        blocks = {k for k in kind[:2] if k not in floats}
        if len(blocks) > 1 or (_Packed in kind and set(kind) != {_Packed}):
            raise ValueError("w_gate, w_up and w_down must all be float tensors or ExpertRows, or one kind of blocks "
                             "beside them (from_mxfp4 takes blocks, from_packed packed bytes)")
        source = blocks.pop() if blocks else torch.Tensor
        down_source = kind[2] if kind[2] not in floats else torch.Tensor  # checked against down_dtype below
        if packer not in ("native", "torch"):
            raise ValueError(f"packer must be 'native' or 'torch', got {packer!r}")
        for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
            if isinstance(w, torch.Tensor):
                _check_tensor(name, w, 3, _WEIGHT_DTYPES)
        for src, dt in ((source, dtype), (down_source, down_dtype)):
            if src is _Mx4 and dt != "mxfp4":
                raise ValueError(f"published mxfp4 blocks pack as dtype 'mxfp4', not {dt!r}")
            if src is _Q40 and dt != "q4_0" and (dt != "int4" or group_size != quant.Q4_0_BLOCK):
                raise ValueError(f"Q4_0 blocks pack as dtype 'q4_0', or 'int4' with group_size 32, not {dt!r} "
                                 f"(group_size {group_size})")
            if src is _Q80 and dt != "q8_0":
                raise ValueError(f"Q8_0 blocks pack as dtype 'q8_0', not {dt!r}")
            if src in _SUPER_BLOCKS and dt != src.DTYPE:
                raise ValueError(f"{src.TYPE} blocks pack as dtype {src.DTYPE!r}, not {dt!r}")
            if dt in FILE_ONLY_DTYPES and src is not _Packed and getattr(src, "DTYPE", None) != dt:
                raise ValueError(quant.FILE_ONLY_MESSAGE.format(dtype=dt, type=dt.upper()))
        E, F, D = w_gate.shape
        if tuple(w_up.shape) != (E, F, D) or tuple(w_down.shape) != (E, D, F):
            raise ValueError(f"expected w_gate, w_up [E, F, D] and w_down [E, D, F]; got {tuple(w_gate.shape)}, "
                             f"{tuple(w_up.shape)}, {tuple(w_down.shape)}")
        biases = []
        for name, b, shape in (("b_gate", b_gate, (E, F)), ("b_up", b_up, (E, F)), ("b_down", b_down, (E, D))):
            if b is not None:
                _check_tensor(name, b, 2, _WEIGHT_DTYPES)
                if tuple(b.shape) != shape:
                    raise ValueError(f"{name} must be {list(shape)}, got {tuple(b.shape)}")
                b = b.detach().float().contiguous()
            biases.append(b)
        self._bias = tuple(biases)  # fp32 (b_gate, b_up, b_down), None where absent
        if E < 1 or F < 1 or D < 1:
            raise ValueError("empty weights")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        if down_dtype != dtype and (down_dtype not in DOWN_DTYPES or dtype == "bf16"):
            raise ValueError(f"down_dtype {down_dtype!r} beside dtype {dtype!r}: a down of its own dtype is one of "
                             f"{DOWN_DTYPES} beside a quantized dtype (their activation rows are alike)")
        if dtype == "int4" and group_size not in quant.GROUP_SIZES:
            raise ValueError(f"group_size must be one of {quant.GROUP_SIZES}, got {group_size}")
        if int4_order not in (None, "interleaved", "natural"):
            raise ValueError(f"int4_order must be 'interleaved' or 'natural', got {int4_order!r}")
        if (dtype == "mxfp4" and D % quant.MXFP4_BLOCK) or ("mxfp4" in (dtype, down_dtype) and F % quant.MXFP4_BLOCK):
            raise ValueError(f"mxfp4 needs D and F (the reduction lengths of gate/up and down) to be multiples of "
                             f"{quant.MXFP4_BLOCK} (one shared exponent per {quant.MXFP4_BLOCK} values); got D={D}, F={F}")
        if dtype in _BLOCK_DTYPES:
            group_size = quant.MXFP4_BLOCK  # the activations' group sums and the kernels' block (sub-block)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if amx_min_tokens is None:
            amx_min_tokens = knee.default_knee(dtype, AMX_KNEE)
        if amx_min_tokens < 1:
            raise ValueError("amx_min_tokens must be >= 1")
        if expert_ids is None:
            expert_ids = list(range(E))
        expert_ids = [int(i) for i in (expert_ids.tolist() if isinstance(expert_ids, torch.Tensor) else expert_ids)]
        if len(expert_ids) != E or len(set(expert_ids)) != E or min(expert_ids) < 0:
            raise ValueError(f"expert_ids must be {E} distinct ids >= 0")
        n_global = max(expert_ids) + 1 if num_experts is None else int(num_experts)
        if max(expert_ids) >= n_global:
            raise ValueError(f"expert_ids exceed num_experts={n_global}")
        self.E, self.F, self.D, self.num_experts = E, F, D, n_global
        self.dtype, self.group_size, self.activation, self.packer = dtype, group_size, activation, packer
        self.down_dtype = down_dtype
        self.alpha, self.limit, self.amx_min_tokens = float(alpha), float(limit), int(amx_min_tokens)
        self.expert_ids = expert_ids
        self._lmap = torch.full((n_global,), -1, dtype=torch.int32)
        self._lmap[torch.tensor(expert_ids)] = torch.arange(E, dtype=torch.int32)
        self.isa = _native.resolve_isa(isa)
        if {dtype, down_dtype} & set(FILE_ONLY_DTYPES) and not _native.has_iq_grids(self.isa, (dtype, down_dtype)):
            raise ValueError(f"the {self.isa} library was built before the IQ formats ({dtype}, {down_dtype}); rebuild "
                             "it with `pip install -e .`")
        self.int4_order = _int4_order_for(self.isa, int4_order, group_size)
        spec = CPU_DTYPES[dtype]
        if self.isa in ("amx", "amx_emu") and ("amx" not in spec.isas or group_size < spec.amx_min_group):
            _say_vector_only(dtype if dtype != "int4" else f"int4 (group {group_size})", self.isa)
        elif self.isa in ("amx", "amx_emu") and down_dtype != dtype:
            _say_vector_only(f"a down in {down_dtype} beside {dtype}", self.isa)
        topo = topology if topology is not None else Topology.discover()
        if not isinstance(topo, Topology):
            raise ValueError("topology must be a cpu_kernels.Topology")
        self.topology = topo.limit(threads)
        self._keep: list[torch.Tensor] = []
        if source is _Packed:
            self._check_packed(w_gate.layout)
        if self.isa == "ref":
            self._pack_ref(w_gate, w_up, w_down)
        else:
            self._pack_native(w_gate, w_up, w_down)

    @classmethod
    def from_packed(cls, state: Mapping[str, torch.Tensor], shape, layout: dict, **kwargs) -> "CpuMoE":
        """The executor over bytes another CpuMoE packed (its packed_state(), e.g. memory-mapped from a packed
        cache), copied into node-local buffers by each node's threads with no conversion, so it computes
        exactly what that one did. shape: (E, F, D); layout: that executor's `layout`, which must equal the
        one these arguments give on this machine (ValueError otherwise, as for missing, extra or mis-sized
        bytes). The biases come from the bytes. kwargs: CpuMoE's (dtype, group_size, threads, topology, isa,
        activation, ...), as the packing executor had them."""
        E, F, D = (int(v) for v in shape)
        mats = [_Packed(state, layout, s) for s in ((E, F, D), (E, F, D), (E, D, F))]
        return cls(*mats, **kwargs)

    def _check_packed(self, layout: dict) -> None:
        """from_packed's bytes must have been packed under this executor's layout, and carry their biases."""
        if self.isa == "ref":
            raise ValueError("packed bytes run on a compiled ISA; the ref ISA keeps plain tensors")
        if layout != self.layout:
            raise ValueError(f"bytes packed under layout {layout} do not fit this executor's {self.layout}")
        if any(b is not None for b in self._bias):
            raise ValueError("from_packed takes the biases from the packed bytes; pass none")

    @property
    def layout(self) -> dict:
        """packed_layout() of this executor: what its packed bytes depend on besides the weights."""
        return _layout(self.isa, self.dtype, self.group_size, self.int4_order, self.F, self.topology,
                       self.down_dtype)

    @classmethod
    def from_mxfp4(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over published mxfp4 experts (gpt-oss), packed without a float copy of the weights.

        gate, up: (blocks uint8 [E, F, D/32, 16], scales uint8 [E, F, D/32]) (gate/up rows already apart);
        down: (blocks [E, D, F/32, 16], scales [E, D, F/32]); D and F multiples of 32. The codes are only
        re-ordered into the kernels' layout (cpu_kernels.quant, module doc), a chunk of experts at a time; the
        exponents are kept as they are. kwargs: CpuMoE's (threads, topology, expert_ids, activation, alpha,
        limit, b_gate, b_up, b_down, isa, num_experts, ...); dtype, if given, must be "mxfp4".
        """
        mats = []
        for name, pair in (("gate", gate), ("up", up), ("down", down)):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(f"from_mxfp4: {name} must be a (blocks, scales) pair")
            mats.append(_Mx4(name, *pair))
        kwargs.setdefault("dtype", "mxfp4")
        return cls(*mats, **kwargs)

    @classmethod
    def from_q4_0(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF Q4_0 experts, packed without de-quantizing them: as q4_0 (default), the file's 16
        bytes of nibbles and fp16 scale per block as they are, 4.5 bits a weight; or as int4 in groups of 32
        (dtype="int4"), the file's nibbles re-ordered into int4's layout and its scales in fp32, 5 bits a weight.
        Either holds the file's values exactly (cpu_kernels.quant, module doc), which re-quantizing them would not
        give.

        gate, up: raw blocks uint8 [E, F, D/32, 18]; down: [E, D, F/32, 18] (views of the file, any strides; a
        fused gate_up's two row halves are two views). kwargs: CpuMoE's; dtype, if given, must be "q4_0" or "int4"
        (group_size 32).
        """
        return cls._from_gguf(_Q40, (gate, up, down), {"dtype": "q4_0", "group_size": quant.Q4_0_BLOCK}, kwargs)

    @classmethod
    def from_q8_0(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF Q8_0 experts, packed as q8_0 without de-quantizing them: the file's int8 values
        and fp16 scales are q8_0's exactly (cpu_kernels.quant, module doc), so it computes with the file's values.

        gate, up: raw blocks uint8 [E, F, D/32, 34]; down: [E, D, F/32, 34] (views of the file, any strides; a
        fused gate_up's two row halves are two views). kwargs: CpuMoE's; dtype, if given, must be "q8_0".
        """
        return cls._from_gguf(_Q80, (gate, up, down), {"dtype": "q8_0"}, kwargs)

    @classmethod
    def from_q4_k(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF Q4_K experts, packed as q4_k without de-quantizing them: the file's nibbles and
        super-block heads are q4_k's exactly (cpu_kernels.quant, module doc), so it computes with the file's values.

        gate, up: raw blocks uint8 [E, F, D/256, 144]; down: [E, D, F/256, 144] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "q4_k".
        """
        return cls._from_gguf(_Q4K, (gate, up, down), {"dtype": "q4_k"}, kwargs)

    @classmethod
    def from_q2_k(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF Q2_K experts, packed as q2_k without de-quantizing them: the file's values, scales and
        d, dmin are q2_k's exactly (cpu_kernels.quant, module doc).

        gate, up: raw blocks uint8 [E, F, D/256, 84]; down: [E, D, F/256, 84] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "q2_k".
        """
        return cls._from_gguf(_Q2K, (gate, up, down), {"dtype": "q2_k"}, kwargs)

    @classmethod
    def from_q3_k(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF Q3_K experts, packed as q3_k without de-quantizing them: the file's super-blocks are
        q3_k's bytes exactly (cpu_kernels.quant, module doc).

        gate, up: raw blocks uint8 [E, F, D/256, 110]; down: [E, D, F/256, 110] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "q3_k".
        """
        return cls._from_gguf(_Q3K, (gate, up, down), {"dtype": "q3_k"}, kwargs)

    @classmethod
    def from_q5_k(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF Q5_K experts, packed as q5_k without de-quantizing them: the file's nibbles and
        super-block heads with their fifth bits are q5_k's exactly (cpu_kernels.quant, module doc).

        gate, up: raw blocks uint8 [E, F, D/256, 176]; down: [E, D, F/256, 176] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "q5_k".
        """
        return cls._from_gguf(_Q5K, (gate, up, down), {"dtype": "q5_k"}, kwargs)

    @classmethod
    def from_q6_k(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF Q6_K experts, packed as q6_k without de-quantizing them: the file's super-blocks
        are q6_k's bytes exactly (cpu_kernels.quant, module doc), so it computes with the file's values.

        gate, up: raw blocks uint8 [E, F, D/256, 210]; down: [E, D, F/256, 210] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "q6_k".
        """
        return cls._from_gguf(_Q6K, (gate, up, down), {"dtype": "q6_k"}, kwargs)

    @classmethod
    def from_iq4_xs(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF IQ4_XS experts, packed as iq4_xs without de-quantizing them: the file's heads and
        codebook indices (re-paired into int4's chunk layout) are iq4_xs's exactly (cpu_kernels.quant, module doc).

        gate, up: raw blocks uint8 [E, F, D/256, 136]; down: [E, D, F/256, 136] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "iq4_xs".
        """
        return cls._from_gguf(_IQ4, (gate, up, down), {"dtype": "iq4_xs"}, kwargs)

    @classmethod
    def from_iq2_xxs(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF IQ2_XXS experts, packed as iq2_xxs without de-quantizing them: the file's d and qs are
        iq2_xxs's bytes exactly (cpu_kernels.quant, module doc).

        gate, up: raw blocks uint8 [E, F, D/256, 66]; down: [E, D, F/256, 66] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "iq2_xxs".
        """
        return cls._from_gguf(_IQ2X, (gate, up, down), {"dtype": "iq2_xxs"}, kwargs)

    @classmethod
    def from_iq3_xxs(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF IQ3_XXS experts, packed as iq3_xxs without de-quantizing them: the file's d and qs are
        iq3_xxs's bytes exactly (cpu_kernels.quant, module doc).

        gate, up: raw blocks uint8 [E, F, D/256, 98]; down: [E, D, F/256, 98] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "iq3_xxs".
        """
        return cls._from_gguf(_IQ3X, (gate, up, down), {"dtype": "iq3_xxs"}, kwargs)

    @classmethod
    def from_iq3_s(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF IQ3_S experts, packed as iq3_s without de-quantizing them: the file's d, qs, qh,
        signs and scales are iq3_s's bytes exactly (cpu_kernels.quant, module doc).

        gate, up: raw blocks uint8 [E, F, D/256, 110]; down: [E, D, F/256, 110] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "iq3_s".
        """
        return cls._from_gguf(_IQ3S, (gate, up, down), {"dtype": "iq3_s"}, kwargs)

    @classmethod
    def from_iq1_s(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF IQ1_S experts, packed as iq1_s without de-quantizing them: the file's d, qs and qh are
        iq1_s's bytes exactly (cpu_kernels.quant, module doc).

        gate, up: raw blocks uint8 [E, F, D/256, 50]; down: [E, D, F/256, 50] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "iq1_s".
        """
        return cls._from_gguf(_IQ1S, (gate, up, down), {"dtype": "iq1_s"}, kwargs)

    @classmethod
    def from_iq1_m(cls, gate, up, down, **kwargs) -> "CpuMoE":
        """The executor over GGUF IQ1_M experts, packed as iq1_m without de-quantizing them: the file's qs, qh and
        scales words (d's nibbles among them) are iq1_m's bytes exactly (cpu_kernels.quant, module doc).

        gate, up: raw blocks uint8 [E, F, D/256, 56]; down: [E, D, F/256, 56] (views of the file, any strides).
        kwargs: CpuMoE's; dtype, if given, must be "iq1_m".
        """
        return cls._from_gguf(_IQ1M, (gate, up, down), {"dtype": "iq1_m"}, kwargs)

    @classmethod
    def _from_gguf(cls, kind: type, mats: tuple, defaults: dict, kwargs: dict) -> "CpuMoE":
        """The executor over (gate, up, down) raw GGUF blocks of `kind` (or its slices), with `defaults` for the
        kwargs the caller left out."""
        blocks = [w if isinstance(w, kind) else kind(name, w) for name, w in zip(("gate", "up", "down"), mats)]
        return cls(*blocks, **{**defaults, **kwargs})

    # ---- packing -------------------------------------------------------------------------------
    def _mx4_parts(self, w, rows_p: int, ldk: int):
        """A chunk of experts (float [c, rows, k] or _Mx4) -> (codes [c, rows_p, ldk/2], exponents [c, rows_p,
        ldk/32], None) in the kernels' layout; padding blocks are zero codes with exponent 127 (what
        quantize_mxfp4 gives an all-zero block)."""
        blocks, scales = w.published() if isinstance(w, _Mx4) else quant.quantize_mxfp4(w)
        _, rows, G = scales.shape
        gp = ldk // quant.MXFP4_BLOCK
        blocks = torch.nn.functional.pad(blocks, (0, 0, 0, gp - G, 0, rows_p - rows))
        scales = torch.nn.functional.pad(scales, (0, gp - G, 0, rows_p - rows), value=127)
        q, e = quant.pack_mxfp4(blocks, scales)
        return q, e, None

    def _q40_parts(self, w, rows_p: int, ldk: int, dt: str):
        """A chunk of experts (Q4_0 blocks, or float [c, rows, k] for q4_0) -> dtype dt's parts: q4_0 (values uint8
        [c, rows_p, ldk/2], fp16 scales [c, rows_p, ldk/32], None), a float chunk zero padded to whole blocks and
        quantized first, padding the byte 0x88 (q = 8) with scale 0 (what quantize_q4_0 gives zeros); int4 (packed
        nibbles [c, rows_p, ldk/2], fp32 scales [c, rows_p, ldk/32], None) in the kernels' int4 layout, the file's
        nibbles and scales as they are, padding nibble 8 with scale 0 (what quantize_int4 gives zeros)."""
        if dt == "int4":
            u, d = quant.q4_0_nibbles(w.raw)
            _, rows, K = u.shape
            u = torch.nn.functional.pad(u, (0, ldk - K, 0, rows_p - rows), value=8)
            d = torch.nn.functional.pad(d, (0, (ldk - K) // quant.Q4_0_BLOCK, 0, rows_p - rows))
            return quant.pack_int4(u, self.group_size, self._fold(ldk)), d.contiguous(), None
        if isinstance(w, _Q40):
            q, d = quant.q4_0_parts(w.raw)
        else:
            q, d = quant.quantize_q4_0(torch.nn.functional.pad(w.float(), (0, _align(w.shape[-1], 32) - w.shape[-1])))
        _, rows, H = q.shape
        q = torch.nn.functional.pad(q, (0, ldk // 2 - H, 0, rows_p - rows), value=0x88)
        d = torch.nn.functional.pad(d, (0, (ldk - 2 * H) // quant.Q4_0_BLOCK, 0, rows_p - rows))
        return q.contiguous(), d.contiguous(), None

    def _q80_parts(self, w, rows_p: int, ldk: int):
        """A chunk of experts (float [c, rows, k] or _Q80) -> (values int8 [c, rows_p, ldk], fp16 scales [c, rows_p,
        ldk/32], None); a float chunk is zero padded to whole blocks first; padding is value 0 with scale 0."""
        if isinstance(w, _Q80):
            q, d = quant.q8_0_parts(w.raw)
        else:
            q, d = quant.quantize_q8_0(torch.nn.functional.pad(w.float(), (0, _align(w.shape[-1], 32) - w.shape[-1])))
        _, rows, K = q.shape
        q = torch.nn.functional.pad(q, (0, ldk - K, 0, rows_p - rows))
        d = torch.nn.functional.pad(d, (0, (ldk - K) // quant.Q8_0_BLOCK, 0, rows_p - rows))
        return q.contiguous(), d.contiguous(), None

    # the K-quants and iq4_xs: dtype -> (GGUF blocks -> parts, floats -> parts, value bytes per 256-value super-block)
    _KQUANTS = {"q2_k": (quant.q2_k_parts, quant.quantize_q2_k, quant.Q2_K_VALUE_BYTES),
                "q3_k": (quant.q3_k_parts, quant.quantize_q3_k, quant.Q3_K_VALUE_BYTES),
                "iq4_xs": (quant.iq4_xs_parts, quant.quantize_iq4_xs, 128),
                "iq2_xxs": (quant.iq2_xxs_parts, quant.quantize_iq2_xxs, quant.IQ2_XXS_VALUE_BYTES),
                "iq3_xxs": (quant.iq3_xxs_parts, quant.quantize_iq3_xxs, quant.IQ3_XXS_VALUE_BYTES),
                "iq3_s": (quant.iq3_s_parts, quant.quantize_iq3_s, quant.IQ3_S_VALUE_BYTES),
                "iq1_s": (quant.iq1_s_parts, quant.quantize_iq1_s, quant.IQ1_S_VALUE_BYTES),
                "iq1_m": (quant.iq1_m_parts, quant.quantize_iq1_m, quant.IQ1_M_VALUE_BYTES),
                "q4_k": (quant.q4_k_parts, quant.quantize_q4_k, 128),
                "q5_k": (quant.q5_k_parts, quant.quantize_q5_k, 128),
                "q6_k": (quant.q6_k_parts, quant.quantize_q6_k, quant.Q6_K_VALUE_BYTES)}

    def _kquant_parts(self, w, rows_p: int, ldk: int, dt: str):
        """A chunk of experts (float [c, rows, k], or GGUF blocks of dt's type) -> (values uint8 [c, rows_p, ldk/256 x
        the value bytes of a super-block], heads uint8 [c, rows_p, ldk/256, head bytes], None) for K-quant dt; a float
        chunk is zero padded to whole super-blocks first; padding is zero bytes (code 0 under an all-zero head: the
        value 0)."""
        parts, quantize, vbytes = self._KQUANTS[dt]
        if isinstance(w, _GgufBlocks):
            v, h = parts(w.raw)
        else:
            K = w.shape[-1]
            v, h = quantize(torch.nn.functional.pad(w.float(), (0, _align(K, quant.QK_K) - K)))
        _, rows, B = v.shape
        G = ldk // quant.QK_K
        v = torch.nn.functional.pad(v, (0, G * vbytes - B, 0, rows_p - rows))
        h = torch.nn.functional.pad(h, (0, 0, 0, G - h.shape[2], 0, rows_p - rows))
        return v.contiguous(), h.contiguous(), None

    def _quantized(self, w: torch.Tensor, dt: str):
        """w [E, R, K] padded -> (bytes tensor, scale or None, rsum or None) in dtype dt (bf16, int8, int4)."""
        if dt == "bf16":
            return w.to(torch.bfloat16).contiguous(), None, None
        if dt == "int8":
            q, s = quant.quantize_int8(w)
            return q, s.contiguous(), q.sum(-1, dtype=torch.int32).contiguous()
        p, s = quant.quantize_int4(w, self.group_size, self._fold(w.shape[-1]))
        return p, s.contiguous(), None

    def _group(self, dt: str) -> int:
        """Values per scale (and per activation block sum) of a matrix in dtype dt: the block formats' 32, else the
        layer's group_size (int4's; int8 and bf16 ignore it)."""
        return quant.MXFP4_BLOCK if dt in _BLOCK_DTYPES else self.group_size

    def _dt(self, name: str) -> str:
        """The dtype of matrix `name` ("gate", "up", "down")."""
        return self.down_dtype if name == "down" else self.dtype

    def _fold(self, ldk: int) -> int:
        """int4: groups per fold block of a row of ldk values (quant.py; the natural order when int4_order says)."""
        if self.int4_order == "natural":
            return quant.int4_natural_fold(self.group_size)
        return quant.int4_fold_groups(ldk, self.group_size)

    def _dequantized(self, w: torch.Tensor, dt: str) -> torch.Tensor:
        """What the kernels compute with: w [E, R, K] after quantize/dequantize in dtype dt (fp32), or bf16."""
        if isinstance(w, _BLOCK_SOURCES):
            return w.dequantized()
        if isinstance(w, (ExpertRows, ExpertChunks)):
            w = w.dense()
        if dt == "mxfp4":
            return quant.dequantize_mxfp4(*quant.quantize_mxfp4(w))
        if dt == "bf16":
            return w.to(torch.bfloat16)
        if dt == "int8":
            return quant.dequantize_int8(*quant.quantize_int8(w))
        if dt == "q8_0":
            K = w.shape[-1]
            wp = torch.nn.functional.pad(w.float(), (0, _align(K, quant.Q8_0_BLOCK) - K))
            return quant.dequantize_q8_0(*quant.quantize_q8_0(wp))[..., :K]
        if dt == "q4_0":
            K = w.shape[-1]
            wp = torch.nn.functional.pad(w.float(), (0, _align(K, quant.Q4_0_BLOCK) - K))
            return quant.dequantize_q4_0_packed(*quant.quantize_q4_0(wp))[..., :K]
        if dt in self._KQUANTS:
            K = w.shape[-1]
            wp = torch.nn.functional.pad(w.float(), (0, _align(K, quant.QK_K) - K))
            return quant.packed_dequantizers()[dt](*self._KQUANTS[dt][1](wp))[..., :K]
        K = w.shape[-1]
        Kp = _align(K, self._kpad())
        wp = torch.nn.functional.pad(w.float(), (0, Kp - K))
        fold = self._fold(Kp)
        return quant.dequantize_int4(*quant.quantize_int4(wp, self.group_size, fold), self.group_size, fold)[..., :K]

    def _pack_ref(self, w_gate, w_up, w_down):
        self._ref = tuple(self._dequantized(w, self._dt(n)) for w, n in ((w_gate, "gate"), (w_up, "up"), (w_down, "down")))
        self.nbytes = sum(t.numel() * t.element_size() for t in self._ref)

    def _f_slices(self) -> list[tuple[int, int]]:
        return _split_f(self.F, self.topology, self._kpad())

    def _kpad(self) -> int:
        """K padding of every row of the layer (the larger of its dtypes' when the down has its own)."""
        return _layer_kpad(self.dtype, self.group_size, self.down_dtype)

    # The PyTorch reference quantizes experts per chunk, so packing a layer needs fp32 staging for 8 experts, not
    # for all E (the compiled packer stages one row per thread).
    _PACK_CHUNK = 8

    def _q_bytes(self, rows: int, k: int, row_align: int, dt: str) -> int:
        """Bytes of one expert's packed matrix [rows_p, ldk] in dtype dt (int4, mxfp4, q4_0, q4_k, q5_k, iq4_xs: two values a byte; q2_k four; q6_k
        four values in three bytes; q3_k 96 bytes per 256 values)."""
        n = _align(rows, row_align) * _align(k, self._kpad())
        if dt in self._KQUANTS:
            return n // quant.QK_K * self._KQUANTS[dt][2]
        return {"bf16": 2 * n, "int8": n, "int4": n // 2, "mxfp4": n // 2, "q8_0": n, "q4_0": n // 2}[dt]

    def _aux_strides(self, rows_p: int, ldk: int, dt: str) -> list[int | None]:
        """Bytes per expert of a packed matrix's scales and row sums (None: the dtype has none): int8 one fp32
        scale and one int32 sum per row, int4 one fp32 scale per group, mxfp4 one uint8 exponent per block, q8_0
        and q4_0 one fp16 scale per block, q4_k one 16-byte head per 256 values, q5_k a 48-byte one, q6_k an 18-byte one, q2_k a 20-byte
        one, q3_k a 14-byte one, iq4_xs an 8-byte one."""
        return {"bf16": [None, None], "int8": [4 * rows_p, 4 * rows_p],
                "int4": [4 * rows_p * (ldk // self.group_size), None],
                "mxfp4": [rows_p * (ldk // quant.MXFP4_BLOCK), None],
                "q8_0": [2 * rows_p * (ldk // quant.Q8_0_BLOCK), None],
                "q4_0": [2 * rows_p * (ldk // quant.Q4_0_BLOCK), None],
                **{k: [rows_p * (ldk // quant.QK_K) * b, None] for k, b in _HEAD_BYTES.items()}}[dt]

    def _packs_natively(self, w, dt: str | None = None) -> bool:
        """Whether w (of a matrix in dtype dt, default the layer's) is packed by the compiled packer (csrc/pack.h)
        rather than the PyTorch reference."""
        dt = self.dtype if dt is None else dt
        if isinstance(w, _GgufBlocks):  # (the blocks' own bytes in one run each: raw's last stride 1)
            return (self.packer == "native" and w.raw.stride(3) == 1 and w.raw.stride(2) >= w.raw.shape[3]
                    and _native.has_packer(self.isa))
        return (self.packer == "native" and dt in ("bf16", "int8", "int4", "q8_0", "q4_0", "iq4_xs")
                and isinstance(w, (torch.Tensor, ExpertRows, ExpertChunks)) and _native.has_packer(self.isa))

    def _mat_native(self, pool: int, w, rows: int, k: int, row_align: int, block: tuple, name: str):
        """_mat by the compiled packer: every expert's rows straight from w (a float tensor or ExpertRows) into
        the node-local block and scale / row-sum buffers, on the node's pool (which touches the pages first)."""
        rows_p, ldk, dt = _align(rows, row_align), _align(k, self._kpad()), self._dt(name)
        aux = [None if s is None else weight_buffer(self.E * s) for s in self._aux_strides(rows_p, ldk, dt)]
        m = self._hymat(block, aux, rows, k, row_align, dt)
        lib, bad = _native.load(self.isa), ctypes.c_int32(-1)
        step = self._PACK_CHUNK if isinstance(w, ExpertChunks) else self.E  # read a chunk of experts at a time
        for c0 in range(0, self.E, step):
            part = w[c0:c0 + step].dense() if isinstance(w, ExpertChunks) else w
            for e0, n, src, _keep in _pack_sources(part):  # _keep: what src points into, alive through the call
                rc = lib.hy_pack_mat(pool, ctypes.byref(src), ctypes.byref(m), c0 + e0, n,
                                     int(_one_node_machine()), ctypes.byref(bad))
                if rc == _native.PACK_NONFINITE:
                    raise NonFiniteWeights(name, c0 + e0 + bad.value)
                if rc != 0:
                    raise RuntimeError(f"cpu_kernels: hy_pack_mat failed with code {rc}")
        return m, aux

    def _mat(self, pool: int, w: torch.Tensor, rows: int, k: int, row_align: int, block: tuple, name: str):
        """w [E, rows, k] float -> (node-local packed matrix padded to [E, rows_p, ldk], its [scale, rsum]
        buffers or None), its bytes for expert e at block = (buffer, offset, stride): buffer + offset + e *
        stride; name ("gate", "up", "down") picks the matrix's dtype. The compiled packer where it can
        (_mat_native); else (the PyTorch reference) each chunk of experts is quantized, then copied into untouched
        pages by the node's pinned threads (first touch = local)."""
        dt = self._dt(name)
        if self._packs_natively(w, dt):
            return self._mat_native(pool, w, rows, k, row_align, block, name)
        rows_p, ldk = _align(rows, row_align), _align(k, self._kpad())
        lib = _native.load(self.isa)
        q_buf, q_off, q_stride = block
        q_bytes = self._q_bytes(rows, k, row_align, dt)
        bufs, strides = None, None
        for e0 in range(0, self.E, self._PACK_CHUNK):
            wc = w[e0:e0 + self._PACK_CHUNK]
            if isinstance(wc, (ExpertRows, ExpertChunks)):
                wc = wc.dense()
            if isinstance(wc, _Q40) or dt == "q4_0":
                parts = list(self._q40_parts(wc, rows_p, ldk, dt))
            elif dt == "q8_0":
                parts = list(self._q80_parts(wc, rows_p, ldk))
            elif dt in self._KQUANTS:
                parts = list(self._kquant_parts(wc, rows_p, ldk, dt))
            elif dt == "mxfp4":
                parts = list(self._mx4_parts(wc, rows_p, ldk))
            elif dt == "bf16" and rows_p == rows and ldk == k:  # already the packed layout
                parts = [wc.to(torch.bfloat16).contiguous(), None, None]
            else:
                wp = torch.nn.functional.pad(wc.float(), (0, ldk - k, 0, rows_p - rows))
                parts = list(self._quantized(wp, dt))  # q, scale or None, rsum or None
            if isinstance(wc, (_Q40, _SuperBlocks)):  # the file's d (and dmin) as they are: refused as the compiled
                d = (wc.raw[..., 0:2].contiguous().view(torch.float16).float() if isinstance(wc, _Q40)  # packer does
                     else type(wc).head_d(parts[1]))
                d = d.reshape(d.shape[0], -1)
                bad = (~torch.isfinite(d)).any(-1).nonzero()
                if bad.numel():
                    raise NonFiniteWeights(name, e0 + int(bad[0]))
            if bufs is None:
                strides = [None if t is None else t[0].numel() * t.element_size() for t in parts]
                if strides[0] != q_bytes or strides[1:] != self._aux_strides(rows_p, ldk, dt):
                    raise AssertionError(f"packed expert is {strides} bytes, its slots {q_bytes} and "
                                         f"{self._aux_strides(rows_p, ldk, dt)}")
                bufs = [None] + [None if s is None else weight_buffer(self.E * s) for s in strides[1:]]
            for j in range(parts[0].shape[0]):  # q: one expert at a time into its block
                lib.hy_pool_copy(pool, q_buf.data_ptr() + q_off + (e0 + j) * q_stride, parts[0][j].data_ptr(), q_bytes)
            for t, buf, s in zip(parts[1:], bufs[1:], strides[1:]):
                if t is not None:
                    lib.hy_pool_copy(pool, buf.data_ptr() + e0 * s, t.data_ptr(), t.numel() * t.element_size())
        return self._hymat(block, bufs[1:], rows, k, row_align, dt), bufs[1:]

    def _mat_packed(self, pool: int, packed: Mapping, key: str, rows: int, k: int, row_align: int, block: tuple,
                    name: str):
        """_mat from packed bytes (from_packed): its q bytes are already in the block; its scales and row sums
        are copied from packed[key + '.scale' / '.rsum'] as they are."""
        rows_p, ldk, dt = _align(rows, row_align), _align(k, self._kpad()), self._dt(name)
        aux = []
        for part, stride in zip(("scale", "rsum"), self._aux_strides(rows_p, ldk, dt)):
            buf = None if stride is None else weight_buffer(self.E * stride)
            if buf is not None:
                self._copy_in(pool, buf, packed, f"{key}.{part}")
            aux.append(buf)
        return self._hymat(block, aux, rows, k, row_align, dt), aux

    def _hymat(self, block: tuple, aux: list, rows: int, k: int, row_align: int, dt: str) -> _native.HyMat:
        """The kernels' view of one packed matrix in dtype dt: q bytes at block = (buffer, offset, stride), aux =
        its [scale, rsum] buffers or None."""
        rows_p, ldk = _align(rows, row_align), _align(k, self._kpad())
        strides = self._aux_strides(rows_p, ldk, dt)
        q_buf, q_off, q_stride = block
        m = _native.HyMat()
        m.w, m.w_estride = q_buf.data_ptr() + q_off, q_stride
        if aux[0] is not None:  # fp32 scales; mxfp4 / q4_k: uint8 exponents / heads, s_estride in bytes; q8_0,
            m.scale = aux[0].data_ptr()  # q4_0: fp16, in halves
            m.s_estride = strides[0] // (1 if dt == "mxfp4" or dt in _HEAD_BYTES else 2 if dt in ("q8_0", "q4_0") else 4)
        if aux[1] is not None:
            m.rsum, m.r_estride = aux[1].data_ptr(), strides[1] // 4
        m.rows, m.rows_p, m.k, m.ldk = rows, rows_p, k, ldk
        m.group, m.dtype = self._group(dt), DTYPES[dt]
        m.fold = self._fold(ldk) if dt == "int4" else 1
        self.nbytes += self.E * self._q_bytes(rows, k, row_align, dt) + sum(b.numel() for b in aux if b is not None)
        return m

    def _copy_in(self, pool: int, dst: torch.Tensor, packed: Mapping, key: str) -> None:
        """dst <- packed[key] byte for byte, by the node's pinned threads (first touch = node-local)."""
        src, n = packed.get(key), dst.numel() * dst.element_size()
        got = None if src is None else src.numel() * src.element_size()
        if got != n or not src.is_contiguous() or src.device.type != "cpu":
            raise ValueError(f"packed bytes {key!r}: {'missing' if got is None else f'{got} bytes'}, "
                             f"expected {n} contiguous bytes on the CPU")
        _native.load(self.isa).hy_pool_copy(pool, dst.data_ptr(), src.data_ptr(), n)

    def _set_bias(self, pool: int, m: _native.HyMat, b, packed: Mapping | None = None,
                  key: str = "") -> torch.Tensor | None:
        """m.bias = b [E, rows] fp32, zero padded to [E, rows_p] in node-local memory (nullptr when b is None);
        from packed bytes (from_packed): packed[key] if present, else none. Returns the node's buffer."""
        if packed is not None:
            bp = packed.get(key)
        elif b is not None:
            bp = torch.nn.functional.pad(b.float(), (0, m.rows_p - b.shape[1])).contiguous()
        else:
            bp = None
        if bp is None:
            m.bias, m.b_estride = None, 0
            return None
        dst = torch.empty(self.E, m.rows_p, dtype=torch.float32)
        self._copy_in(pool, dst, {key: bp}, key)
        m.bias, m.b_estride = dst.data_ptr(), m.rows_p
        self.nbytes += dst.numel() * 4
        return dst

    def _pack_native(self, w_gate, w_up, w_down):
        packed = w_gate.state if isinstance(w_gate, _Packed) else None  # from_packed: bytes, no conversion
        self.nbytes = 0
        layer = _native.HyLayer()
        layer.dtype, layer.act, layer.n_local, layer.D = DTYPES[self.dtype], ACTIVATIONS.index(self.activation), self.E, self.D
        layer.knee, layer.alpha, layer.limit = self.amx_min_tokens, self.alpha, self.limit
        slices = self._f_slices()
        layer.n_nodes = len(slices)
        self._blocks = []  # per node: [E, block bytes] uint8, expert e's gate | up | down packed bytes
        self._named = []  # per node: name -> every buffer the kernels read (packed_state)
        for n, (f0, f1) in enumerate(slices):
            node = layer.nodes[n]
            node.pool = _native.pool(self.isa, self.topology.nodes[n])
            # gate/up rows padded like down's reduction length, so h [m, F_n] rows need no tail fix-up.
            Fn, kp = f1 - f0, self._kpad()
            mats = (("gate", Fn, self.D, kp), ("up", Fn, self.D, kp), ("down", self.D, Fn, _ROW_ALIGN))
            sizes = [self._q_bytes(rows, k, a, self._dt(name)) for name, rows, k, a in mats]
            stride = sum(sizes)  # every size is a multiple of 64 bytes: each matrix starts cache-line aligned
            block = weight_buffer(self.E * stride)  # 2 MiB pages where the OS allows (memory.py)
            self._blocks.append(block.view(self.E, stride))  # holds the memory the kernels read
            named = {"block": block}
            self._named.append(named)
            if packed is not None:  # the three matrices' q bytes in one copy
                self._copy_in(node.pool, block, packed, f"n{n}.block")
            else:
                weights = (w_gate[:, f0:f1, :], w_up[:, f0:f1, :], w_down[:, :, f0:f1])
            bg, bu, bd = self._bias  # down's bias is added once: node 0's partial carries it
            biases = (None if bg is None else bg[:, f0:f1], None if bu is None else bu[:, f0:f1],
                      bd if n == 0 else None)
            for j, (name, rows, k, align) in enumerate(mats):
                where = (block, sum(sizes[:j]), stride)
                if packed is not None:
                    m, aux = self._mat_packed(node.pool, packed, f"n{n}.{name}", rows, k, align, where, name)
                else:
                    m, aux = self._mat(node.pool, weights[j], rows, k, align, where, name)
                setattr(node, name, m)
                named.update({f"{name}.{part}": t for part, t in zip(("scale", "rsum"), aux) if t is not None})
                bias = self._set_bias(node.pool, getattr(node, name), biases[j], packed, f"n{n}.{name}.bias")
                if bias is not None:
                    named[f"{name}.bias"] = bias
            self._keep += [t for t in named.values() if t is not block]
        self._layer = layer
        self._slices = slices
        if packed is not None and set(packed) != set(self.packed_state()):
            raise ValueError(f"packed bytes name {sorted(set(packed) - set(self.packed_state()))} that this "
                             "executor does not hold")

    def packed_state(self) -> dict[str, torch.Tensor]:
        """Every byte the kernels read, by name: n{node}.block (the experts' gate | up | down q bytes) and
        n{node}.{gate,up,down}.{scale,rsum,bias} where the dtype and biases have them, each a flat uint8 view
        (no copy). What a packed cache stores; from_packed takes it back."""
        if self.isa == "ref":
            raise ValueError("the ref ISA packs nothing (plain tensors): packed_state needs a compiled ISA")
        return {f"n{n}.{name}": t.reshape(-1).view(torch.uint8)
                for n, named in enumerate(self._named) for name, t in named.items()}

    def packed_weights(self) -> list[dict]:
        """The packed weights as tensor views (no copies), one dict per NUMA node slice:
        {f0, f1, block, gate, up, down}; block is [E, bytes] uint8, expert e's gate, up and down packed
        bytes back to back (None with `ref`); gate/up/down are {q, scale, bias, rows, k, dtype, group, fold}
        (mxfp4: q uint8 codes [E, rows_p, ldk/2], scale uint8 exponents [E, rows_p, ldk/32]; q8_0: q int8
        [E, rows_p, ldk], scale fp16 [E, rows_p, ldk/32]; q4_0: q uint8 [E, rows_p, ldk/2] (16 bytes a block, as the
        file's), scale fp16 [E, rows_p, ldk/32]; q4_k: q uint8 nibbles [E, rows_p, ldk/2], scale uint8
        heads [E, rows_p, ldk/256, 16]; q5_k: as q4_k with heads [E, rows_p, ldk/256, 48]; q2_k: q uint8 [E, rows_p, ldk/4], heads [E, rows_p,
        ldk/256, 20]; q3_k: q uint8 [E, rows_p, ldk/256 * 96], heads [E, rows_p, ldk/256, 14]; q6_k: q uint8 [E, rows_p, ldk/256 * 192], scale uint8 heads [E, rows_p,
        ldk/256, 18]; iq4_xs: as q4_k with heads [E, rows_p, ldk/256, 8]); bias
        fp32 [E, rows_p] (zero padded; [E, rows] with `ref`) or None: gate/up's hold the slice's rows of
        b_gate/b_up, down's b_down on the first slice only (None on the others); q a view
        into the block, [E, rows_p, ldk] (bf16, int8) or [E, rows_p, ldk/2] (uint8 int4 nibbles, layout in
        cpu_kernels.quant), zero padded, so q[:, :rows, :k] is the plain matrix. With the `ref` ISA: one
        slice of plain de-quantized tensors."""
        if self.isa == "ref":
            g, u, d = self._ref
            plain = [dict(q=t, scale=None, bias=b, rows=t.shape[1], k=t.shape[2], dtype="plain", group=0)
                     for t, b in zip((g, u, d), self._bias)]
            return [dict(f0=0, f1=self.F, block=None, gate=plain[0], up=plain[1], down=plain[2])]
        by_ptr = {t.data_ptr(): t for t in self._keep}
        out = []
        for n, (f0, f1) in enumerate(self._slices):
            node, mats, blk = self._layer.nodes[n], {}, self._blocks[n]
            for name in ("gate", "up", "down"):
                mm, dt = getattr(node, name), self._dt(name)
                qdtype = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8, "mxfp4": torch.uint8,
                          "q8_0": torch.int8, "q4_k": torch.uint8, "q5_k": torch.uint8, "q6_k": torch.uint8, "q2_k": torch.uint8,
                          "q3_k": torch.uint8, "iq4_xs": torch.uint8, "q4_0": torch.uint8, "iq2_xxs": torch.uint8,
                          "iq3_xxs": torch.uint8, "iq3_s": torch.uint8, "iq1_s": torch.uint8, "iq1_m": torch.uint8}[dt]
                cols = mm.ldk // 2 if dt in ("int4", "mxfp4", "q4_0", "q4_k", "q5_k", "iq4_xs") else mm.ldk // 4 * 3 if dt == "q6_k" else mm.ldk // 4 if dt in ("q2_k", "iq2_xxs") \
                    else mm.ldk // 256 * 96 if dt in ("q3_k", "iq3_xxs") else mm.ldk // 256 * 108 if dt == "iq3_s" else mm.ldk // 256 * 48 if dt in ("iq1_s", "iq1_m") else mm.ldk
                off = mm.w - blk.data_ptr()
                q = blk[:, off:off + self._q_bytes(mm.rows_p, mm.ldk, 1, dt)].view(qdtype).view(self.E, mm.rows_p, cols)
                if dt == "mxfp4":  # uint8 exponents, one per 32-value block
                    s = by_ptr[mm.scale].view(self.E, mm.rows_p, mm.ldk // mm.group)
                elif dt == "int4":
                    s = by_ptr[mm.scale].view(torch.float32).view(self.E, mm.rows_p, mm.ldk // mm.group)
                elif dt in ("q8_0", "q4_0"):  # fp16 scales, one per 32-value block
                    s = by_ptr[mm.scale].view(torch.float16).view(self.E, mm.rows_p, mm.ldk // mm.group)
                elif dt in _HEAD_BYTES:  # uint8 heads, one per 256-value super-block
                    s = by_ptr[mm.scale].view(self.E, mm.rows_p, mm.ldk // quant.QK_K, _HEAD_BYTES[dt])
                else:
                    s = by_ptr[mm.scale].view(torch.float32).view(self.E, mm.rows_p) if dt == "int8" else None
                b = by_ptr[mm.bias].view(self.E, mm.rows_p) if mm.bias else None
                mats[name] = dict(q=q, scale=s, bias=b, rows=mm.rows, k=mm.k, dtype=dt, group=mm.group, fold=mm.fold)
            out.append(dict(f0=f0, f1=f1, block=blk, **mats))
        return out

    def set_amx_min_tokens(self, knee: int) -> None:
        """Tokens per expert from which the AMX path is used (the knee of DESIGN section 3)."""
        if knee < 1:
            raise ValueError("amx_min_tokens must be >= 1")
        self.amx_min_tokens = int(knee)
        if self.isa != "ref":
            self._layer.knee = self.amx_min_tokens

    # ---- calls -----------------------------------------------------------------------------------
    def _validate(self, x, topk_ids, topk_weights, expert_mask, out):
        _check_tensor("x", x, 2, tuple(_X_DTYPES))
        if x.shape[1] != self.D:
            raise ValueError(f"x must be [T, {self.D}], got {tuple(x.shape)}")
        _check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
        _check_tensor("topk_weights", topk_weights, 2, (torch.float32, torch.bfloat16, torch.float16))
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1:
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                             f"must both be [T={x.shape[0]}, K>=1]")
        if expert_mask is not None:
            _check_tensor("expert_mask", expert_mask, 1, (torch.bool,))
            if expert_mask.shape[0] != self.num_experts:
                raise ValueError(f"expert_mask must be bool [{self.num_experts}], got {tuple(expert_mask.shape)}")
        if out is not None:
            _check_tensor("out", out, 2, (x.dtype,))
            if out.shape != x.shape:
                raise ValueError(f"out must be {tuple(x.shape)}, got {tuple(out.shape)}")

    def _local_map(self, expert_mask) -> torch.Tensor:
        """int32 [num_experts]: local index of each global expert held here (and in expert_mask), else -1."""
        return self._lmap if expert_mask is None else torch.where(expert_mask, self._lmap, -1).to(torch.int32)

    def forward(self, x, topk_ids, topk_weights, expert_mask=None, out=None) -> torch.Tensor:
        """out [T, D] (x's dtype) = sum over each token's chosen experts held here (and in expert_mask)
        of topk_weight * expert(x)."""
        self._validate(x, topk_ids, topk_weights, expert_mask, out)
        return self._forward_valid(x, topk_ids, topk_weights, expert_mask, out)

    def _forward_valid(self, x, topk_ids, topk_weights, expert_mask, out) -> torch.Tensor:
        """forward after _validate (submit validates on the caller's thread, this runs on the worker)."""
        lmap = self._local_map(expert_mask)
        if out is None:
            out = torch.empty_like(x)
        # the reference indexes with the ids; the kernels check int32 ids themselves, so int64 ones are checked
        # here, before the conversion could wrap them
        if (self.isa == "ref" or topk_ids.dtype == torch.int64) and topk_ids.numel():
            lo, hi = torch.aminmax(topk_ids)
            if lo < 0 or hi >= self.num_experts:
                raise ValueError(f"topk_ids out of range [0, {self.num_experts})")
        if self.isa == "ref":
            return self._forward_ref(x, topk_ids, topk_weights, lmap, out)
        ids = topk_ids.to(torch.int32).contiguous()
        wts = topk_weights.to(torch.float32).contiguous()
        T, K = ids.shape
        rc = _native.load(self.isa).hy_forward(
            ctypes.byref(self._layer), x.data_ptr(), _X_DTYPES[x.dtype], T, K, ids.data_ptr(), wts.data_ptr(),
            lmap.data_ptr(), self.num_experts, out.data_ptr(), _X_DTYPES[x.dtype])
        if rc == -1:
            raise ValueError(f"topk_ids out of range [0, {self.num_experts})")
        if rc != 0:
            raise RuntimeError(f"cpu_kernels: hy_forward failed with code {rc}")
        return out

    def _forward_ref(self, x, topk_ids, topk_weights, lmap, out):
        local = lmap[topk_ids.long()].long()
        held = local >= 0  # tokens routed to experts not held here (or masked) contribute nothing
        bg, bu, bd = self._bias
        res = moe_forward(x, *self._ref, torch.where(held, local, 0), torch.where(held, topk_weights.float(), 0.0),
                          activation=self.activation, alpha=self.alpha, limit=self.limit, b_gate=bg, b_up=bu, b_down=bd)
        out.copy_(res)
        return out

    __call__ = forward

    def host_job(self, x, topk_ids, topk_weights, out, expert_mask=None, pin_cpu: int = -1) -> "HostJob":
        """forward(x, topk_ids, topk_weights, expert_mask, out) packaged for a CUDA stream-ordered host
        function: the job reads its tensors when it runs (fill them first, e.g. by copies earlier on the
        same stream), never takes the GIL and raises nothing (a failed call fills `out` with NaN and
        counts in `.failures`). topk_ids must be int32 or int64 and topk_weights float32.
        The tensors must stay alive and in place while the job may run. pin_cpu >= 0 pins the thread
        that runs it to that cpu (the pool's first: see cpu_kernels/csrc/pool.h)."""
        if self.isa == "ref":
            raise ValueError("host jobs need a compiled ISA; the ref ISA runs in Python (use forward)")
        self._validate(x, topk_ids, topk_weights, expert_mask, out)
        if out is None or topk_ids.dtype not in (torch.int32, torch.int64) or topk_weights.dtype != torch.float32:
            raise ValueError("host_job needs out, int32 or int64 topk_ids and float32 topk_weights")
        lmap = self._local_map(expert_mask)
        return HostJob(self, x, topk_ids, topk_weights, lmap, out, pin_cpu)

    def submit(self, x, topk_ids, topk_weights, expert_mask=None, out=None) -> MoEHandle:
        """Run forward on a worker thread (the library releases the GIL); returns a handle with .wait()."""
        self._validate(x, topk_ids, topk_weights, expert_mask, out)
        return MoEHandle(_submit_executor().submit(self._forward_valid, x, topk_ids, topk_weights, expert_mask, out))
