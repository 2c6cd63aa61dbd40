"""Quantized GPU-side weights: a matrix kept as int8, int4 or fp8 bytes plus scales, read as such by the decode
GEMV and de-quantized a slice at a time for larger batches.

Formats (W [N, K] = rows x inputs, as nn.Linear stores it):
    int8  q int8 [N, K], scale fp32 [N, ceil(K/g)]: w = q * scale[n, k // g]; scale = amax / 127 per group
          (round to nearest, symmetric).
    int4  q uint8 [N, ceil(K/2)] (k even in the low nibble, k odd in the high one), scale fp32 [N, ceil(K/g)]:
          w = (nibble - 8) * scale[n, k // g]. The scale is the group's value of largest magnitude divided by -8,
          so that value is exactly -8 and the rest round to nearest in [-8, 7] (llama.cpp's Q4_0 rule: the
          full 16 levels are used, where amax / 7 would leave -8 idle).
    fp8   q float8_e4m3fn [N, K], scale fp32 [ceil(N/128), ceil(K/128)]: w = q * scale[n // 128, k // 128], the
          layout DeepSeek-V3 / Kimi-K2 publish (hybrid.models.fp8), so their FP8 bytes are used as they are.
Scales are fp32: 4 bytes per 128 weights (3% on int4) buys scales that add no error of their own.

Why by hand: the formats must match the Triton kernels that read them (hybrid.gpu_kernels.qgemv) and the
checkpoint's own FP8 blocks; the quantization libraries on PyPI tie the bytes to their own kernels and GPUs.

A QWeight is an nn.Module standing where a weight Parameter was (module.weight, or a bare matrix attribute such
as GatedMLP.gate_proj): `linear(x, w, b)` and `embedding(ids, w)` take either. Its tensors are buffers, so
state_dict and .to() see them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.gpu_kernels.qformat import FP8_BLOCK, GROUP, KINDS  # the kernels' side of the format
E4M3_MAX = 448.0
# Rows de-quantized at once by the chunked path (bf16 [rows, K]): ~64 MiB at K = 7168. Bounds the temporary
# a prefill or a large head needs beside the quantized bytes (placement.memory counts it).
DEQUANT_CHUNK_VALUES = 32 * 2**20
CHUNK_ROW_ALIGN = 128  # rows of a de-quantized chunk: a multiple of this (and of fp8's 128-row scale blocks)


def scale_shape(kind: str, n: int, k: int, group: int = GROUP) -> tuple[int, int]:
    if kind == "fp8":
        return (-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
    return (n, -(-k // group))


def q_shape(kind: str, n: int, k: int) -> tuple[int, int]:
    return (n, -(-k // 2)) if kind == "int4" else (n, k)


def q_dtype(kind: str) -> torch.dtype:
    return {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}[kind]


def weight_bytes(kind: str, n: int, k: int, group: int = GROUP) -> int:
    """Bytes of one [n, k] matrix in `kind` ("bf16" = 2 bytes per value), scales included."""
    if kind in ("bf16", "fp16"):
        return 2 * n * k
    if kind == "fp32":
        return 4 * n * k
    qn, qk = q_shape(kind, n, k)
    sn, sk = scale_shape(kind, n, k, group)
    return qn * qk + 4 * sn * sk


class QWeight(nn.Module):
    """A quantized [N, K] matrix (see the module docstring for the formats)."""

    def __init__(self, kind: str, n: int, k: int, device=None, group: int = GROUP):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"quantized kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind == "fp8" and group != FP8_BLOCK[1]:
            raise ValueError("fp8 weights use 128 x 128 blocks")
        self.kind, self.n, self.k, self.group = kind, n, k, group
        self.register_buffer("q", torch.empty(q_shape(kind, n, k), dtype=q_dtype(kind), device=device))
        self.register_buffer("scale", torch.empty(scale_shape(kind, n, k, group), dtype=torch.float32, device=device))

    # what code written for a weight tensor asks of it
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def device(self) -> torch.device:
        return self.q.device

    def data_ptr(self) -> int:
        return self.q.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4

    def extra_repr(self) -> str:
        return f"{self.kind}, [{self.n}, {self.k}], group {self.group}"

    @classmethod
    def from_float(cls, w: torch.Tensor, kind: str, group: int = GROUP) -> "QWeight":
        """Quantizes w [N, K] (any float dtype) on w's device."""
        out = cls(kind, w.shape[0], w.shape[1], device=w.device, group=group)
        out.quantize_(w)
        return out

    @torch.no_grad()
    def quantize_(self, w: torch.Tensor, chunk_values: int = DEQUANT_CHUNK_VALUES, row0: int = 0) -> "QWeight":
        """Fills q and scale from w [N, K] (any device and float dtype), a slice of rows at a time on this
        weight's device, so no float copy of a whole large matrix (a 129280 x 7168 head) is ever made there.
        row0: w is rows row0.. of the matrix (a multiple of 128; the loader's slices)."""
        end = row0 + w.shape[0]
        if w.dim() != 2 or w.shape[1] != self.k or end > self.n or row0 % FP8_BLOCK[0] \
                or (end < self.n and w.shape[0] % FP8_BLOCK[0]):
            raise ValueError(f"expected a [{self.n}, {self.k}] matrix (or its rows from a multiple of 128, whole "
                             f"blocks of 128 but at its end), got {list(w.shape)} at row {row0}")
        step = max(FP8_BLOCK[0], chunk_values // max(1, self.k) // FP8_BLOCK[0] * FP8_BLOCK[0])
        for r in range(0, w.shape[0], step):
            q, s = quantize_rows(w[r:r + step].to(self.device), self.kind, self.group)
            r1 = row0 + r
            self.q[r1:r1 + q.shape[0]] = q
            s0 = r1 // FP8_BLOCK[0] if self.kind == "fp8" else r1
            self.scale[s0:s0 + s.shape[0]] = s
        return self

    @torch.no_grad()
    def copy_fp8_(self, q: torch.Tensor, scale_inv: torch.Tensor) -> "QWeight":
        """Takes a checkpoint's FP8 bytes and block scales as they are (no de-quantization)."""
        if self.kind != "fp8" or tuple(q.shape) != (self.n, self.k) or tuple(scale_inv.shape) != tuple(self.scale.shape):
            raise ValueError(f"fp8 bytes {list(q.shape)} / scales {list(scale_inv.shape)} do not fit {self.extra_repr()}")
        self.q.copy_(q)
        self.scale.copy_(scale_inv.float())
        return self

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, rows: slice | None = None) -> torch.Tensor:
        """[N, K] (or rows r0:r1 of it) in `dtype`: the reference every kernel is tested against."""
        r0, r1 = (0, self.n) if rows is None else (rows.start or 0, self.n if rows.stop is None else rows.stop)
        q = self.q[r0:r1]
        if self.kind == "fp8":
            b0, b1 = FP8_BLOCK
            s = self.scale[r0 // b0:-(-r1 // b0)].repeat_interleave(b0, 0)[r0 % b0:r0 % b0 + r1 - r0]
            s = s.repeat_interleave(b1, 1)[:, :self.k]
            return (q.float() * s).to(dtype)
        s = self.scale[r0:r1].repeat_interleave(self.group, 1)[:, :self.k]
        if self.kind == "int8":
            return (q.float() * s).to(dtype)
        v = torch.stack(((q & 0xF), (q >> 4)), dim=-1).reshape(r1 - r0, 2 * q.shape[1])[:, :self.k]  # nibbles
        return ((v.float() - 8.0) * s).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (any shape) de-quantized -> [*ids.shape, K]: the embedding lookup."""
        flat = ids.reshape(-1)
        q = self.q.index_select(0, flat)
        if self.kind == "fp8":
            s = self.scale.index_select(0, torch.div(flat, FP8_BLOCK[0], rounding_mode="floor"))
            s = s.repeat_interleave(FP8_BLOCK[1], 1)[:, :self.k]
            out = q.float() * s
        else:
            s = self.scale.index_select(0, flat).repeat_interleave(self.group, 1)[:, :self.k]
            if self.kind == "int4":
                q = torch.stack(((q & 0xF), (q >> 4)), dim=-1).reshape(flat.shape[0], 2 * q.shape[1])[:, :self.k]
                out = (q.float() - 8.0) * s
            else:
                out = q.float() * s
        return out.to(dtype).view(*ids.shape, self.k)

    @torch.no_grad()
    def permute_rows_(self, index: torch.Tensor) -> None:
        """Row r becomes old row index[r] (MLA's rope-row fix). Exact where each row keeps its scales: always for
        int8 / int4; for fp8 only when every row stays inside its 128-row block (else re-quantized from the
        de-quantized rows)."""
        index = index.to(self.device)
        if self.kind != "fp8":
            self.q.copy_(self.q[index])
            self.scale.copy_(self.scale[index])
            return
        if bool((torch.div(index, FP8_BLOCK[0], rounding_mode="floor")
                 == torch.arange(self.n, device=self.device) // FP8_BLOCK[0]).all()):
            self.q.copy_(self.q[index])
            return
        self.quantize_(self.dequantize(torch.float32)[index])

    @staticmethod
    def cat(parts: list["QWeight"]) -> "QWeight | None":
        """The parts stacked by rows (q/k/v fused), or None when their formats do not allow it (different kinds,
        groups or inputs, or fp8 parts whose rows are not whole 128-row blocks)."""
        first = parts[0]
        if any(p.kind != first.kind or p.k != first.k or p.group != first.group for p in parts):
            return None
        if first.kind == "fp8" and any(p.n % FP8_BLOCK[0] for p in parts[:-1]):
            return None
        out = QWeight(first.kind, sum(p.n for p in parts), first.k, device=first.device, group=first.group)
        out.q.copy_(torch.cat([p.q for p in parts]))
        out.scale.copy_(torch.cat([p.scale for p in parts]))
        return out

    def point_at_(self, fused: "QWeight", row0: int) -> None:
        """Makes q and scale views of rows row0 : row0 + n of `fused` (cat's output), so fusing doubles nothing."""
        self.q = fused.q[row0:row0 + self.n]
        s0 = row0 // FP8_BLOCK[0] if self.kind == "fp8" else row0
        self.scale = fused.scale[s0:s0 + self.scale.shape[0]]


def quantize_rows(w: torch.Tensor, kind: str, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, K] -> (q, scale) in `kind`'s format (fp8: n a multiple of 128 except at the matrix's end)."""
    n, k = w.shape
    if kind == "fp8":
        from hybrid.models.fp8 import quantize

        return quantize(w, FP8_BLOCK)
    G = -(-k // group)
    wp = F.pad(w.float(), (0, G * group - k)).view(n, G, group)  # [n, G, g]
    if kind == "int8":
        s = wp.abs().amax(-1) / 127.0  # [n, G]
        q = torch.round(wp / s.clamp(min=1e-30)[..., None]).clamp_(-127, 127)
        return q.view(n, G * group)[:, :k].to(torch.int8), s
    s = torch.gather(wp, -1, wp.abs().argmax(-1, keepdim=True)).squeeze(-1) / -8.0  # [n, G], signed
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = (torch.round(wp / safe[..., None]).clamp_(-8, 7) + 8).to(torch.uint8).view(n, G * group)[:, :k]
    if k % 2:
        q = F.pad(q, (0, 1), value=8)  # the pad column de-quantizes to 0
    return q[:, 0::2] | (q[:, 1::2] << 4), s


def is_quantized(w) -> bool:
    return isinstance(w, QWeight)


def dequant_linear(x: torch.Tensor, w: QWeight, b: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ b) through de-quantized row chunks (bounded temporary): larger batches and prefill."""
    # whole 128-row multiples: a chunk of odd rows makes F.linear's output rows misaligned, and cuBLAS then
    # takes kernels several times slower than the aligned GEMM's
    rows = max(CHUNK_ROW_ALIGN, DEQUANT_CHUNK_VALUES // max(1, w.k) // CHUNK_ROW_ALIGN * CHUNK_ROW_ALIGN)
    if rows >= w.n:
        return F.linear(x, dequantize_on_device(w, x.dtype, 0, w.n), b)
    outs = [F.linear(x, dequantize_on_device(w, x.dtype, r, min(r + rows, w.n)), None if b is None else b[r:r + rows])
            for r in range(0, w.n, rows)]
    return torch.cat(outs, dim=-1)


def dequantize_on_device(w: QWeight, dtype, r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """Rows r0:r1 of w in dtype: one Triton kernel on CUDA (qgemv.dequantize_rows, equal bit for bit), else
    QWeight.dequantize."""
    r1 = w.n if r1 is None else r1
    if w.device.type == "cuda":
        from hybrid.gpu_kernels.qgemv import dequantize_rows

        return dequantize_rows(w, r0, r1, dtype)
    return w.dequantize(dtype, slice(r0, r1))


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight tensor or a QWeight: a QWeight's decode rows (T <= the GEMV's rows) read the quantized
    bytes in one kernel on the GPU; anything else goes through de-quantized row chunks (DESIGN.md, GPU weights:
    why prefill does not run FP8 weights on e4m3 tensor cores)."""
    if not isinstance(w, QWeight):
        return F.linear(x, w, b)
    if x.is_cuda:
        from hybrid.gpu_kernels.qgemv import qlinear_small, qlinear_small_supported

        x2 = x.reshape(-1, x.shape[-1])
        if qlinear_small_supported(x2, w, b):
            return qlinear_small(x2, w, b, checked=True).view(*x.shape[:-1], w.n)
    return dequant_linear(x, w, b)


def embedding(ids: torch.Tensor, w, dtype: torch.dtype) -> torch.Tensor:
    """F.embedding for a weight tensor or a QWeight (rows de-quantized in the activation dtype `dtype`)."""
    if isinstance(w, QWeight):
        return w.rows(ids, dtype)
    return F.embedding(ids, w)


def quantize_module_weight_(module: nn.Module, name: str, kind: str, device, group: int = GROUP) -> QWeight:
    """Replaces module.<name> (a Parameter [N, K], meta or real) by an empty QWeight of that shape on `device`;
    returns it for the loader (or init_random_) to fill."""
    p = module._parameters.pop(name)
    qw = QWeight(kind, p.shape[0], p.shape[1], device=device, group=group)
    module.add_module(name, qw)
    return qw
