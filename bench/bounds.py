"""Bounds the end-to-end bench compares against, defined so that no split of the experts can beat them.

Prefill, one MoE layer. Each cold expert e with m_e tokens runs either on the CPU (the CPU kernel's time
c_e = cpu(m_e)) or is shipped (its weights over the link, tau = W_e / B_L, then its GPU compute g_e); the
resident experts' GPU compute G_0 runs in any case. The CPU, the link and the GPU are three resources,
so for a split S (shipped set) the layer takes at least

    max( sum_{e not in S} c_e,  |S| tau,  G_0 + sum_{e in S} g_e ).

The bound is the minimum of that over every fractional split (an LP relaxation, so <= the best integral
split) with one more relaxation: the shipped experts' GPU compute is dropped (in prefill it is small beside
their transfer time; dropping a constraint can only lower the minimum). What is left has a closed form:
ship the CPU-costliest experts first; the bound is max(G_0, T*) with T* the point where the CPU work left
equals the link time, sum_{e not shipped} c_e = k tau (k fractional). Every term is priced at the rates
of the profile (no per-transfer alpha, no row copies, no fixed costs, perfect overlap), and the prompt's
attention and other non-MoE work add nothing, so the whole prefill cannot run faster than the sum over
layers (each layer needs the one before it) by definition, whatever the strategy.

Decode, one step: every distinct cold expert the step routes to is read once from DRAM and every distinct
resident one once from HBM, the CPU and GPU parts of a layer overlapping (max), plus the non-expert weights
from HBM; counted per step from the routing the step used, at the bandwidths measured in the same run.
"""

from __future__ import annotations

import numpy as np


def split_lower_bound(cpu_t: np.ndarray, tau: float, gpu_resident: float) -> float:
    """Seconds no split of one layer can beat: max(G_0, T*), T* = min over fractional k of
    max(CPU work left after shipping the k CPU-costliest experts, k tau). cpu_t: CPU time of each cold
    expert with tokens."""
    c = np.sort(np.asarray(cpu_t, dtype=np.float64)[np.asarray(cpu_t) > 0])[::-1]
    left = c.sum()  # CPU work with nothing shipped
    t_star = 0.0
    for j, cj in enumerate(c):  # on [j, j+1]: left_j - (k - j) c_j = k tau
        k = (left + j * cj) / (tau + cj)
        if k <= j + 1:
            t_star = k * tau
            break
        left -= cj
    else:
        t_star = len(c) * tau if len(c) else 0.0
    return max(float(gpu_resident), float(t_star))


def integral_split_time(cpu_t, ship, tau: float, gpu_t, gpu_resident: float) -> float:
    """The three-resource time of one integral split (ship: bool per expert): what the bound relaxes."""
    cpu_t, ship, gpu_t = np.asarray(cpu_t, float), np.asarray(ship, bool), np.asarray(gpu_t, float)
    return max(float(cpu_t[~ship].sum()), float(ship.sum()) * tau, gpu_resident + float(gpu_t[ship].sum()))


def distinct_per_step(step_counts: list[np.ndarray], resident: np.ndarray) -> tuple[float, float]:
    """(cold, resident) distinct experts per step, averaged: step_counts [steps] of [E] tokens per expert
    in that step (exact, from the routing), resident bool [E]."""
    if not step_counts:
        return 0.0, 0.0
    touched = np.stack([np.asarray(c) > 0 for c in step_counts])  # [steps, E]
    return float((touched & ~resident).sum(1).mean()), float((touched & resident).sum(1).mean())


def _repeats(step_counts: list[np.ndarray], resident: np.ndarray) -> list[tuple[float, float]]:
    """(cold experts read, of them read by the step before too) for steps 2..n of one layer."""
    touched = [(np.asarray(c) > 0) & ~resident for c in step_counts]
    return [(float(now.sum()), float((now & before).sum())) for before, now in zip(touched, touched[1:])]


def reused_per_step(step_counts: list[np.ndarray], resident: np.ndarray) -> float:
    """Cold experts a step reads that the step before it read too (same layer), averaged over steps 2..n."""
    reps = _repeats(step_counts, resident)
    return float(np.mean([r for _, r in reps])) if reps else 0.0


def reused_share(step_counts: list[np.ndarray], resident: np.ndarray) -> float:
    """Share of the cold experts a step reads that the step before it read too (same layer), averaged over
    steps 2..n: 0 when every step reads new experts. A read that repeats one a step ago may come from the
    CPU's last-level cache rather than DRAM (random-weight models can repeat their routing from token to
    token far more than trained ones), which is what llc_adjusted() bounds."""
    shares = [r / n for n, r in _repeats(step_counts, resident) if n]
    return float(np.mean(shares)) if shares else 0.0


TOKEN_BINS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, None))  # tokens per expert, as the CPU kernels' paths split them


def tokens_per_cold_expert(layers: list[tuple[list[np.ndarray], np.ndarray]]) -> dict[str, float]:
    """How the cold experts a decode step reads split by the tokens routed to each, over every layer and step:
    {"1": share, "2": ..., "3-4": ..., "5-8": ..., "9+": ...} of (expert, step) reads. The CPU kernels' rate
    per weight byte falls with tokens per expert (more products per byte: from a few tokens per expert a
    kernel computes below the DRAM ceiling, the compact dtypes first), so this says how much of a step's lane
    can be bound by the kernels' instructions rather than by DRAM. layers: (step_counts, resident)."""
    counts = [np.asarray(c)[~resident] for steps, resident in layers for c in steps]
    tok = np.concatenate(counts) if counts else np.zeros(0)
    tok = tok[tok > 0]
    out = {}
    for lo, hi in TOKEN_BINS:
        sel = (tok >= lo) & (tok <= hi) if hi is not None else tok >= lo
        name = str(lo) if hi == lo else (f"{lo}-{hi}" if hi is not None else f"{lo}+")
        out[name] = float(sel.sum() / tok.size) if tok.size else 0.0
    return out


def llc_adjusted(layers: list[tuple[float, float]], reused: list[float], cold_bytes: float,
                 llc_bytes: float) -> list[tuple[float, float]]:
    """The (cold, resident) distinct experts per layer and step with the reads the last-level cache could
    serve taken out: of each step's cold experts that the step before also read (reused, per layer), at most
    llc_bytes in all, taken from every layer in the same proportion. decode_step_bound over the result is the
    bound of a run whose repeated reads hit the LLC for free (as long as they fit), so no run can beat it even
    where the DRAM-only bound is beaten: it is the honest bound when the routing repeats (a small model's step
    in a compact dtype can read less than a server CPU's L3 holds)."""
    total = sum(reused) * cold_bytes
    served = min(1.0, llc_bytes / total) if total > 0 else 0.0
    return [(c - r * served, res) for (c, res), r in zip(layers, reused)]


def decode_step_bound(layers: list[tuple[float, float]], cold_bytes: float, resident_bytes: float,
                      dense_bytes: float, dram_bw: float, hbm_bw: float) -> float:
    """Seconds per decode step: per layer max(cold distinct x bytes / B_D, resident distinct x bytes / B_H),
    summed, plus the non-expert weights from HBM. layers: (cold, resident) distinct experts per step."""
    moe = sum(max(c * cold_bytes / dram_bw, r * resident_bytes / hbm_bw) for c, r in layers)
    return moe + dense_bytes / hbm_bw
