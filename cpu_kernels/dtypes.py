"""The CPU executor's weight dtypes, in one table: name, the C++ executor's id, bytes per weight, group sizes
and the ISAs whose kernels run it. Everything else (the CLI's choices, the planner's memory model, the
cost model's bytes per weight, the benches) reads it from here.

Plain data, no imports: the placement floor reads it without loading torch or the compiled kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_ISAS = ("amx", "avx512_bf16", "avx2", "ref")  # cpu_kernels._native.ISAS
VECTOR_ISAS = ("avx512_bf16", "avx2", "ref")


@dataclass(frozen=True)
class CpuDtype:
    name: str
    code: int  # the executor's dtype id (cpu_kernels/csrc: MoE.dtype)
    # packed bytes per weight, scales aside except where the format fixes them per block (mxfp4's exponent
    # byte per 32 values)
    value_bytes: float
    scale_bytes: int = 0  # bytes of one scale: int8 has an fp32 one per row, int4 an fp32 one per group, q8_0 and q4_0
    # an fp16 one per 32-value block
    scale_per_row: bool = False
    group_sizes: tuple[int, ...] = ()  # values per scale (int4, q8_0, q4_0) or per shared exponent (mxfp4)
    default_group: int | None = None
    isas: tuple[str, ...] = ALL_ISAS  # ISAs with kernels for it ("amx": the AMX tiles)
    amx_min_group: int = 0  # int4 groups below this run the vector kernels even where AMX is chosen

    def bytes_per_weight(self, k: int | None = None, group: int | None = None) -> float:
        """Packed bytes per weight with the scales: k is the row length (int8's per-row scale), group int4's
        group size (default: its default)."""
        if self.scale_bytes == 0:
            return float(self.value_bytes)
        per = k if self.scale_per_row else (group or self.default_group)
        return self.value_bytes + self.scale_bytes / per


CPU_DTYPES = {d.name: d for d in (
    CpuDtype("bf16", 0, 2),
    CpuDtype("int8", 1, 1, scale_bytes=4, scale_per_row=True),
    CpuDtype("int4", 2, 0.5, scale_bytes=4, group_sizes=(32, 64, 128), default_group=128, amx_min_group=64),
    CpuDtype("mxfp4", 3, 0.53125, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # int8 in blocks of 32 with an fp16 scale each: llama.cpp's Q8_0 values (8.5 bits a weight), so a GGUF file's
    # Q8_0 experts are held exactly; finer scales than int8's per row for any other checkpoint
    CpuDtype("q8_0", 4, 1, scale_bytes=2, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's Q4_0: 4-bit values in blocks of 32 with an fp16 scale each (4.5 bits a weight), the file's 16 bytes of
    # nibbles per block as they are, so a GGUF file's Q4_0 experts are held exactly at its size (int4 in groups of 32
    # holds them too, at 5 bits a weight with fp32 scales)
    CpuDtype("q4_0", 11, 0.5, scale_bytes=2, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's Q2_K: 2-bit values with a 4-bit scale and minimum per 16 and an fp16 d, dmin per 256 (2.625 bits a
    # weight, the 20-byte head of each 256 values counted in value_bytes), so a GGUF file's Q2_K experts (the low-bit
    # mixes that fit DeepSeek-V3 in 256 GB of DRAM) are held exactly
    CpuDtype("q2_k", 8, 0.328125, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's Q3_K: 3-bit values with a signed 6-bit scale per 16 and an fp16 d per 256 (3.4375 bits a weight, the
    # 14-byte head of each 256 values counted in value_bytes), so a GGUF file's Q3_K experts (the downs of Q2_K mixes,
    # the Q3_K_S/M files' gates and ups) are held exactly
    CpuDtype("q3_k", 9, 0.4296875, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's Q4_K: 4-bit values with a 6-bit scale and minimum per 32 and an fp16 pair per 256 (4.5 bits a
    # weight, the 16-byte head of each 256 values counted in value_bytes as mxfp4's exponents are), so a GGUF file's
    # Q4_K experts are held exactly
    CpuDtype("q4_k", 5, 0.5625, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's Q5_K: Q4_K with a fifth bit per value (5.5 bits a weight, the 48-byte head of each 256 values with
    # its fifth bits counted in value_bytes), so a GGUF file's Q5_K experts are held exactly
    CpuDtype("q5_k", 7, 0.6875, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's Q6_K: 6-bit values with an int8 scale per 16 and an fp16 d per 256 (6.5625 bits a weight, the
    # 18-byte head of each 256 values counted in value_bytes), so a GGUF file's Q6_K experts (Q4_K_M's and Q5_K_M's
    # downs among them) are held exactly
    CpuDtype("q6_k", 6, 0.8203125, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's IQ4_XS: 4-bit indices into a 16-value non-uniform codebook with a 6-bit scale per 32 and an fp16 d
    # per 256 (4.25 bits a weight, the 8-byte head of each 256 values counted in value_bytes), so a GGUF file's
    # IQ4_XS experts are held exactly
    CpuDtype("iq4_xs", 10, 0.53125, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's IQ2_XXS: per 8 values an index into a 256-entry codebook of magnitudes and 7 sign bits (the 8th
    # makes the count of negatives even), a 4-bit scale per 32 and an fp16 d per 256 (2.0625 bits a weight, the
    # 2-byte head of each 256 values counted in value_bytes), so a GGUF file's IQ2_XXS experts (unsloth's UD-IQ1/IQ2
    # DeepSeek and Kimi files) are held exactly; from floats, quant.quantize_iq2_xxs rounds to the nearest codebook
    # entry (not llama.cpp's importance-weighted search)
    CpuDtype("iq2_xxs", 12, 0.2578125, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's IQ3_XXS: per 4 values an index into a 256-entry codebook of magnitudes, per 8 IQ2_XXS's 7 sign bits,
    # a 4-bit scale per 32 and an fp16 d per 256 (3.0625 bits a weight, the 2-byte head of each 256 values counted in
    # value_bytes), so a GGUF file's IQ3_XXS experts (llama-quantize's IQ3_XXS type, and the 3-bit layers of mixed
    # IQ quantizations) are held exactly; the file's blocks only
    CpuDtype("iq3_xxs", 15, 0.3828125, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's IQ3_S: per 4 values a 9-bit index into a 512-entry codebook of odd magnitudes, a sign bit per value, a
    # 4-bit scale per 32 and an fp16 d per 256 (3.4375 bits a weight, the 2-byte head of each 256 values counted in
    # value_bytes), so a GGUF file's IQ3_S experts (llama-quantize's IQ3_S and IQ3_M types) are held exactly; the
    # file's blocks only
    CpuDtype("iq3_s", 16, 0.4296875, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's IQ1_S: per 8 values an 11-bit index into a 2048-entry codebook of 8 values in {-1, 0, 1}, per 32 a
    # 3-bit scale and the sign of a +-1/8 shift of the values, an fp16 d per 256 (1.5625 bits a weight, the 2-byte head
    # of each 256 values counted in value_bytes), so a GGUF file's IQ1_S experts (the gates and ups of unsloth's
    # UD-IQ1_S DeepSeek and Kimi files) are held exactly; the file's blocks only
    CpuDtype("iq1_s", 13, 0.1953125, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
    # llama.cpp's IQ1_M: IQ1_S's codebook indices with the delta sign per 8 values and a 3-bit scale per 16, the fp16 d
    # per 256 spread over the scales' top nibbles (1.75 bits a weight, the 8-byte head of each 256 values counted in
    # value_bytes), so a GGUF file's IQ1_M experts are held exactly; the file's blocks only
    CpuDtype("iq1_m", 14, 0.21875, group_sizes=(32,), default_group=32, isas=VECTOR_ISAS),
)}
# The dtypes a layer's down may have beside another (not bf16) dtype of its gate and up (cpu_kernels.CpuMoE
# down_dtype): every quantized dtype reads int8 activation rows with block sums, so each matrix's kernels take the
# rows made for that matrix; int4 stays the gate's and up's (one group size and stored order per layer).
DOWN_DTYPES = ("int8", "mxfp4", "q8_0", "q4_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "iq2_xxs", "iq3_xxs",
               "iq3_s", "iq1_s", "iq1_m")
NAMES = tuple(CPU_DTYPES)  # ("bf16", ..., "q8_0", "q4_0", "q2_k", ..., "iq4_xs", "iq2_xxs", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"): the CLI's --cpu-dtype choices
# The dtypes that hold a GGUF file's blocks only: their values come from llama.cpp's importance-weighted search over a
# codebook, which the executor does not do, so float weights are refused in them (cpu_kernels.CpuMoE).
FILE_ONLY_DTYPES = ("iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
AMX_DTYPES = tuple(n for n, d in CPU_DTYPES.items() if "amx" in d.isas)  # the dtypes with an AMX path


def computing_isa(dtype: str, group: int | None, isa: str) -> str:
    """The ISA whose kernels compute `dtype` experts (int4 at `group`, None: its default) on an executor running
    `isa`: AMX's vector companion where the AMX tiles have no path for the dtype (cpu_kernels.CpuMoE says so at
    load), else `isa` itself."""
    spec = CPU_DTYPES[dtype]
    if isa in ("amx", "amx_emu") and ("amx" not in spec.isas or (group or spec.default_group or 0) < spec.amx_min_group):
        return "avx512_bf16"
    return isa
VALUE_BYTES = {n: d.value_bytes for n, d in CPU_DTYPES.items()}  # bytes per weight, scales aside
