"""Decode graphs keyed by context bucket (hybrid.runtime.cuda_graphs): which graph a step replays. The graphs
themselves need CUDA (tests/test_generate_gpu.py); the bucket choice and a step's staged inputs are checked here."""

import types

import pytest
import torch

from hybrid.runtime.cuda_graphs import DecodeGraphs, StepInputs, context_buckets


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


def test_step_inputs_fill_the_rows_and_pad_the_rest():
    st = StepInputs(4)
    dst = torch.full((3, 4), 99, dtype=torch.long)
    st.write(dst, [7, 8], [5, 300], [1, 3])
    assert dst.tolist() == [[7, 8, 0, 0], [5, 300, -1, -1], [1, 3, 0, 0]]
    st.write(dst, [4, 5, 6, 9], [0, 1, 2, 3], [0, 1, 2, 3])  # a full bucket: no padding left over
    assert dst.tolist() == [[4, 5, 6, 9], [0, 1, 2, 3], [0, 1, 2, 3]]
    st.write(dst, [2], [11], [2])  # fewer rows again: the old rows are padding now
    assert dst.tolist() == [[2, 0, 0, 0], [11, -1, -1, -1], [2, 0, 0, 0]]
    with pytest.raises(ValueError):
        st.write(dst, [1, 2, 3, 4, 5], [0] * 5, [0] * 5)
    with pytest.raises(ValueError):
        st.write(dst, [1, 2], [0], [0, 1])


def test_static_inputs_are_views_of_one_tensor():
    g = fake_graphs(8, 1024)
    s = g._static(4)
    s["inputs"][0] = torch.arange(4)
    s["inputs"][2] = torch.arange(4) + 10
    assert s["ids"].shape == (4, 1) and s["ids"][:, 0].tolist() == [0, 1, 2, 3]
    assert s["pos"].shape == (4, 1) and s["pos"][:, 0].tolist() == [-1] * 4
    assert s["slots"].tolist() == [10, 11, 12, 13]
