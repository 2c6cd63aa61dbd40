"""The placement planner on synthetic statistics, checked by hand (placement.planner, memory, predict)."""

from dataclasses import replace

import numpy as np
import pytest

from hybrid.errors import UsageError
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from placement.hardware import HardwareProfile
from placement.memory import MemorySettings, breakdown, f_slices, packed_expert_bytes
from placement.plan_file import Plan, load_plan
from placement.planner import PlanSettings, check_budgets, choose_resident, expert_shapes, plan
from placement.predict import binomial_pmf, decode_savings
from placement.routing_stats import RoutingStats, load_stats

# Round numbers so that savings are easy to write down: B_D 100 GB/s, B_H 1 TB/s, link 10 GB/s, alpha 0.
HW = HardwareProfile(name="round", cpu_flops={"k": 1e12}, dram_bw=1e11, gpu_flops=1e14, hbm_bw=1e12,
                     link_bw=1e10, alpha=0.0)


def model_cfg(experts=4, topk=1, layers=2, **extra):
    raw = hf_config("demo")  # D 256, F 128
    raw.update(num_experts=experts, num_experts_per_tok=topk, num_hidden_layers=layers, **extra)
    return family_for(raw).parse_config(raw)


CFG = model_cfg()
W = 3 * 256 * 128 * 2  # one bf16 expert, bytes (F 128 and D 256 need no padding)
FLAT, SKEWED = [25, 25, 25, 25], [55, 35, 5, 5]
STATS = RoutingStats(4, 1, (0, 1), np.array([FLAT, SKEWED]), tokens=100)
MEM = MemorySettings(max_context=64, max_batch=1, reserve=0)


def settings_for(n_experts: int, extra: int = 0, mem=MEM) -> PlanSettings:
    fixed = breakdown(CFG, mem).gpu_fixed
    return PlanSettings(gpu_budget=fixed + n_experts * W + extra, cpu_budget=2**30, memory=mem)


def test_packed_bytes_by_hand():
    assert packed_expert_bytes(256, 128, "bf16") == W
    # int8: values + fp32 scale + int32 row sum per padded row; down [256, 128] rows align to 32
    assert packed_expert_bytes(256, 128, "int8") == 2 * (128 * 256 + 128 * 8) + (256 * 128 + 256 * 8)
    # int4 (group 128): nibbles + one fp32 scale per 128 values; K pads to 128
    assert packed_expert_bytes(256, 128, "int4") == 2 * (128 * 128 + 128 * 2 * 4) + (256 * 64 + 256 * 1 * 4)
    # mxfp4: nibbles + one uint8 exponent per 32 values; K pads to 64
    assert packed_expert_bytes(256, 128, "mxfp4") == 2 * (128 * 128 + 128 * 8) + (256 * 64 + 256 * 4)


def test_decode_saving_by_hand():
    cpu, gpu = expert_shapes(CFG, MEM)
    per_token = W / 1e11 - W / 1e12  # weight read from DRAM vs from HBM (both bandwidth-bound at m = 1, 2)
    s1 = decode_savings(cpu, gpu, HW, [0.5, 0.1, 0.0], rows=1)
    assert s1 == pytest.approx([0.5 * per_token, 0.1 * per_token, 0.0])
    s2 = decode_savings(cpu, gpu, HW, [0.5], rows=2)  # used in 1 - (1 - q)^2 of the steps
    assert s2 == pytest.approx([0.75 * per_token])
    assert binomial_pmf([0.5], 2)[0] == pytest.approx([0.25, 0.5, 0.25])


def test_skewed_layer_gets_more_than_flat():
    p = plan(CFG, STATS, HW, settings_for(3))
    # savings order: skewed .55, skewed .35, then flat .25 (x4, ties: lowest id first)
    assert [lp.resident_experts for lp in p.layers] == [(0,), (0, 1)]
    p = plan(CFG, STATS, HW, settings_for(5))
    assert [lp.resident_experts for lp in p.layers] == [(0, 1, 2), (0, 1)]


def test_uniform_statistics_spread_evenly():
    p = plan(CFG, None, HW, settings_for(4))
    assert [len(lp.resident_experts) for lp in p.layers] == [2, 2]
    p = plan(CFG, None, HW, settings_for(3))
    assert sorted(len(lp.resident_experts) for lp in p.layers) == [1, 2]


def test_budget_exactly_at_a_boundary():
    exact = plan(CFG, STATS, HW, settings_for(3))
    assert exact.gpu_bytes == exact.gpu_budget_bytes  # fills the budget to the byte
    assert sum(len(lp.resident_experts) for lp in exact.layers) == 3
    short = plan(CFG, STATS, HW, settings_for(3, extra=-1))
    assert sum(len(lp.resident_experts) for lp in short.layers) == 2
    # exactly the fixed part: valid, no resident expert; one byte less: impossible
    assert sum(len(lp.resident_experts) for lp in plan(CFG, STATS, HW, settings_for(0)).layers) == 0
    with pytest.raises(UsageError):
        plan(CFG, STATS, HW, settings_for(0, extra=-1))


def test_budget_never_exceeded_and_no_byte_wasted():
    from test_plan_residency import nothing_left_saves
    from placement.routing_stats import PRIOR_TOKENS

    rng = np.random.default_rng(0)
    cfg = model_cfg(experts=16, topk=4, layers=4)
    fixed = breakdown(cfg, MEM).gpu_fixed
    for _ in range(40):
        counts = rng.integers(0, 100, size=(4, 16)) ** 2
        stats = RoutingStats(16, 4, (0, 1, 2, 3), counts, tokens=int(counts.sum(1).max()))
        budget = fixed + int(rng.integers(0, 70 * W))
        p = plan(cfg, stats, HW, PlanSettings(gpu_budget=budget, cpu_budget=2**30, memory=MEM))
        n = sum(len(lp.resident_experts) for lp in p.layers)
        assert p.gpu_bytes <= budget
        assert p.gpu_bytes == fixed + n * W
        # the budget is full, or no cold expert (an unseen one included) would shorten its layer
        resident = np.array([np.isin(np.arange(16), lp.resident_experts) for lp in p.layers])
        full = n == (budget - fixed) // W
        assert full or nothing_left_saves(cfg, HW, MEM, stats.decode_shares(prior=PRIOR_TOKENS), resident)


def test_choose_resident_ignores_experts_that_save_nothing():
    sav = np.array([[3.0, 0.0, -1.0], [2.0, 1.0, 0.0]])
    got = choose_resident(sav, expert_bytes=10, budget_bytes=100)
    assert got.tolist() == [[True, False, False], [True, True, False]]
    assert choose_resident(sav, 10, 29).sum() == 2


def test_prediction_improves_with_residency():
    few = plan(CFG, STATS, HW, settings_for(1))
    more = plan(CFG, STATS, HW, settings_for(8))
    assert more.predicted_decode_tokens_per_s > few.predicted_decode_tokens_per_s > 0
    assert more.predicted_prefill_tokens_per_s >= few.predicted_prefill_tokens_per_s > 0


def test_graph_floor_enters_the_decode_prediction_by_hand():
    """A measured per-layer graph floor adds layers x floor to a decode step and replaces the CPU lane's
    separately priced fixed part (the floor model's lane already paid it)."""
    from placement.predict import decode_floor, decode_layer_time

    hw = replace(HW, cpu_lane_overhead=2e-4, alpha=1e-5)
    cpu, gpu = expert_shapes(CFG, MEM)
    shares, cold_only = [0.5, 0.3, 0.1, 0.1], [False] * 4
    lane_fixed = 2e-4 + 2 * 1e-5 + 1 * 2 * 256 * 2 / 1e10  # overhead + 2 alpha + one row there and back
    t0 = decode_layer_time(cpu, gpu, hw, shares, cold_only, rows=1)
    t1 = decode_layer_time(cpu, gpu, replace(hw, graph_layer_floor=3e-4), shares, cold_only, rows=1)
    assert t0 - t1 == pytest.approx(lane_fixed)
    assert decode_floor(CFG, replace(hw, graph_layer_floor=3e-4)) == pytest.approx(CFG.num_layers * 3e-4)
    base = plan(CFG, STATS, hw, settings_for(1))
    floored = plan(CFG, STATS, replace(hw, graph_layer_floor=3e-4), settings_for(1))
    step0, step1 = 1 / base.predicted_decode_tokens_per_s, 1 / floored.predicted_decode_tokens_per_s
    # two layers, both with cold experts on the CPU lane (the longer lane at these shares)
    assert step1 - step0 == pytest.approx(CFG.num_layers * 3e-4 - 2 * lane_fixed)
    with pytest.raises(UsageError):
        replace(HW, graph_layer_floor=-1.0)


def test_decode_layer_is_the_longer_lane_by_hand():
    """The graph runs the CPU lane and the GPU lane concurrently: a layer costs the longer one, not their sum."""
    from placement.predict import decode_layer_time

    hw = replace(HW, cpu_lane_overhead=2e-4)
    cpu, gpu = expert_shapes(CFG, MEM)
    shares = [0.5, 0.3, 0.1, 0.1]
    gpu_lane = 1.0 * W / 1e12  # every expert resident: shares sum to K = 1, one weight read from HBM
    assert decode_layer_time(cpu, gpu, hw, shares, [True] * 4, rows=1) == pytest.approx(gpu_lane)
    cpu_lane = 2e-4 + 1 * 2 * 256 * 2 / 1e10 + 0.5 * W / 1e11  # overhead + one row there and back + cold reads
    assert decode_layer_time(cpu, gpu, hw, shares, [True, False, False, False], rows=1) == pytest.approx(cpu_lane)
    # with no lane overhead and most of the traffic resident, the GPU lane is the longer one
    hw0 = replace(HW, cpu_lane_overhead=0.0)
    t = decode_layer_time(cpu, gpu, hw0, [0.97, 0.01, 0.01, 0.01], [True, False, False, False], rows=1)
    assert t == pytest.approx(max(0.97 * W / 1e12, 2 * 256 * 2 / 1e10 + 0.03 * W / 1e11))


def test_prefill_histogram_rounds_to_the_nearest_token():
    """Prefill prices the expected histogram round(P * share): shares 0.6 and 0.15 of 4 tokens are 2 and 1 tokens
    (not 2 and 0: an expert left at 0 tokens is never read)."""
    from placement.predict import prefill_layer_time
    from placement.schedule import LayerScheduler

    cpu, gpu = expert_shapes(CFG, MEM)
    sched, gsched = LayerScheduler(cpu, HW), LayerScheduler(gpu, HW)
    cold = [False] * 4
    t = prefill_layer_time(sched, gsched, [0.6, 0.15, 0.0, 0.25], cold, 4)
    assert t == pytest.approx(prefill_layer_time(sched, gsched, [0.5, 0.25, 0.0, 0.25], cold, 4))
    assert t > prefill_layer_time(sched, gsched, [0.5, 0.0, 0.0, 0.25], cold, 4) * 1.01


def test_non_expert_time_by_hand():
    """With unbounded FLOPs everything is a read from HBM: decode reads each row's K/V, prefill one pass over it;
    a larger vocabulary adds its LM-head rows but not its embedding rows (those are gathered)."""
    from placement.predict import non_expert_step_time

    hw = replace(HW, gpu_flops=1e30)
    kv = 100 * CFG.kv_values_per_token * 2 / 1e12  # 100 positions of K/V, bf16
    dec = non_expert_step_time(CFG, hw, 8, 100, 2)
    pre = non_expert_step_time(CFG, hw, 8, 100, 2, prefill=True)
    assert dec - pre == pytest.approx(7 * kv)
    big = model_cfg(vocab_size=CFG.vocab_size + 100)
    assert non_expert_step_time(big, hw, 8, 100, 2, prefill=True) - pre == pytest.approx(100 * 256 * 2 / 1e12)
    # an fp8 KV cache: each row reads one byte a cached value, not the compute dtype's two
    assert dec - non_expert_step_time(CFG, hw, 8, 100, 2, kv_value_bytes=1) == pytest.approx(8 * kv / 2)


def test_decode_step_prices_the_kv_cache_in_its_own_dtype():
    """The planner's decode step under --kv-dtype fp8 reads half the KV bytes of bf16's: the difference is exactly
    half the bf16 cache read of every row, at the graphs' whole context."""
    import numpy as np

    from placement.memory import MemorySettings
    from placement.planner import decode_step_time

    hw = replace(HW, gpu_flops=1e30)
    L, E = len(CFG.moe_layer_indices), CFG.num_experts
    shares, resident = np.full((L, E), 1.0 / E), np.zeros((L, E), dtype=bool)
    s = MemorySettings(max_batch=4, max_context=4096)
    bf16 = decode_step_time(CFG, hw, s, shares, resident, rows=4)
    fp8 = decode_step_time(CFG, hw, replace(s, kv_dtype="fp8"), shares, resident, rows=4)
    assert bf16 - fp8 == pytest.approx(4 * 4096 * CFG.kv_values_per_token * 1 / hw.hbm_bw)


def test_graph_floor_model_builds_and_decodes_on_the_cpu():
    """The calibration's floor model (CUDA on the box) built and decoded eagerly here: the code path runs
    and the figure is the measured step split over the layers."""
    from hybrid.offload.overheads import measure_graph_layer_floor

    r = measure_graph_layer_floor(256, layers=2, steps=2, device="cpu")
    assert r["graph_layer_floor"] > 0
    assert r["graph_layer_floor"] * r["raw_s"]["layers"] == pytest.approx(r["raw_s"]["decode_step"])


def test_floor_model_at_a_batch_decodes_every_row():
    """bench.decode_timeline --batch: the floor model with several rows, each its own slot and prompt, every
    step decoding all of them (eagerly here)."""
    from hybrid.offload.overheads import floor_engine, time_decode_steps

    eng, slots, cfg = floor_engine(256, layers=1, device="cpu", resident="none", batch=3)
    assert len(set(slots)) == 3 and all(eng.lengths[s] == 16 for s in slots)
    assert len(time_decode_steps(eng, slots, 2)) == 2
    assert all(eng.lengths[s] == 16 + 2 + 3 for s in slots)  # 3 untimed steps + 2 timed, every row
    with pytest.raises(ValueError, match="batch"):
        floor_engine(256, layers=1, device="cpu", batch=0)


def test_numa_split_balanced_on_two_fake_nodes():
    assert f_slices(128, [2, 2]) == [(0, 64), (64, 128)]
    mem = MemorySettings(max_context=64, reserve=0, node_threads=(2, 2))
    p = plan(CFG, STATS, HW, settings_for(3, mem=mem))
    a, b = p.numa
    assert (a["f_start"], a["f_end"], b["f_start"], b["f_end"]) == (0, 64, 64, 128)
    assert a["bytes"] == b["bytes"] and a["bytes"] + b["bytes"] == p.memory["cpu"]["experts"]
    assert a["cold_bytes"] == b["cold_bytes"] == (8 - 3) * W // 2
    # never a copy per node: two nodes hold exactly what one node holds (no padding at these shapes)
    assert p.memory["cpu"]["experts"] == 8 * W
    # 3:1 threads: the first boundary (96) rounds up to the 64-element padding step = F, node 1 gets nothing
    lopsided = plan(CFG, STATS, HW, settings_for(3, mem=MemorySettings(max_context=64, reserve=0, node_threads=(3, 1))))
    assert [(n["f_start"], n["f_end"], n["bytes"] > 0) for n in lopsided.numa] == [(0, 128, True), (128, 128, False)]


def test_numa_bytes_match_the_cpu_executor():
    import os

    import torch

    import cpu_kernels
    from cpu_kernels.topology import Topology

    isas = [i for i in cpu_kernels.available_isas() if i != "ref"]
    cpus = sorted(os.sched_getaffinity(0))
    if not isas or len(cpus) < 2:
        pytest.skip("needs a compiled ISA and 2 cpus")
    g = torch.randn(3, 192, 320) * 0.1  # F 192 and D 320: padding on both
    u = torch.randn(3, 192, 320) * 0.1
    d = torch.randn(3, 320, 192) * 0.1
    for dtype in ("bf16", "int8", "int4", "mxfp4"):
        for nodes in (((cpus[0],),), ((cpus[0],), (cpus[1],))):
            moe = cpu_kernels.CpuMoE(g, u, d, dtype=dtype, topology=Topology(nodes), isa=isas[0])
            want = packed_expert_bytes(320, 192, dtype, [1] * len(nodes))
            assert moe.nbytes == 3 * want, (dtype, len(nodes))
            assert moe._slices == f_slices(192, [1] * len(nodes), dtype)


def test_memory_matches_the_runtime(tmp_path):
    import torch

    from hybrid.models import build_empty
    from hybrid.runtime.kv_cache import StaticKVCache

    cfg = model_cfg(experts=8, topk=2, layers=2)
    mem = breakdown(cfg, MemorySettings(max_context=32, max_batch=3, gpu_dtype_bytes=4, reserve=0))
    model = build_empty(cfg, device="cpu", dtype=torch.float32)
    params = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." not in n)
    assert mem.non_expert == params
    assert mem.kv_cache == StaticKVCache(cfg.num_layers, 3, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu").nbytes


def test_impossible_budgets_say_what_to_change():
    fixed = breakdown(CFG, MEM)
    with pytest.raises(UsageError) as e:
        check_budgets(CFG, PlanSettings(gpu_budget=fixed.gpu_fixed - 1, cpu_budget=2**30, memory=MEM))
    msg = str(e.value)
    assert "--gpu-budget" in msg and "raise --gpu-budget to at least" in msg and "--max-context" in msg
    assert "KV cache" in msg and "non-expert weights" in msg
    need = fixed.cpu_total
    with pytest.raises(UsageError) as e:
        check_budgets(CFG, PlanSettings(gpu_budget=2**30, cpu_budget=need - 1, memory=MEM))
    msg = str(e.value)
    assert "--cpu-budget" in msg and "raise --cpu-budget to at least" in msg and "--cpu-dtype int8" in msg
    # exactly at the DRAM need it fits (the check is "more than the budget"), and a budget exactly at int8's need
    # names int8 as the way out of a bf16 plan that is one byte too big for it
    assert check_budgets(CFG, PlanSettings(gpu_budget=2**30, cpu_budget=need, memory=MEM)).cpu_total == need
    int8_need = breakdown(CFG, replace(MEM, cpu_dtype="int8")).cpu_total
    assert int8_need < need
    with pytest.raises(UsageError, match="--cpu-dtype int8"):
        check_budgets(CFG, PlanSettings(gpu_budget=2**30, cpu_budget=int8_need, memory=MEM))
    with pytest.raises(UsageError) as e:  # nothing fits, not even int4: no dtype hint
        check_budgets(CFG, PlanSettings(gpu_budget=2**30, cpu_budget=1000, memory=MEM))
    assert "--cpu-dtype" not in str(e.value).split("too small")[1].split("raise")[1]
    with pytest.raises(UsageError, match="no GPU"):
        plan(CFG, STATS, HardwareProfile(name="cpu-only", cpu_flops={"k": 1e12}, dram_bw=1e11, gpu_flops=None,
                                         hbm_bw=None, link_bw=None, alpha=None), settings_for(2))


def test_plan_file_round_trip(tmp_path):
    p = plan(CFG, STATS, HW, settings_for(3))
    path = p.save(tmp_path / "p.json")
    q = load_plan(path)
    assert q == p
    assert q.resident_of(1) == (0, 1)
    data = p.to_json()
    for broken, needle in [({**data, "kind": "x"}, "not a placement plan"),
                           ({**data, "schema_version": 9}, "schema_version"),
                           ({**data, "gpu_bytes": data["gpu_budget_bytes"] + 1}, "exceeds its own budgets"),
                           ({**data, "layers": [{"layer": 0, "resident_experts": [9]}, data["layers"][1]]}, "out of range"),
                           ({**data, "layers": [{"layer": 0, "resident_experts": [1, 1]}, data["layers"][1]]}, "distinct"),
                           ({k: v for k, v in data.items() if k != "cpu_bytes"}, "malformed")]:
        with pytest.raises(UsageError, match=needle):
            Plan.from_json(broken)
    with pytest.raises(UsageError, match="another model"):
        q.check_model(model_cfg(experts=8))


def test_plan_file_limits_at_the_edges():
    """Each check at its boundary: expert id E (one past the last), a CPU need one byte over its budget, a
    settings count of 0; and the values just inside them load."""
    data = plan(CFG, STATS, HW, settings_for(3)).to_json()
    E = CFG.num_experts
    last = {**data, "layers": [{"layer": 0, "resident_experts": [E - 1]}, data["layers"][1]]}
    assert Plan.from_json(last).resident_of(0) == (E - 1,)
    with pytest.raises(UsageError, match="out of range"):
        Plan.from_json({**data, "layers": [{"layer": 0, "resident_experts": [E]}, data["layers"][1]]})
    full = {**data, "cpu_bytes": data["cpu_budget_bytes"], "gpu_bytes": data["gpu_budget_bytes"]}
    assert Plan.from_json(full).cpu_bytes == data["cpu_budget_bytes"]
    with pytest.raises(UsageError, match="exceeds its own budgets"):
        Plan.from_json({**data, "cpu_bytes": data["cpu_budget_bytes"] + 1})
    for name in ("max_context", "max_batch", "staging_slots", "prefill_tokens"):
        assert Plan.from_json({**data, "settings": {**data["settings"], name: 1}}).settings[name] == 1
        with pytest.raises(UsageError, match=f"settings.{name} must be a positive integer"):
            Plan.from_json({**data, "settings": {**data["settings"], name: 0}})


def test_routing_stats_round_trip(tmp_path):
    s = RoutingStats(4, 1, (0, 1), np.array([FLAT, SKEWED]), tokens=100, window_tokens=50,
                     series=((50, np.array([FLAT, SKEWED]) // 2), (50, np.array([FLAT, SKEWED]) // 2)))
    got = load_stats(s.save(tmp_path / "s.json"))
    assert got.tokens == 100 and got.layers == (0, 1) and np.array_equal(got.counts, s.counts)
    assert len(got.series) == 2 and np.array_equal(got.series[1][1], s.series[1][1])
    assert got.shares()[1].tolist() == [0.55, 0.35, 0.05, 0.05]
    with pytest.raises(UsageError, match="another model shape"):
        got.check_model(model_cfg(experts=8))
    with pytest.raises(UsageError, match="counts have shape"):
        RoutingStats(4, 1, (0,), np.zeros((2, 4)), 0)


def test_decode_routing_recorded_apart_places_decode_and_prices_prefill_by_prompts(tmp_path):
    """Statistics with the decode steps' routing counted apart: residency and the decode prediction follow
    what generated tokens route to, the prefill prediction what prompt tokens route to. By hand: layer 1's
    prompts favour expert 0, its decode favours expert 3; one resident expert goes to layer 1's expert 3."""
    prompts = np.array([FLAT, SKEWED]) * 0.8  # 80 prompt tokens (shares as before), 20 decode tokens
    decode = np.array([[5, 5, 5, 5], [0, 2, 2, 16]])
    s = RoutingStats(4, 1, (0, 1), (prompts + decode).astype(int), tokens=100, decode_counts=decode, decode_tokens=20)
    assert s.decode_shares()[1].tolist() == [0.0, 0.1, 0.1, 0.8]
    assert s.prefill_shares()[1].tolist() == pytest.approx([0.55, 0.35, 0.05, 0.05])
    p = plan(CFG, s, HW, settings_for(1))
    assert [lp.resident_experts for lp in p.layers] == [(), (3,)]  # 0.8 of decode beats every other share
    merged = RoutingStats(4, 1, (0, 1), s.counts, tokens=100)  # the same counts, decode not apart
    assert [lp.resident_experts for lp in plan(CFG, merged, HW, settings_for(1)).layers] == [(), (0,)]
    # the plan's prefill price, by hand on its own placement: the prompts' routing, not all tokens' or decode's
    from placement.predict import non_expert_step_time, prefill_layer_time
    from placement.schedule import LayerScheduler
    cpu, gpu = expert_shapes(CFG, MEM)
    P = 64  # the prefill prices the whole context (64 < PlanSettings' 512 default)
    res = [np.isin(np.arange(4), lp.resident_experts) for lp in p.layers]

    def prefill_tps(shares):
        t = non_expert_step_time(CFG, HW, P, P // 2, 2, prefill=True)
        return P / (t + sum(prefill_layer_time(LayerScheduler(cpu, HW), LayerScheduler(gpu, HW), sh, r, P)
                            for sh, r in zip(shares, res)))

    assert p.predicted_prefill_tokens_per_s == pytest.approx(prefill_tps(s.prefill_shares()))
    assert prefill_tps(s.prefill_shares()) != pytest.approx(prefill_tps(s.shares()))
    assert prefill_tps(s.prefill_shares()) != pytest.approx(prefill_tps(s.decode_shares()))
    got = load_stats(s.save(tmp_path / "d.json"))  # the split survives the file
    assert got.decode_tokens == 20 and np.array_equal(got.decode_counts, decode)
    with pytest.raises(UsageError, match="decode counts"):
        RoutingStats(4, 1, (0, 1), s.counts, tokens=100, decode_counts=s.counts + 1, decode_tokens=20)
    with pytest.raises(UsageError, match="decode tokens"):
        RoutingStats(4, 1, (0, 1), s.counts, tokens=100, decode_counts=decode, decode_tokens=101)


def test_expert_biases_counted_in_vram_by_plan_and_runtime(tmp_path):
    """gpt-oss keeps every expert's biases on the GPU (fp32): the plan's fixed VRAM and the runtime's both count
    them, and they agree with what the loaded layers hold."""
    import torch
    from tiny_models import make_checkpoint

    from hybrid.loading.place import fixed_vram
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig
    from placement.memory import expert_bias_bytes

    make_checkpoint("gpt_oss", tmp_path, seed=0)
    hcfg = HybridConfig(gpu_experts=0, schedule="cpu", cpu_isa="ref", profile="ktransformers-paper-amx")
    model, off = load_hybrid(tmp_path, "cpu", torch.float32, hcfg, progress=False)
    cfg = model.cfg
    held = sum(t.numel() * t.element_size() for layer in off.layers for t in layer.bias_dev)
    want = cfg.num_moe_layers * cfg.num_experts * (2 * cfg.expert_intermediate_size + cfg.hidden_size) * 4
    assert held == expert_bias_bytes(cfg) == want > 0
    mem = breakdown(cfg, MemorySettings(max_context=32, max_batch=1, gpu_dtype_bytes=4, reserve=0))
    params = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." not in n)
    assert mem.non_expert == params + held
    lane = off.ship_lane
    staging = lane.n_slots * lane.chunk * 3 * cfg.hidden_size * cfg.expert_intermediate_size * 4
    assert fixed_vram(model, 0, off) == params + held + staging
    assert expert_bias_bytes(model_cfg(experts=8, topk=2, layers=2)) == 0  # no biases, nothing added


def test_staging_is_priced_at_the_largest_layer_layout():
    """A layer whose down keeps a wider dtype of its own (a Q4_K_M file's Q6_K downs held as int8) widens every
    staging sub-slot of the shared ship lane to its layout: the planner prices the staging there; a narrower
    down of its own changes nothing."""
    from placement.memory import down_bytes

    raw = hf_config("qwen3-30b-a3b", layers=2)  # F 768: no K padding for q4_k's 256-value super-blocks
    cfg = family_for(raw).parse_config(raw)
    D, F = cfg.hidden_size, cfg.expert_intermediate_size
    mem = MemorySettings(max_context=64, reserve=0, cpu_dtype="q4_k", staging_slots=2, ship_chunk=3)
    base = breakdown(cfg, mem).staging
    wider = breakdown(cfg, replace(mem, down_dtypes=("int8",))).staging
    grow = down_bytes(D, F, "int8", (1,)) - down_bytes(D, F, "q4_k", (1,))
    assert grow > 0 and wider - base == 2 * 3 * grow
    assert breakdown(cfg, replace(mem, down_dtypes=("int8", "q8_0"))).staging == base + 2 * 3 * max(
        grow, down_bytes(D, F, "q8_0", (1,)) - down_bytes(D, F, "q4_k", (1,)))
    narrow = replace(mem, cpu_dtype="int8", down_dtypes=("q4_k",))
    assert breakdown(cfg, narrow).staging == breakdown(cfg, replace(narrow, down_dtypes=())).staging


def test_budget_placement_leaves_the_residents_what_the_plan_leaves(tmp_path):
    """Under --gpu-budget the load-time placement subtracts what it built (weights, KV cache, staging) and what the
    plan counts that no load can measure yet (graph buffers, one prefill pass's activations, the reserve), the
    latter exactly the plan's breakdown's figures for the engine's settings."""
    import torch
    from tiny_models import make_checkpoint

    from hybrid.loading.place import fixed_vram, modeled_vram
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig
    from hybrid.runtime import Engine
    from hybrid.runtime.config import RuntimeConfig

    make_checkpoint("qwen3_moe", tmp_path, seed=0)
    hcfg = HybridConfig(gpu_experts=0, schedule="cpu", cpu_isa="ref", profile="ktransformers-paper-amx")
    model, off = load_hybrid(tmp_path, "cpu", torch.float32, hcfg, progress=False)
    engine = Engine(model, config=RuntimeConfig(max_batch=2, max_context=32, eager=True, prefill_chunk=16))
    lane = off.ship_lane
    mem = breakdown(model.cfg, MemorySettings(max_context=32, max_batch=2, gpu_dtype_bytes=4, prefill_chunk=16,
                                              staging_slots=lane.n_slots, ship_chunk=lane.chunk))
    modeled = modeled_vram(model.cfg, engine, off, None)
    assert modeled == mem.graph_buffers + mem.prefill_activations + mem.reserve
    assert mem.prefill_activations > 0 and mem.reserve > 0
    assert fixed_vram(model, engine.cache.nbytes, off) >= mem.non_expert + mem.kv_cache
