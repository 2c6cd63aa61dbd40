"""Resident experts chosen by what they save in their layer's makespan (placement.planner
choose_resident_by_makespan, next_resident, plan; placement.predict.DecodeLanes; the routing prior of
placement.routing_stats): by hand on small lanes, then on the published presets with the plan command's
fallback profile."""

from dataclasses import replace

import numpy as np
import pytest

from hybrid.models.families import family_for
from hybrid.models.presets import PRESETS, published_config
from hybrid.offload.config import FALLBACK_PROFILE, default_cpu_dtype
from placement.hardware import BUILTIN_PROFILES
from placement.memory import MemorySettings, breakdown
from placement.planner import (PlanSettings, choose_resident, choose_resident_by_makespan, decode_step_time,
                               expert_shapes, next_resident, plan)
from placement.predict import DecodeLanes, decode_layer_time, decode_savings
from placement.routing_stats import PRIOR_TOKENS, RoutingStats

HW = BUILTIN_PROFILES[FALLBACK_PROFILE]  # what `hybrid plan` prices with on a machine without a calibration
GiB = 2**30


def lanes(cpu, gpu, fixed=0.0) -> DecodeLanes:
    return DecodeLanes(np.array(cpu, dtype=float), np.array(gpu, dtype=float), fixed)


def preset_cfg(name: str):
    """The model config `hybrid plan --preset NAME` plans for (hybrid/commands/plan.py)."""
    raw = published_config(name)
    return family_for(raw).parse_config(raw), raw


def resident_mask(cfg, p) -> np.ndarray:
    return np.array([np.isin(np.arange(cfg.num_experts), lp.resident_experts) for lp in p.layers])


def nothing_left_saves(cfg, hw, mem, shares, resident) -> bool:
    """No single cold expert of any layer would shorten its layer's decode time (decode_layer_time)."""
    cpu, gpu = expert_shapes(cfg, mem)
    for sh, res in zip(shares, resident):
        now = decode_layer_time(cpu, gpu, hw, sh, res, mem.max_batch)
        for e in np.flatnonzero(~res):
            if decode_layer_time(cpu, gpu, hw, sh, res | (np.arange(len(res)) == e), mem.max_batch) < now * (1 - 1e-12):
                return False
    return True


def old_rule_step(cfg, hw, mem, budget, shares) -> float:
    """Decode step time of the previous rule: an expert is kept when its own CPU time exceeds its GPU time."""
    cpu, gpu = expert_shapes(cfg, mem)
    savings = np.stack([decode_savings(cpu, gpu, hw, sh, mem.max_batch) for sh in shares])
    mb = breakdown(cfg, mem)
    res = choose_resident(savings, mb.resident_expert, budget - mb.gpu_fixed)
    return decode_step_time(cfg, hw, mem, shares, res, mem.max_batch)


def test_an_expert_the_cpu_runs_faster_still_shortens_a_cpu_bound_layer():
    """CPU lane 2 (two experts of 1), GPU lane empty: one resident (GPU time 1.5) makes it max(1, 1.5) = 1.5;
    a second would make it 3. The per-expert rule (1 - 1.5 < 0) keeps none."""
    ln = lanes([1.0, 1.0], [1.5, 1.5])
    got = choose_resident_by_makespan([ln], expert_bytes=10, budget_bytes=100)
    assert got.tolist() == [[True, False]]
    assert ln.layer_time([False, False]) == 2.0 and ln.layer_time(got[0]) == 1.5
    assert not choose_resident(np.array([[-0.5, -0.5]]), 10, 100).any()


def test_next_resident_by_hand():
    """T = 5: expert 0 saves min(3, 5 - 3.5) = 1.5, expert 1 min(2, 5 - 0.5) = 2 (the best is not the one
    with the largest CPU time); then T = 3 and expert 0, the last cold one, would make it 4."""
    ln = lanes([3.0, 2.0], [3.5, 0.5])
    assert next_resident(ln, np.array([False, False])) == (2.0, 1)
    assert next_resident(ln, np.array([False, True])) == pytest.approx((-1.0, 0))
    assert next_resident(ln, np.array([True, True])) == (0.0, -1)
    assert choose_resident_by_makespan([ln], 10, 100).tolist() == [[False, True]]
    # the CPU lane's fixed part (2) goes with the last cold expert: 2 + 1 -> 0.5 saves 2.5, not c = 1, so with
    # room for one expert this layer beats one that saves 1.9 (its lane 2 -> 0.1)
    last, other = lanes([1.0], [0.5], fixed=2.0), lanes([2.0], [0.1])
    assert next_resident(last, np.array([False])) == (2.5, 0)
    assert next_resident(other, np.array([False])) == pytest.approx((1.9, 0))
    assert choose_resident_by_makespan([other, last], 10, 19).tolist() == [[False], [True]]


def test_equal_layers_share_the_budget_round_robin_and_never_exceed_it():
    """Three equal layers, each saving until fully resident (GPU 0.1 per expert against CPU 1, fixed 0.2): n
    experts of room give n residents, spread round-robin (counts differ by at most one), the same every time."""
    ln = lanes([1.0] * 4, [0.1] * 4, fixed=0.2)
    for n in range(14):
        got = choose_resident_by_makespan([ln] * 3, 10, n * 10 + 9)
        assert got.sum() == min(n, 12)
        assert got.sum(axis=1).max() - got.sum(axis=1).min() <= 1
        assert np.array_equal(got, choose_resident_by_makespan([ln] * 3, 10, n * 10 + 9))


def test_stops_only_when_the_budget_is_full_or_nothing_saves():
    rng = np.random.default_rng(1)
    for _ in range(40):
        ls = [lanes(rng.exponential(1.0, 6), rng.exponential(0.4, 6), rng.uniform(0, 1)) for _ in range(3)]
        n = int(rng.integers(0, 20))
        got = choose_resident_by_makespan(ls, 7, 7 * n + 3)
        assert got.sum() <= n
        if got.sum() < n:
            for ln, res in zip(ls, got):
                assert all(ln.layer_time(res | (np.arange(6) == e)) >= ln.layer_time(res) for e in np.flatnonzero(~res))


@pytest.mark.parametrize("preset,cpu_dtype", [("gpt-oss-120b", "mxfp4"), ("qwen3-235b-a22b", "int4")])
def test_quantized_cpu_experts_still_get_residents(preset, cpu_dtype):
    """`hybrid plan --preset P --gpu-budget 24GiB --cpu-budget 128GiB` with quantized CPU experts: each one runs
    faster on the CPU than from HBM, yet moving some off the (longer) CPU lane shortens every layer."""
    cfg, _ = preset_cfg(preset)
    mem = MemorySettings(cpu_dtype=cpu_dtype)
    p = plan(cfg, None, HW, PlanSettings(24 * GiB, 128 * GiB, mem))
    assert all(len(lp.resident_experts) > 0 for lp in p.layers)
    shares = RoutingStats.uniform(cfg).decode_shares()
    none = decode_step_time(cfg, HW, mem, shares, np.zeros(shares.shape, dtype=bool), 1)
    assert 1 / p.predicted_decode_tokens_per_s < none
    assert old_rule_step(cfg, HW, mem, 24 * GiB, shares) == pytest.approx(none)  # the old rule placed nothing


def skewed_stats(cfg, tokens=1000, unseen=0, seed=0) -> RoutingStats:
    """Zipf-like measured counts per layer, a random order of experts per layer, the last `unseen` never seen."""
    rng = np.random.default_rng(seed)
    L, E, K = cfg.num_moe_layers, cfg.num_experts, cfg.experts_per_token
    w = 1.0 / np.arange(1, E - unseen + 1)
    counts = np.zeros((L, E), dtype=np.int64)
    for li in range(L):
        counts[li, rng.permutation(E)[:E - unseen]] = np.floor(np.minimum(w / w.sum() * K, 1.0) * tokens)
    return RoutingStats(E, K, cfg.moe_layer_indices, counts, tokens=tokens, source={"kind": "test"})


@pytest.mark.parametrize("stats,rows", [(None, 1), ("skewed", 2)])
def test_plan_records_what_decode_step_time_predicts(stats, rows):
    """The plan's tokens/s is decode_step_time over its residents (routing with the prior), and each layer's
    recorded saving is that layer's makespan without residents minus with them: the savings sum to the step's."""
    cfg, _ = preset_cfg("gpt-oss-120b")
    stats = skewed_stats(cfg, unseen=20) if stats else None
    mem = MemorySettings(cpu_dtype="mxfp4", max_batch=rows)
    p = plan(cfg, stats, HW, PlanSettings(24 * GiB, 128 * GiB, mem))
    shares = (stats or RoutingStats.uniform(cfg)).decode_shares(prior=PRIOR_TOKENS)
    res = resident_mask(cfg, p)
    step = decode_step_time(cfg, HW, mem, shares, res, rows)
    assert rows / p.predicted_decode_tokens_per_s == pytest.approx(step, rel=1e-12)
    cpu, gpu = expert_shapes(cfg, mem)
    for sh, r, lp in zip(shares, res, p.layers):
        want = decode_layer_time(cpu, gpu, HW, sh, np.zeros_like(r), rows) - decode_layer_time(cpu, gpu, HW, sh, r, rows)
        assert lp.predicted_saving_s == pytest.approx(want, rel=1e-9, abs=1e-15) and want > 0
    none = decode_step_time(cfg, HW, mem, shares, np.zeros_like(res), rows)
    assert none - sum(lp.predicted_saving_s for lp in p.layers) == pytest.approx(step, rel=1e-12)


def test_unseen_experts_get_the_free_vram_last():
    """OLMoE's shape with measured statistics where 12 of 64 experts per layer were never seen. With a GPU lane
    that never becomes the longer one every expert saves time: the seen ones are placed first, then the
    unseen ones, and no expert's worth of VRAM is left idle unless the model is fully resident. On the
    plan command's profile the planner may stop earlier, but only where no further expert saves time."""
    cfg, _ = preset_cfg("olmoe-1b-7b")
    stats = skewed_stats(cfg, tokens=200, unseen=12)
    mem = MemorySettings()
    mb = breakdown(cfg, mem)
    L, E = cfg.num_moe_layers, cfg.num_experts
    seen = int((stats.counts > 0).sum())
    fast_gpu = replace(HW, hbm_bw=HW.hbm_bw * 1e3, gpu_flops=HW.gpu_flops * 1e3)
    for room, want in [(seen + 5, seen + 5), (L * E + 3, L * E)]:
        budget = mb.gpu_fixed + room * mb.resident_expert + mb.resident_expert // 2
        p = plan(cfg, stats, fast_gpu, PlanSettings(budget, 2**40, mem))
        res = resident_mask(cfg, p)
        assert res.sum() == want
        assert (res & (stats.counts == 0)).sum() == want - seen  # every seen one first, then unseen ones
        assert budget - p.gpu_bytes < mb.resident_expert or res.all()
    budget = mb.gpu_fixed + (L * E + 3) * mb.resident_expert
    p = plan(cfg, stats, HW, PlanSettings(budget, 2**40, mem))
    res = resident_mask(cfg, p)
    shares = stats.decode_shares(prior=PRIOR_TOKENS)
    assert res.all() or nothing_left_saves(cfg, HW, mem, shares, res)
    assert 1 / p.predicted_decode_tokens_per_s <= old_rule_step(cfg, HW, mem, budget, shares)


def test_shares_with_a_prior_by_hand():
    """Decode counts [0, 2, 2, 16] of 20 tokens, K = 1, half a pseudo-token each: (c + 0.5) / (20 + 0.5 * 4)."""
    counts = np.array([[0, 2, 2, 16]])
    s = RoutingStats(4, 1, (0,), counts, tokens=20)
    assert s.decode_shares(prior=0.5)[0].tolist() == pytest.approx([0.5 / 22, 2.5 / 22, 2.5 / 22, 16.5 / 22])
    assert s.decode_shares().tolist() == (counts / 20).tolist()  # the raw view is unchanged
    assert RoutingStats(4, 2, (0,), np.zeros((1, 4), dtype=np.int64), 0).decode_shares(prior=0.5).tolist() == [[0.5] * 4]
    big = RoutingStats(8, 2, (0,), np.array([[60, 40, 0, 0, 0, 0, 50, 50]]), tokens=100)
    assert big.decode_shares(prior=0.5).sum() == pytest.approx(2.0)  # a row still sums to K


@pytest.mark.parametrize("preset", [n for n in PRESETS if n != "demo"])
def test_never_slower_than_the_old_rule_on_the_presets(preset):
    """Predicted decode step of the plan against the per-expert rule's residents, same routing and budget:
    uniform and skewed statistics, the dtype `hybrid generate` loads and int4, a small and a large budget.
    With quantized CPU experts the per-expert rule keeps none, and the plan is strictly faster."""
    cfg, raw = preset_cfg(preset)
    for cpu_dtype in sorted({default_cpu_dtype(raw), "int4"}):
        mem = MemorySettings(cpu_dtype=cpu_dtype)
        fixed = breakdown(cfg, mem).gpu_fixed
        for stats in (None, skewed_stats(cfg, unseen=cfg.num_experts // 8)):
            shares = (stats or RoutingStats.uniform(cfg)).decode_shares(prior=PRIOR_TOKENS)
            for extra in (4 * GiB, 64 * GiB):
                p = plan(cfg, stats, HW, PlanSettings(fixed + extra, 2**42, mem))
                old = old_rule_step(cfg, HW, mem, fixed + extra, shares)
                step = 1 / p.predicted_decode_tokens_per_s
                assert step <= old * (1 + 1e-12), (cpu_dtype, stats is None, extra)
                assert cpu_dtype == "bf16" or step < old * (1 - 1e-3), (cpu_dtype, stats is None, extra)
