"""Online re-placement: the payback rule and the policy on hand-made count series (placement.replace),
then the mechanism on a real hybrid layer on the CPU (hybrid.offload.replace)."""

import numpy as np
import pytest
import torch

from placement.replace import ReplaceConfig, ReplacePolicy, SlidingWindow, payback_batches


def test_payback_arithmetic():
    assert payback_batches(1.0, 0.3) == 4  # floor(3.33) + 1
    assert payback_batches(1.0, 0.25) == 5  # exactly 4 batches only breaks even: the 5th pays
    assert payback_batches(0.0, 0.1) == 1
    assert payback_batches(12.5e-3, 1e-3) == 13
    assert payback_batches(1.0, 0.0) is None and payback_batches(1.0, -2.0) is None
    with pytest.raises(ValueError):
        payback_batches(-1.0, 1.0)


def policy(t_copy=10.0, window=8, slices=4):
    return ReplacePolicy(lambda m: np.asarray(m, dtype=float), t_copy, ReplaceConfig(window=window, slices=slices))


def feed(pol, series, resident):
    """Push histograms one by one; return (batch number, swap) of the first proposal."""
    w = SlidingWindow(len(resident), pol.cfg.window)
    for i, h in enumerate(series, 1):
        w.push(h)
        swaps = pol.decide(w, np.array(resident))
        if swaps:
            return i, swaps[0]
    return None, None


def test_steady_hot_cold_expert_is_brought_in():
    # saving(m) = m s: expert 1 saves 4 s per batch, resident expert 0 only 1: gain 3, N_min = 4.
    # Expert 1 wins every 2-batch slice, so its predicted persistence is the batches seen so far
    # rounded down to whole slices: 2 after batches 2 and 3 (< 4, wait), 4 after batch 4 (swap).
    n, s = feed(policy(), [[1, 4, 0]] * 8, [True, False, False])
    assert n == 4 and (s.add, s.evict, s.n_min, s.persistence) == (1, 0, 4, 4)
    assert s.dt == pytest.approx(3.0)


def test_routing_shift_waits_for_persistence():
    # 6 batches with expert 0 hot (5 tokens), then expert 1 (20 tokens) from batch 7, copy 10 s:
    #  batch 7: dt1 = 20/7 < dt0 = 30/7                     -> nothing saved
    #  batch 8: gain 40/8 - 30/8 = 1.25, N_min = 9; won 1 slice = 2 batches  -> wait
    #  batch 9: gain 60/8 - 25/8 = 4.375, N_min = 3; won 2 slices = 4 >= 3   -> swap
    series = [[5, 0, 0]] * 6 + [[0, 20, 0]] * 6
    n, s = feed(policy(), series, [True, False, False])
    assert n == 9
    assert (s.add, s.evict, s.n_min, s.persistence) == (1, 0, 3, 4)
    assert s.dt == pytest.approx(4.375)


def _window(series, window=8):
    w = SlidingWindow(len(series[0]), window)
    for h in series:
        w.push(h)
    return w


def test_a_tie_in_the_newest_slice_ends_the_streak():
    # expert 1 beat resident 0 in three slices, then tied: persistence counts trailing wins only -> 0 < N_min
    w = _window([[0, 9, 0]] * 6 + [[3, 3, 0]] * 2)
    assert policy().decide(w, np.array([True, False, False])) == []
    w = _window([[0, 9, 0]] * 6 + [[3, 4, 0]] * 2)  # a win instead of the tie: the swap is made
    assert [(s.add, s.evict, s.persistence) for s in policy().decide(w, np.array([True, False, False]))] == [(1, 0, 8)]


def test_slices_are_cut_from_the_newest_batch_back():
    # 7 batches in a window of 8 (slices of 2): the slices are batches 2-3, 4-5, 6-7, not 1-2, 3-4, 5-6, so the
    # newest batch, where expert 1 lost to resident 0, is judged and no swap is made
    w = _window([[0, 9, 0]] * 6 + [[20, 0, 0]])
    assert len(w) == 7 and policy().decide(w, np.array([True, False, False])) == []


def test_saving_is_capped_by_shipping_the_expert():
    """saving(m) = min(CPU kernel, ship) - resident: once shipping the weights is cheaper than the CPU (large m),
    residence saves exactly the copy, never more."""
    from placement.cost_model import PRESETS
    from placement.hardware import BUILTIN_PROFILES
    from placement.replace import copy_time, saving_fn

    shape, hw = PRESETS["qwen3-235b-a22b"], BUILTIN_PROFILES["ktransformers-paper-amx"]
    sv = saving_fn(shape, shape, hw)(np.array([0, 1, 10**6]))
    tau = copy_time(shape, hw) + hw.ship_expert_overhead
    assert sv[0] == 0 and 0 < sv[1] < tau and sv[2] == pytest.approx(tau)


def test_a_copy_that_cannot_pay_back_is_not_made():
    n, _ = feed(policy(t_copy=1e9), [[1, 4, 0]] * 40, [True, False, False])
    assert n is None


def test_flapping_experts_are_left_alone():
    # experts 0 and 1 alternate every batch: equal means, no gain
    series = [[6, 0, 0], [0, 6, 0]] * 8
    n, _ = feed(policy(t_copy=1.0), series, [True, False, False])
    assert n is None


def test_frozen_and_degenerate_cases():
    pol = policy()
    w = SlidingWindow(3, 8)
    for _ in range(8):
        w.push([1, 4, 9])
    assert pol.decide(w, np.array([True, False, False]), frozen={2})[0].add == 1  # 2's copy is in flight
    assert pol.decide(w, np.array([True, True, True])) == []  # nothing cold
    assert pol.decide(w, np.array([False, False, False])) == []  # nothing resident to evict
    two = ReplacePolicy(pol.saving, 0.0, ReplaceConfig(window=8, slices=4, max_swaps=2))
    swaps = two.decide(w, np.array([True, True, False]))
    assert [(s.add, s.evict) for s in swaps] == [(2, 0)]  # then 0 (cold now, frozen) cannot come back
    with pytest.raises(ValueError):
        w.push([1, 2])


def test_config_validation():
    from hybrid.errors import UsageError

    with pytest.raises(UsageError):
        ReplaceConfig(window=10, slices=4)
    with pytest.raises(UsageError):
        ReplaceConfig(window=0)


# -- mechanism: a real hybrid layer on the CPU ------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid_layer(tmp_path_factory):
    from hybrid.models.presets import hf_config
    from hybrid.models.writer import write_random_checkpoint
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig

    cfg = hf_config("demo")
    cfg.update(vocab_size=128, num_hidden_layers=1, eos_token_id=None, pad_token_id=None)
    ckpt = write_random_checkpoint(tmp_path_factory.mktemp("rp") / "ckpt", cfg, seed=5, std=0.1)
    hcfg = HybridConfig(gpu_experts=2, cpu_isa="ref", profile="ktransformers-paper-amx", replace="online")
    model, off = load_hybrid(ckpt, "cpu", torch.float32, hcfg, progress=False)
    return off


def test_online_swap_lands_between_batches_and_keeps_outputs(hybrid_layer):
    from hybrid.offload.replace import OnlineReplacer

    off = hybrid_layer
    layer = off.layers[0]
    layer.set_resident([0, 1])
    rep = off.replacer
    assert isinstance(rep, OnlineReplacer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, layer.D, generator=g)
    probe_ids = torch.tensor([[0, 1, 5, 9]] * 8)
    wts = torch.full((8, 4), 0.25)
    before = layer(x, probe_ids, wts)
    hot = torch.tensor([[5, 2 + t % 3, 6 + t % 3, 9 + t % 3] for t in range(8)])  # cold expert 5: every token
    n_before = rep.stats.landed
    proposed = landed = None
    for step in range(200):
        layer(x, hot, wts)
        if proposed is None and layer.layer in rep.pending:
            proposed = step
            assert not layer.is_resident[5]  # the batch that chose the swap kept its routing map
        if rep.stats.landed > n_before:
            landed = step
            break
    assert proposed is not None and proposed > 0, "the policy should wait for evidence, then propose"
    assert landed == proposed + 1  # landed at the start of the next call, never inside one
    assert rep.stats.landed == n_before + 1
    assert 5 in layer.resident_ids.tolist() and layer.is_resident[5]
    assert sorted(layer.cold_ids.tolist()) == [e for e in range(16) if not layer.is_resident[e]]
    slot = layer._slot_of[5]
    torch.testing.assert_close(layer.w_gate[slot], layer.expert_weights(5)[0])
    after = layer(x, probe_ids, wts)  # same function whichever lane runs each expert
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_no_replacement_while_graphs_hold_the_placement(hybrid_layer):
    layer = hybrid_layer.layers[0]
    rep = hybrid_layer.replacer
    layer.captured = True
    try:
        skipped = rep.stats.skipped_captured
        rep.after_batch(layer, np.ones(layer.num_experts, dtype=np.int64))
        assert rep.stats.skipped_captured == skipped + 1
        with pytest.raises(RuntimeError, match="eager"):
            layer.swap_resident(int(layer.resident_ids[0]), int(layer.cold_ids[0]), layer.expert_weights(0))
    finally:
        layer.captured = False


def test_one_copy_in_flight_over_all_layers():
    from types import SimpleNamespace

    from hybrid.offload.replace import OnlineReplacer
    from placement.cost_model import ExpertShape
    from placement.hardware import BUILTIN_PROFILES

    landed = []

    class FakeLayer:
        def __init__(self, i):
            self.layer, self.num_experts, self.captured = i, 3, False
            self.is_resident = np.array([True, False, False])

        def expert_weights(self, e):
            return (e,)

        def swap_resident(self, evict, add, weights):
            landed.append((self.layer, evict, add))
            self.is_resident[evict], self.is_resident[add] = False, True

    shape = ExpertShape("t", hidden=4096, intermediate=1536, num_experts=3, topk=1)
    rep = OnlineReplacer(SimpleNamespace(device=torch.device("cpu")), shape, shape,
                         BUILTIN_PROFILES["ktransformers-paper-amx"], ReplaceConfig(window=4, slices=2))
    rep.policy.t_copy = 0.0  # every gain pays at once: only the in-flight limit decides
    a, b = FakeLayer(0), FakeLayer(1)
    in_flight, when = [], {}
    for step in range(5):
        for layer in (a, b):
            rep.before_batch(layer)
            rep.after_batch(layer, np.array([0, 64, 0]))
            in_flight.append(len(rep.pending))
            when.update({x[0]: step for x in landed if x[0] not in when})
    # step 1: layer 0 proposes (copy in flight) and layer 1 must wait; step 2: layer 0's copy lands, then
    # layer 1 proposes; step 3: layer 1's lands
    assert max(in_flight) == 1
    assert landed == [(0, 0, 1), (1, 0, 1)] and when == {0: 2, 1: 3}
