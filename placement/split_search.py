"""The cost strategy's search, compiled: which k most CPU-expensive cold experts to ship.

The decision runs once per layer per batch on the thread that launches GPU work, so it has to stay
far below a layer's own time. In numpy it is a couple of dozen small array calls and in a Python loop
one step per active expert, both too slow for 128 experts; compiled with numba (the design's listed tool
for such loops) it is a few microseconds. Without numba the same function runs as plain Python, with a
warning, and gives the same answers.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("placement")

try:
    import numba

    _jit = numba.njit(cache=True, nogil=True)
    COMPILED = True
except ImportError:  # pragma: no cover - numba is a dependency; this keeps a broken install usable
    COMPILED = False
    log.warning("numba is not installed: the scheduler's split search runs as plain Python (~100 us per layer)")

    def _jit(fn):
        return fn


@_jit
def best_split(hist, cpu_t, ship_g, tau, cpu_fixed, row_time, rows, gpu_busy, head, ship):
    """hist [n] tokens per cold expert (all <= len(cpu_t) - 1); cpu_t / ship_g [max_m + 1] seconds per
    expert by tokens: CPU kernel, and GPU stage of a shipped expert; tau: one expert's transfer; cpu_fixed:
    the CPU lane's fixed cost (2 alpha + overhead); row_time: one row's activations there and back; rows:
    rows the CPU lane moves when it runs everything (< 0: the tokens of the histogram); gpu_busy: resident
    GPU work ahead of the shipped experts; head: the CPU lane's head start over the GPU lane (the part of
    the call's fixed cost it overlaps), so a split costs max(CPU lane - head, GPU lane). Sets ship [n]
    (bool) and returns (k, cpu lane, GPU lane); k = -1 if a count is past the tables (grow them, call again).

    Shipping the k experts with the largest CPU times (ties: lower index first) is best among all
    splits that ship k (the link costs each the same), so only k is searched. GPU lane: two-stage flow
    shop, transfer j then compute when the GPU is free. The first k with the smallest makespan wins."""
    n = hist.shape[0]
    n_act = 0
    for i in range(n):
        ship[i] = False
        if hist[i] >= cpu_t.shape[0]:
            return -1, 0.0, 0.0
        if hist[i] > 0:
            n_act += 1
    if n_act == 0:
        return 0, 0.0, gpu_busy
    idx = np.empty(n_act, dtype=np.int64)
    key = np.empty(n_act, dtype=np.float64)
    a = 0
    c_left = 0.0
    m_left = 0
    for i in range(n):
        if hist[i] > 0:
            idx[a] = i
            key[a] = -cpu_t[hist[i]]
            c_left += cpu_t[hist[i]]
            m_left += hist[i]
            a += 1
    order = np.argsort(key, kind="mergesort")  # stable: equal CPU times keep index order
    rt = row_time * (rows / m_left) if rows >= 0 else row_time
    best_k = 0
    best_cpu = cpu_fixed + m_left * rt + c_left
    best_gpu = gpu_busy
    best = max(best_cpu - head, best_gpu)
    t = gpu_busy
    link = 0.0
    for k in range(1, n_act + 1):
        e = idx[order[k - 1]]
        m = hist[e]
        c_left -= cpu_t[m]
        m_left -= m
        link += tau
        t = max(t, link) + ship_g[m]
        if t >= best:
            break  # the GPU lane only grows from here
        cpu = cpu_fixed + m_left * rt + c_left if m_left > 0 else 0.0
        span = max(cpu - head, t) if m_left > 0 else t
        if span < best:
            best_k, best_cpu, best_gpu, best = k, cpu, t, span
    for k in range(best_k):
        ship[idx[order[k]]] = True
    return best_k, best_cpu, best_gpu


@_jit
def lane_times(hist, ship, cpu_t, ship_g, tau, cpu_fixed, row_time, rows, gpu_busy):
    """(CPU lane, GPU lane) seconds of a given split, in the terms of best_split: the CPU lane moves `rows`
    rows (< 0: its experts' tokens) if any expert with tokens stays on it; shipped experts (with tokens)
    go in index order behind gpu_busy. Compiled for the same reason: the fixed strategies call it per layer.
    (-1, -1) if a count is past the tables."""
    c = 0.0
    m_cpu = 0
    on_cpu = False
    t = gpu_busy
    link = 0.0
    for i in range(hist.shape[0]):
        m = hist[i]
        if m <= 0:
            continue
        if m >= cpu_t.shape[0]:
            return -1.0, -1.0
        if ship[i]:
            link += tau
            t = max(t, link) + ship_g[m]
        else:
            on_cpu = True
            c += cpu_t[m]
            m_cpu += m
    if not on_cpu:
        return 0.0, t
    return cpu_fixed + (m_cpu if rows < 0 else rows) * row_time + c, t


@_jit
def table_sum(table, hist):
    """sum(table[hist]) without the temporary array; -1 if a count is past the table."""
    s = 0.0
    for i in range(hist.shape[0]):
        if hist[i] >= table.shape[0]:
            return -1.0
        s += table[hist[i]]
    return s
