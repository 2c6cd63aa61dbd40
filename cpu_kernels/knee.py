"""The AMX knee: tokens per expert from which the AMX tile path beats the AVX-512 vector path.

It moves between machines, and between runs on one machine, so it is measured, not assumed:
`measure_amx_knee` times one CpuMoE call on both paths at a few token counts (`hybrid calibrate` stores the
result in the profile's machine["amx_knee"], bench.cpu_moe derives it from its own knee sweep), and
`set_default_knee` makes it the default of every CpuMoE built after.
"""

from __future__ import annotations

import time

import torch

KNEE_SWEEP = (4, 8, 16, 32)
_DEFAULT: dict[str, int] = {}  # dtype -> knee set from a measurement (cpu_kernels.moe falls back to AMX_KNEE)


def knee_from_times(ms, vector_s, amx_s) -> int:
    """The smallest measured m from which AMX is faster at that m and at every larger measured m (one
    noisy point below cannot pull the knee down); above the sweep if AMX never wins at its top."""
    ms, vec, amx = list(ms), list(vector_s), list(amx_s)
    knee = 2 * ms[-1]
    for i in range(len(ms) - 1, -1, -1):
        if amx[i] < vec[i]:
            knee = ms[i]
        else:
            break
    return knee


def set_default_knee(knees: dict | None) -> None:
    """Use these knees ({dtype: tokens}) for CpuMoE's amx_min_tokens default from now on (None: keep)."""
    for dtype, m in (knees or {}).items():
        if int(m) >= 1:
            _DEFAULT[str(dtype)] = int(m)


def default_knee(dtype: str, fallback: dict) -> int:
    return _DEFAULT.get(dtype, fallback.get(dtype, 16))


def _median_call(moe, x, routes, reps: int) -> float:
    moe.forward(x, *routes[0])  # warm-up
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        moe.forward(x, *routes[(i + 1) % len(routes)])
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_amx_knee(hidden: int, intermediate: int, dtype: str = "bf16", ms=KNEE_SWEEP, experts: int = 8,
                     pool: int = 32, threads=None, reps: int = 5) -> dict:
    """Time `experts` experts x m tokens on the vector path and on AMX (same CpuMoE, rotating over `pool`
    experts) -> {"knee": m, "ms": [...], "vector_s": [...], "amx_s": [...]}. Needs the amx ISA."""
    from cpu_kernels import CpuMoE

    g = torch.Generator().manual_seed(0)
    D, F = hidden, intermediate
    ws = [((torch.rand(pool, r, c, generator=g) - 0.5) * 0.05).bfloat16() for r, c in ((F, D), (F, D), (D, F))]
    moe = CpuMoE(*ws, dtype=dtype, isa="amx", threads=threads)
    vec, amx = [], []
    for m in ms:
        routes = []
        for it in range(max(1, pool // experts)):
            ids = (it * experts + torch.arange(experts).repeat_interleave(m)) % pool
            routes.append((ids[:, None].to(torch.int32).contiguous(), torch.ones(experts * m, 1)))
        x = torch.randn(experts * m, D).bfloat16()
        moe.set_amx_min_tokens(1 << 30)
        vec.append(_median_call(moe, x, routes, reps))
        moe.set_amx_min_tokens(1)
        amx.append(_median_call(moe, x, routes, reps))
    return {"knee": knee_from_times(ms, vec, amx), "ms": list(ms), "vector_s": vec, "amx_s": amx}
