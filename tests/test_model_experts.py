"""The default expert executor against a per-token reference over ragged routing (experts with 0, 1
and many tokens), in every mode, with the output buffer of the reference pre-filled with NaN."""

from __future__ import annotations

import pytest
import torch

from hybrid.models import StackedExperts


def reference(x, wg, wu, wd, ids, wts):
    out = torch.full_like(x, float("nan"))
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = torch.nn.functional.silu(wg[e].double() @ x[t].double()) * (wu[e].double() @ x[t].double())
            acc += float(wts[t, k]) * (wd[e].double() @ h)
        out[t] = acc.to(x.dtype)
    return out


@pytest.mark.parametrize("mode", ["auto", "dense"])  # "grouped" is what "auto" runs
def test_stacked_experts_ragged(mode):
    E, D, F = 8, 48, 24
    g = torch.Generator().manual_seed(0)
    wg, wu = torch.randn(E, F, D, generator=g) * 0.1, torch.randn(E, F, D, generator=g) * 0.1
    wd = torch.randn(E, D, F, generator=g) * 0.1
    ex = StackedExperts.from_weights(wg, wu, wd)
    ex.mode = mode
    # Expert 0: many tokens; 5: exactly one; 6, 7: none; top-3 without repeats inside a row.
    ids = torch.tensor([[0, 1, 2], [0, 2, 3], [0, 1, 4], [0, 3, 5], [0, 4, 2], [1, 0, 3], [0, 2, 1]])
    wts = torch.rand(ids.shape, generator=g)
    x = torch.randn(ids.shape[0], D, generator=g)
    out = ex(x, ids, wts)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.allclose(out, reference(x, wg, wu, wd, ids, wts), atol=1e-5)
    one = ex(x[:1], ids[:1], wts[:1])  # a single token
    assert torch.allclose(one, reference(x[:1], wg, wu, wd, ids[:1], wts[:1]), atol=1e-5)
