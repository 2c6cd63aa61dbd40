"""Captured decode's resident-expert merge on the CPU (issue 16: its keep mask was covered only by the GPU
test file). hybrid.offload.experts.add_resident_captured sorts a step's assignments by resident slot, has
the grouped GEMM compute only the resident rows, and must keep exactly those: the rows after them (cold
experts' assignments) are never computed, so here they hold NaN, as uninitialised GEMM output might.
"""

import pytest
import torch

from hybrid.offload.experts import add_resident_captured
from placement.measure import torch_expert

E, D, F = 8, 16, 12


def _experts(seed):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*s, generator=g) / 4 for s in ((F, D), (F, D), (D, F))) for _ in range(E)]


def _grouped(weights, resident, calls):
    """grouped(rows, offs): group j (rows offs[j-1]:offs[j]) through resident expert resident[j]; rows past
    offs[-1] are left NaN, as the real grouped GEMM leaves them uncomputed."""

    def run(rows, offs):
        calls.append(offs.tolist())
        y = torch.full_like(rows, float("nan"))
        start = 0
        for j, end in enumerate(offs.tolist()):
            if end > start:
                y[start:end] = torch_expert(rows[start:end], *weights[resident[j]])
            start = end
        return y

    return run


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("resident", [[5, 2, 7], [0], list(range(E))], ids=["three", "one", "all"])
def test_resident_merge_keeps_exactly_the_resident_rows(seed, resident):
    g = torch.Generator().manual_seed(100 + seed)
    T, K = 5, 3
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K] distinct per token
    w = torch.rand(T, K, generator=g)
    rank = torch.full((E,), len(resident), dtype=torch.long)
    rank[resident] = torch.arange(len(resident))
    weights = _experts(seed)
    calls = []
    out = torch.zeros(T, D)
    add_resident_captured(out, x, ids, w, rank, len(resident), _grouped(weights, resident, calls))

    expect = torch.zeros(T, D)
    n_res = 0
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e in resident:
                n_res += 1
                expect[t] += w[t, k] * torch_expert(x[t:t + 1], *weights[e])[0]
    assert calls and calls[0][-1] == n_res  # the GEMM was asked for the resident rows only
    assert torch.isfinite(out).all()  # no cold (uncomputed) row leaked in
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    if len(resident) < E:
        assert n_res < T * K  # the case really had cold rows to drop
