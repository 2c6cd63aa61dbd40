"""L2 warming in decode (hybrid.gpu_kernels.prefetch, hybrid.gpu_kernels.l2_warm, MoETransformer.warm_plan): the
touch kernel reads every word of what it is given and writes nothing else, the plan names the next layer's
weights only where a layer waits for its CPU lane, within the budget, and the MoE block runs its hook once, after
routing. Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

from hybrid.gpu_kernels.l2_warm import ENV, within_budget, warm_policy
from hybrid.models import build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.models.transformer import plan_warm
from hybrid.runtime.kv_cache import StaticKVCache

DEVICES = ([pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA (GPU box)")])]
           + (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []))


def touch_module():
    pytest.importorskip("triton", reason="Triton is a test dependency (pyproject [test]); install it")
    from hybrid.gpu_kernels import prefetch

    return prefetch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 7, 4096, 4097, 3 * 4096 + 5])
def test_touch_reads_every_word_and_writes_nothing_else(device, n):
    """The kernel's xor over each 4096-word block is stored only when it equals the magic value: a block built to
    hit it (its last word completing the xor, wherever the block ends) shows that every word was read."""
    prefetch = touch_module()
    g = torch.Generator().manual_seed(n)
    w = torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=g)
    last = min(n, prefetch.BLOCK) - 1  # the first block's last word
    w[last] = 0
    acc = 0
    for v in w[: last + 1].tolist():
        acc ^= v
    w[last] = 0x5A5A5A5A ^ acc
    w = w.to(device)
    before = w.clone()
    sink = prefetch._sink(w.device)
    sink.zero_()
    assert prefetch.l2_touch(w)
    assert torch.equal(w, before)
    assert int(sink.item()) == 0x5A5A5A5A  # the first block summed to the magic value: all of it was read
    w[0] += 1  # now no block hits it: nothing is written
    sink.zero_()
    assert prefetch.l2_touch(w)
    assert int(sink.item()) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_touch_takes_any_dtype_and_declines_what_it_cannot_read(device):
    prefetch = touch_module()
    for dtype, shape in ((torch.bfloat16, (5, 6)), (torch.float32, (3, 7)), (torch.uint8, (12,))):
        t = torch.ones(shape, dtype=dtype, device=device)
        assert prefetch.l2_touch(t, "evict_last")
        assert torch.equal(t, torch.ones_like(t))
    assert not prefetch.l2_touch(torch.ones(3, dtype=torch.bfloat16, device=device))  # 6 bytes: not whole words
    assert not prefetch.l2_touch(torch.ones(8, 8, device=device).t())  # not contiguous
    assert not prefetch.l2_touch(torch.ones(0, device=device))


def test_within_budget_is_the_longest_fitting_prefix():
    ts = [torch.empty(n, dtype=torch.uint8) for n in (10, 20, 5)]
    assert within_budget(ts, 35) == ts
    assert within_budget(ts, 34) == ts[:2]  # the third would go past: stop there, even if a later one fits
    assert within_budget(ts, 29) == ts[:1]
    assert within_budget(ts, 9) == []


def test_warm_policy_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert warm_policy() == ""
    for v, want in (("0", None), ("off", None), ("1", ""), ("last", "evict_last")):
        monkeypatch.setenv(ENV, v)
        assert warm_policy() == want
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match=ENV):
        warm_policy()


def tiny_model(layers=4, dense_layers=()):
    raw = hf_config("demo", layers=layers)
    raw["mlp_only_layers"] = list(dense_layers)
    cfg = family_for(raw).parse_config(raw)
    return init_random_(build_empty(cfg, torch.device("cpu"), torch.float32), seed=0)


class Waiting(torch.nn.Module):
    """Stands in for HybridExperts where only waits_for_cpu matters."""

    def __init__(self, waits: bool):
        super().__init__()
        self.waits_for_cpu = waits


def test_plan_names_the_next_layers_weights_where_a_layer_waits_for_the_cpu():
    model = tiny_model(layers=4, dense_layers=(2,))
    for i, waits in enumerate((True, False, None, True)):  # layer 2 is dense
        if waits is not None:
            model.layers[i].moe.experts = Waiting(waits)
    nxt = model.layers[1]
    a = nxt.attn
    want = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, nxt.moe.router]
    plan = plan_warm(model.layers, 1 << 40)
    assert [t.data_ptr() for t in plan[0]] == [t.data_ptr() for t in want]
    assert plan[1] == [] and plan[2] == []  # does not wait; dense
    assert plan[3] == []  # the last layer: nothing after it
    budget = sum(t.numel() * t.element_size() for t in want[:3])
    assert [t.data_ptr() for t in plan_warm(model.layers, budget)[0]] == [t.data_ptr() for t in want[:3]]
    assert plan_warm(model.layers, 0)[0] == []


def test_plan_before_a_dense_layer_has_no_router():
    model = tiny_model(layers=2, dense_layers=(1,))
    model.layers[0].moe.experts = Waiting(True)
    plan = plan_warm(model.layers, 1 << 40)
    assert len(plan[0]) == 4  # q, k, v, o_proj: the dense layer has no router


def test_nothing_is_warmed_on_the_cpu_and_the_forward_is_unchanged(monkeypatch):
    model = tiny_model(layers=2)
    h = torch.zeros(1, 1, model.cfg.hidden_size)
    assert model.warm_plan(h, fresh=False) == ([[], []], "")
    ids, pos, slots = torch.tensor([[5, 17]]), torch.arange(2)[None], torch.tensor([0])
    want = model(ids, pos, slots, StaticKVCache.for_model(model, 1, 8)).clone()
    monkeypatch.setenv(ENV, "0")
    got = model(ids, pos, slots, StaticKVCache.for_model(model, 1, 8))
    assert torch.equal(got, want)


def test_moe_block_runs_its_hook_once_after_routing():
    model = tiny_model(layers=1)
    moe = model.layers[0].moe
    seen = []
    real_route = moe.route
    moe.route = lambda x: (seen.append("route"), real_route(x))[1]
    x = torch.randn(3, model.cfg.hidden_size)
    out = moe(x, after_route=lambda: seen.append("hook"))
    assert seen == ["route", "hook"]
    torch.testing.assert_close(out, moe(x))
