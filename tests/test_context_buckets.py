"""Decode graphs keyed by context bucket (hybrid.runtime.cuda_graphs): which graph a step replays. The graphs
themselves need CUDA (tests/test_generate_gpu.py); the bucket choice is plain Python and checked here."""

import types

import pytest

from hybrid.runtime.cuda_graphs import DecodeGraphs, context_buckets


def test_context_buckets_double_from_256_and_end_at_max_context():
    assert context_buckets(4096) == (256, 512, 1024, 2048, 4096)
    assert context_buckets(600) == (256, 512, 600)
    assert context_buckets(200) == (200,)
    assert context_buckets(256) == (256,)
    assert context_buckets(4096, enabled=False) == (4096,)


def fake_graphs(max_batch, max_context, context=True):
    model = types.SimpleNamespace(device="cpu")
    cache = types.SimpleNamespace(max_batch=max_batch, max_context=max_context)
    return DecodeGraphs(model, cache, context=context)


def test_step_key_is_the_smallest_buckets_that_hold_the_rows():
    g = fake_graphs(8, 4096)
    assert g.buckets == (1, 2, 4, 8)
    assert g.key(1, [0]) == (1, 256)
    assert g.key(3, [10, 255, 3]) == (4, 256)  # position 255 is the 256th column: still fits
    assert g.key(3, [10, 256, 3]) == (4, 512)
    assert g.key(8, [4095]) == (8, 4096)
    with pytest.raises(ValueError):
        g.key(9, [0])
    assert fake_graphs(8, 4096, context=False).key(1, [0]) == (1, 4096)


def test_prepare_captures_each_graph_once_and_says_so(monkeypatch):
    g = fake_graphs(4, 1024)
    captured = []

    def ensure(key, sync=True):
        if key not in g.graphs:
            captured.append(key)
            g.graphs[key] = None

    monkeypatch.setattr(g, "ensure", ensure)
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)
    assert g.prepare(3, [5, 9, 2]) == ((4, 256), True)
    assert captured == [(4, 256), (2, 256), (1, 256)]  # the first step: every batch bucket, largest first
    assert g.prepare(1, [100]) == ((1, 256), False)
    assert g.prepare(2, [300, 7]) == ((2, 512), True) and captured[-1] == (2, 512) and len(captured) == 4
    assert g.prepare(2, [511, 7]) == ((2, 512), False)
