"""Loading of the compiled ISA libraries (ctypes over a C ABI) and the choice of ISA.

The ISA is chosen once per process: HYBRID_CPU_ISA if set (amx, avx512_bf16, avx2, ref), else the best
that both the CPU/OS (cpuid + xgetbv, probed by a baseline-compiled library) and the build provide.
A forced ISA this machine cannot run raises IsaUnavailable instead of dying of SIGILL.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os

from .knobs import knobs

log = logging.getLogger("cpu_kernels")

ISAS = ("amx", "avx512_bf16", "avx2", "ref")
_LIB = {"amx": "amx", "avx512_bf16": "avx512", "avx2": "avx2", "amx_emu": "amxemu"}
# "amx_emu": the AMX code path with scalar-emulated tiles over AVX2 kernels. Never chosen automatically
# and not listed by available_isas(); tests request it to cover the AMX driver logic on any AVX2 host.
HIDDEN_ISAS = ("amx_emu",)
_HERE = os.path.dirname(os.path.abspath(__file__))

# Bits returned by hy_cpu_features (cpu_kernels/csrc/probe.cpp).
F = dict(avx2=1 << 0, fma=1 << 1, avx512f=1 << 2, avx512bw=1 << 3, avx512vl=1 << 4, avx512dq=1 << 5,
         avx512vnni=1 << 6, avx512bf16=1 << 7, amx_tile=1 << 8, amx_bf16=1 << 9, amx_int8=1 << 10,
         os_avx=1 << 11, os_avx512=1 << 12, os_amx=1 << 13, f16c=1 << 14)
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c", "os_avx"),  # F16C: every AVX2 CPU has it (Intel and AMD alike)
    "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx512bf16", "os_avx512"),
}
_NEEDS["amx"] = _NEEDS["avx512_bf16"] + ("amx_tile", "amx_bf16", "amx_int8", "os_amx")
_NEEDS["amx_emu"] = _NEEDS["avx2"]


class IsaUnavailable(RuntimeError):
    """A requested ISA cannot run on this machine or was not built."""


class HyMat(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("rsum", ctypes.c_void_p),
                ("bias", ctypes.c_void_p),
                ("w_estride", ctypes.c_int64), ("s_estride", ctypes.c_int64), ("r_estride", ctypes.c_int64),
                ("b_estride", ctypes.c_int64),
                ("rows", ctypes.c_int32), ("rows_p", ctypes.c_int32), ("k", ctypes.c_int32),
                ("ldk", ctypes.c_int32), ("group", ctypes.c_int32), ("dtype", ctypes.c_int32),
                ("fold", ctypes.c_int32)]


class HyNode(ctypes.Structure):
    _fields_ = [("pool", ctypes.c_void_p), ("gate", HyMat), ("up", HyMat), ("down", HyMat)]


class HyLayer(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("act", ctypes.c_int32), ("n_local", ctypes.c_int32),
                ("D", ctypes.c_int32), ("n_nodes", ctypes.c_int32), ("knee", ctypes.c_int32),
                ("alpha", ctypes.c_float), ("limit", ctypes.c_float), ("nodes", HyNode * 8)]


class HyJob(ctypes.Structure):
    """One layer call for a stream-ordered host function (api.h, hy_host_job)."""

    _fields_ = [("L", ctypes.c_void_p), ("x", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("wts", ctypes.c_void_p),
                ("lmap", ctypes.c_void_p), ("out", ctypes.c_void_p), ("x_dtype", ctypes.c_int32),
                ("T", ctypes.c_int32), ("K", ctypes.c_int32), ("n_global", ctypes.c_int32),
                ("out_dtype", ctypes.c_int32), ("pin_cpu", ctypes.c_int32), ("rc", ctypes.c_int32),
                ("ids64", ctypes.c_int32), ("runs", ctypes.c_int64), ("failures", ctypes.c_int64),
                ("busy_ns", ctypes.c_int64)]


class HyPackSrc(ctypes.Structure):
    """n experts of one matrix kind as a checkpoint holds them, for hy_pack_mat (csrc/pack.h)."""

    _fields_ = [("w", ctypes.POINTER(ctypes.c_void_p)), ("s", ctypes.POINTER(ctypes.c_void_p)),
                ("rs", ctypes.c_int64), ("cs", ctypes.c_int64), ("srs", ctypes.c_int64), ("scs", ctypes.c_int64),
                ("wdtype", ctypes.c_int32), ("sdtype", ctypes.c_int32), ("r0", ctypes.c_int32), ("c0", ctypes.c_int32),
                ("b0", ctypes.c_int32), ("b1", ctypes.c_int32), ("rows", ctypes.c_int32), ("k", ctypes.c_int32)]


PACK_SRC_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")  # HY_SRC_* codes: the index
PACK_SRC_Q4_0 = 4  # HY_SRC_Q4_0: GGUF Q4_0 blocks, packed as q4_0 (or int4 in groups of 32) as they are
PACK_SRC_Q8_0 = 5  # HY_SRC_Q8_0: GGUF Q8_0 blocks, packed as q8_0 as they are
PACK_SRC_Q4_K = 6  # HY_SRC_Q4_K: GGUF Q4_K super-blocks, packed as q4_k as they are
PACK_SRC_Q6_K = 7  # HY_SRC_Q6_K: GGUF Q6_K super-blocks, packed as q6_k as they are
PACK_SRC_Q5_K = 8  # HY_SRC_Q5_K: GGUF Q5_K super-blocks, packed as q5_k as they are
PACK_SRC_Q2_K = 9  # HY_SRC_Q2_K: GGUF Q2_K super-blocks, packed as q2_k as they are
PACK_SRC_Q3_K = 10  # HY_SRC_Q3_K: GGUF Q3_K super-blocks, packed as q3_k as they are
PACK_SRC_IQ4_XS = 11  # HY_SRC_IQ4_XS: GGUF IQ4_XS super-blocks, packed as iq4_xs (their nibbles re-paired)
PACK_SRC_IQ2_XXS = 12  # HY_SRC_IQ2_XXS: GGUF IQ2_XXS super-blocks, packed as iq2_xxs as they are
PACK_SRC_IQ1_S = 13  # HY_SRC_IQ1_S: GGUF IQ1_S super-blocks, packed as iq1_s as they are
PACK_SRC_IQ1_M = 14  # HY_SRC_IQ1_M: GGUF IQ1_M super-blocks, packed as iq1_m as they are
PACK_SRC_IQ3_XXS = 15  # HY_SRC_IQ3_XXS: GGUF IQ3_XXS super-blocks, packed as iq3_xxs as they are
PACK_SRC_IQ3_S = 16  # HY_SRC_IQ3_S: GGUF IQ3_S super-blocks, packed as iq3_s as they are
PACK_NONFINITE = -5  # hy_pack_mat's HY_ENONFINITE


def _lib_path(name: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(_HERE, f"_hy_{name}*.so")))
    return hits[0] if hits else None


@functools.lru_cache(maxsize=None)
def cpu_features() -> dict[str, bool]:
    path = _lib_path("probe")
    if path is None:
        return {k: False for k in F}
    bits = ctypes.CDLL(path).hy_cpu_features()
    return {k: bool(bits & v) for k, v in F.items()}


@functools.lru_cache(maxsize=None)
def _amx_permission() -> bool:
    lib = ctypes.CDLL(_lib_path("probe"))
    return lib.hy_request_amx() == 0


@functools.lru_cache(maxsize=None)
def why_unavailable(isa: str) -> str | None:
    """None if `isa` can run here, else the reason it cannot."""
    if isa not in ISAS + HIDDEN_ISAS:
        raise ValueError(f"unknown ISA {isa!r}; expected one of {ISAS}")
    if isa == "ref":
        return None
    if _lib_path("probe") is None:
        return "the compiled kernels are not built (pip install -e . builds them)"
    feats = cpu_features()
    missing = [f for f in _NEEDS[isa] if not feats[f]]
    if missing:
        return f"CPU/OS lacks {', '.join(missing)}"
    if _lib_path(_LIB[isa]) is None:
        return f"library _hy_{_LIB[isa]} was not built (compiler lacked the flags?)"
    if isa == "amx" and not _amx_permission():
        return "Linux refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


def available_isas() -> list[str]:
    """ISAs usable on this machine, best first; always ends with 'ref'."""
    return [isa for isa in ISAS if why_unavailable(isa) is None]


@functools.lru_cache(maxsize=None)
def default_isa() -> str:
    forced = knobs().cpu_isa
    if forced:
        if forced not in ISAS:
            raise IsaUnavailable(f"HYBRID_CPU_ISA={forced!r} is not one of {ISAS}")
        why = why_unavailable(forced)
        if why:
            raise IsaUnavailable(f"HYBRID_CPU_ISA={forced} cannot run here: {why}")
        log.info("cpu_kernels: ISA %s (forced by HYBRID_CPU_ISA)", forced)
        return forced
    isa = available_isas()[0]
    skipped = "; ".join(f"{i}: {why_unavailable(i)}" for i in ISAS[:ISAS.index(isa)])
    if isa == "ref" and any(not why_unavailable(i).startswith("CPU/OS lacks") for i in ISAS[:-1]):
        # a compiled ISA was expected (the CPU has it, the library is missing): ~30x slower, so say it loudly
        log.warning("cpu_kernels: falling back to the PyTorch reference, much slower than the compiled kernels "
                    "(%s); fix: rebuild them with `pip install -e .` (needs a C++ compiler)", skipped)
    else:
        log.info("cpu_kernels: ISA %s (best available%s)", isa, f"; skipped {skipped}" if skipped else "")
    return isa


def resolve_isa(isa: str | None) -> str:
    if isa is None:
        return default_isa()
    why = why_unavailable(isa)
    if why:
        raise IsaUnavailable(f"ISA {isa} cannot run here: {why}")
    return isa


@functools.lru_cache(maxsize=None)
def load(isa: str) -> ctypes.CDLL:
    """The ISA's library with its prototypes, loaded once (every CPU-lane call and host job goes through it)."""
    resolve_isa(isa)
    lib = ctypes.CDLL(_lib_path(_LIB[isa]))
    lib.hy_pool_get.restype = ctypes.c_void_p
    lib.hy_pool_get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.hy_pool_threads.argtypes = [ctypes.c_void_p]
    lib.hy_pool_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.hy_pool_copy.restype = None
    lib.hy_forward.argtypes = [ctypes.POINTER(HyLayer), ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_int]
    lib.hy_forward.restype = ctypes.c_int
    lib.hy_host_job.argtypes = [ctypes.c_void_p]
    lib.hy_host_job.restype = None
    lib.hy_isa.restype = ctypes.c_char_p
    lib.hy_profile_enable.argtypes = [ctypes.c_int]
    lib.hy_profile_enable.restype = None
    lib.hy_profile_read.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.c_int]
    lib.hy_profile_read.restype = None
    lib.hy_lane_create.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.hy_lane_create.restype = ctypes.c_void_p
    lib.hy_lane_add.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.hy_lane_add.restype = ctypes.c_int
    lib.hy_lane_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.hy_lane_set.restype = ctypes.c_int
    lib.hy_lane_served.argtypes = [ctypes.c_void_p]
    lib.hy_lane_served.restype = ctypes.c_int64
    lib.hy_lane_destroy.argtypes = [ctypes.c_void_p]
    lib.hy_lane_destroy.restype = None
    lib.hy_tune.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.hy_tune.restype = ctypes.c_int
    lib.hy_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.hy_stream_read.restype = ctypes.c_int64
    lib.hy_gated_act.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_float, ctypes.c_float]
    lib.hy_gated_act.restype = None
    lib.hy_quantize_act.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_void_p]
    lib.hy_quantize_act.restype = ctypes.c_int
    if hasattr(lib, "hy_pack_mat"):  # absent from a library built before it: has_packer says so
        lib.hy_pack_mat.argtypes = [ctypes.c_void_p, ctypes.POINTER(HyPackSrc), ctypes.POINTER(HyMat), ctypes.c_int,
                                    ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int32)]
        lib.hy_pack_mat.restype = ctypes.c_int
    for setter, kind, entries in _IQ_GRIDS:  # the IQ codebooks (csrc/hy.h IqGrids), from the gguf package's tables
        if hasattr(lib, setter):  # absent from a library built before its format
            from .quant import iq_grid_bytes

            fn = getattr(lib, setter)
            fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
            fn.restype = ctypes.c_int
            if fn(iq_grid_bytes(kind), entries) != 0:
                raise RuntimeError(f"cpu_kernels: the {isa} library refused the {kind} codebook")
    return lib


# each IQ codebook's setter (csrc/api.h), its table (quant.iq_grid_bytes) and its entries
_IQ_GRIDS = (("hy_set_grids", "iq2_xxs", 256), ("hy_set_iq1_grid", "iq1", 2048), ("hy_set_iq3_grid", "iq3_xxs", 256),
             ("hy_set_iq3s_grid", "iq3_s", 512))
# the entry point that sets each IQ format's codebook: a library without it was built before the format (iq1_m reads
# IQ1_S's codebook)
_IQ_GRID_SETTERS = {"iq2_xxs": "hy_set_grids", "iq1_s": "hy_set_iq1_grid", "iq1_m": "hy_set_iq1_grid",
                    "iq3_xxs": "hy_set_iq3_grid", "iq3_s": "hy_set_iq3s_grid"}


def has_iq_grids(isa: str, dtypes=("iq2_xxs",)) -> bool:
    """Whether `isa`'s library runs the IQ formats among `dtypes` (iq2_xxs, iq3_xxs, iq3_s, iq1_s, iq1_m): a library built before one has
    no codebook for it and refuses it."""
    return isa == "ref" or all(hasattr(load(isa), _IQ_GRID_SETTERS[d]) for d in dtypes if d in _IQ_GRID_SETTERS)


@functools.lru_cache(maxsize=None)
def has_packer(isa: str) -> bool:
    """Whether `isa`'s library packs checkpoint experts in compiled code (hy_pack_mat); False for ref and for a
    library built before the packer existed, which is said once, loudly: packing then runs on the PyTorch
    reference, several times slower."""
    if isa == "ref":
        return False
    if hasattr(load(isa), "hy_pack_mat"):
        return True
    log.warning("cpu_kernels: the %s library has no compiled packer (built before it): experts are packed by "
                "the PyTorch reference, several times slower; fix: rebuild with `pip install -e .`", isa)
    return False


def pool(isa: str, cpus) -> int:
    arr = (ctypes.c_int * len(cpus))(*cpus)
    return load(isa).hy_pool_get(arr, len(cpus))


# Decode-sized calls without AMX experts run gate/up and down in one barrier-free phase (csrc/fused.h):
# the profile counts that whole phase as "gate_up".
PHASES = ("route", "tokens", "pack_x", "gate_up", "quant_pack_h", "down", "reduce")
# The executor's run-time knobs (csrc/hy.h Knobs, csrc/api.h hy_tune). Each changes speed only, never a value:
#   fused       1 (default): decode-sized calls run one barrier-free phase; 0: the phased path prefill takes
#   task_rows   most weight rows of one decode task (64..512, a multiple of 64; default 256)
#   task_min    fewest decode tasks per thread the row blocks shrink to give (>= 1; default 2)
#   tail_split  parts each of a decode call's last down tasks (one per thread) is cut into (1..8; default 4)
#   pf_rows     rows ahead the AVX-512 int8/int4 kernels prefetch into L2 (8..64, a multiple of 4; default 16)
#   amx_kblock  AMX K block in 64-byte chunks (1..64; default 16)
#   stream_pf   bytes ahead the DRAM-read probe prefetches in software (0: none; whole 64-byte lines)
#   spin_us     how long idle pool workers spin before they sleep (default 50; the GPU runtime sets more)
TUNABLES = ("fused", "task_rows", "task_min", "tail_split", "pf_rows", "amx_kblock", "stream_pf", "spin_us")


def parse_knob(item: str, what: str = "knob") -> tuple[str, int]:
    """'pf_rows=16' -> ('pf_rows', 16): a TUNABLES name and an integer (benchmarks' knob overrides); ValueError
    naming `what` and the known knobs otherwise."""
    k, sep, v = item.partition("=")
    if not sep or k not in TUNABLES:
        raise ValueError(f"bad {what} {item!r}: knob=value with a knob of {', '.join(TUNABLES)}")
    try:
        return k, int(v)
    except ValueError:
        raise ValueError(f"bad {what} {item!r}: the value must be an integer") from None


def tune(isa: str, name: str, value: int) -> int:
    """Set one of `isa`'s run-time knobs (csrc/api.h, hy_tune); returns its previous value."""
    if name not in TUNABLES:
        raise ValueError(f"unknown knob {name!r} (known: {', '.join(TUNABLES)})")
    return int(load(isa).hy_tune(name.encode(), int(value)))


def profile_enable(isa: str, on: bool = True) -> None:
    """Start (or stop) accumulating per-phase wall times in `isa`'s library (benchmarks only)."""
    load(isa).hy_profile_enable(int(on))


def profile_read(isa: str, reset: bool = True) -> dict:
    """Mean seconds per call of each phase since the last reset, and the number of calls."""
    buf = (ctypes.c_double * 8)()
    load(isa).hy_profile_read(buf, int(reset))
    calls = int(buf[7])
    return dict({p: buf[i] / max(calls, 1) for i, p in enumerate(PHASES)}, calls=calls)
