"""The e2e bench's bounds (bench.bounds) bound: the prefill bound is at most every split's time, the decode
roofline counts the distinct experts each step really read; and the bench runs on the CPU (smoke)."""

import itertools
import json

import numpy as np
import pytest

from bench.bounds import decode_step_bound, distinct_per_step, integral_split_time, split_lower_bound


def test_split_bound_by_hand():
    # CPU times 6, 3, 1 and tau 2: shipping all of the 6 leaves CPU 4 > link 2, so the balance is inside
    # the 3: 4 - 3 (k - 1) = 2 k -> k = 1.4, T* = 2.8 (CPU 6 + 3 + 1 - 6 - 0.4 x 3 = 2.8 = 1.4 x 2)
    assert split_lower_bound(np.array([6.0, 1.0, 3.0]), 2.0, 0.0) == pytest.approx(2.8)
    assert split_lower_bound(np.array([6.0, 1.0, 3.0]), 2.0, 5.0) == pytest.approx(5.0)  # resident GPU work
    assert split_lower_bound(np.array([0.0, 0.0]), 2.0, 0.5) == 0.5  # nothing cold has tokens
    # one expert: c k-fraction balance c (1 - k) = k tau -> T* = c tau / (c + tau)
    assert split_lower_bound(np.array([3.0]), 1.0, 0.0) == pytest.approx(0.75)


@pytest.mark.parametrize("seed", range(20))
def test_split_bound_never_above_any_split(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    cpu_t = rng.choice([0.0, 0.1, 0.5, 1.0, 3.0], size=n) * rng.uniform(0.5, 2, size=n)
    gpu_t = rng.uniform(0, 0.2, size=n) * (cpu_t > 0)
    tau, g0 = float(rng.uniform(0.1, 2)), float(rng.uniform(0, 2))
    bound = split_lower_bound(cpu_t, tau, g0)
    active = cpu_t > 0
    best = min(integral_split_time(cpu_t, np.array(bits) & active, tau, gpu_t, g0)
               for bits in itertools.product([False, True], repeat=n))
    assert bound <= best + 1e-12
    # and not trivially low: the LP optimum has at most one fractional expert; putting it on the CPU
    # and adding back the dropped GPU compute of the shipped ones gives an integral split within this
    assert best <= bound + cpu_t.max() + gpu_t.sum() + 1e-12


def test_distinct_experts_counted_per_step_not_averaged():
    # concentrated routing: step 1 reads experts 0-3, step 2 experts 4-7 (4 each): exactly 4 distinct per
    # step; a Poisson estimate from the average load (1 per expert) gives 8 x (1 - e^-1) = 5.06 in total
    resident = np.array([False] * 6 + [True] * 2)
    steps = [np.array([2, 1, 1, 1, 0, 0, 0, 0]), np.array([0, 0, 0, 0, 1, 1, 2, 1])]
    assert distinct_per_step(steps, resident) == (3.0, 1.0)  # (4 + 2) / 2 cold, (0 + 2) / 2 resident
    t = decode_step_bound([(3.0, 1.0), (2.0, 2.0)], cold_bytes=10.0, resident_bytes=5.0, dense_bytes=100.0,
                          dram_bw=10.0, hbm_bw=100.0)
    assert t == pytest.approx(max(3.0, 0.05) + max(2.0, 0.1) + 1.0)


def test_hybrid_e2e_smoke(tmp_path):
    """bench.hybrid_e2e on the CPU: demo shape, one layer, reference kernels (numbers mean nothing here)."""
    from bench.hybrid_e2e import main
    from hybrid.models.presets import hf_config

    assert main(["--preset", "demo", "--layers", "1", "--profile", "ktransformers-paper-amx", "--prefill", "32",
                 "--decode-batch", "1,2", "--steps", "3", "--strategies", "cost", "--isa", "ref",
                 "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "hybrid_e2e_demo.json").read_text())
    row = res["results"][0]
    topk = hf_config("demo")["num_experts_per_tok"]
    # one token reads exactly top-k distinct experts per layer per step, cold or resident
    assert row["decode_b1_cold_experts_per_layer_step"] + row["decode_b1_resident_experts_per_layer_step"] == topk
    assert topk <= row["decode_b2_cold_experts_per_layer_step"] + row["decode_b2_resident_experts_per_layer_step"] <= 2 * topk
    # the prefill bound is below the old all-ship link time (it may split) and above the measured time
    assert row["prefill_32_bound_tok_s"] >= row["prefill_32_all_ship_link_tok_s"]
    assert 0 < row["prefill_32_of_bound"] <= 1
    # repeated reads: a share; the bound with them served by the LLC is never slower than the DRAM-only one
    for b in (1, 2):
        assert 0 <= row[f"decode_b{b}_cold_reused_from_last_step"] <= 1
        assert sum(row[f"decode_b{b}_cold_tokens_per_expert"].values()) == pytest.approx(1.0)
        assert row[f"decode_b{b}_llc_roofline_tok_s"] >= row[f"decode_b{b}_roofline_tok_s"]
    assert res["measured"]["llc_bytes"] >= 0
    assert res["measured"]["dram_bw"] > 0 and res["measured"]["dram_buffer_bytes"] >= 256 << 20


def test_reuse_counted_against_the_step_before_and_llc_bound_never_slower():
    from bench.bounds import llc_adjusted, reused_per_step, reused_share

    resident = np.array([False] * 6 + [True] * 2)
    # step 1 reads cold 0-3, step 2 cold 2-5 (2 of its 4 again), step 3 cold 2-5 again (all 4); resident 6
    # and 7 never count
    steps = [np.array([1, 1, 1, 1, 0, 0, 1, 0]), np.array([0, 0, 2, 1, 1, 1, 0, 1]),
             np.array([0, 0, 1, 1, 1, 1, 1, 1])]
    assert reused_per_step(steps, resident) == pytest.approx((2 + 4) / 2)
    assert reused_share(steps, resident) == pytest.approx((0.5 + 1.0) / 2)
    assert reused_per_step(steps[:1], resident) == 0.0 and reused_share([steps[0]] * 2, resident) == 1.0
    layers = [(4.0, 1.0), (2.0, 0.0)]
    # an LLC large enough for every reused expert takes them all out; one of a quarter of their bytes a quarter
    assert llc_adjusted(layers, [3.0, 1.0], cold_bytes=10.0, llc_bytes=1e9) == [(1.0, 1.0), (1.0, 0.0)]
    assert llc_adjusted(layers, [3.0, 1.0], cold_bytes=10.0, llc_bytes=10.0) == [(3.25, 1.0), (1.75, 0.0)]
    assert llc_adjusted(layers, [0.0, 0.0], cold_bytes=10.0, llc_bytes=10.0) == layers
    plain = decode_step_bound(layers, 10.0, 5.0, 100.0, 10.0, 100.0)
    assert decode_step_bound(llc_adjusted(layers, [3.0, 1.0], 10.0, 10.0), 10.0, 5.0, 100.0, 10.0, 100.0) < plain


def test_decode_bound_prices_resident_reads_at_hbm_when_they_are_the_longer_side():
    # 1 cold expert of 10 B at 10 B/s (1 s) against 4 resident ones of 50 B at 100 B/s (2 s): the layer takes
    # the longer side, 2 s, plus the dense 100 B at 100 B/s; the resident reads at DRAM speed would give 20 s
    t = decode_step_bound([(1.0, 4.0)], cold_bytes=10.0, resident_bytes=50.0, dense_bytes=100.0, dram_bw=10.0,
                          hbm_bw=100.0)
    assert t == pytest.approx(2.0 + 1.0)


def test_reuse_share_counts_steps_that_repeat_nothing():
    from bench.bounds import reused_share

    resident = np.array([False] * 4 + [True])
    # cold reads {0, 1}, then {2, 3} (none again: share 0), then {2, 3} (both again: 1), then only the resident
    # expert (no cold read: no share at all)
    steps = [np.array([1, 1, 0, 0, 0]), np.array([0, 0, 1, 1, 0]), np.array([0, 0, 2, 1, 0]),
             np.array([0, 0, 0, 0, 3])]
    assert reused_share(steps, resident) == pytest.approx((0.0 + 1.0) / 2)
    assert reused_share(steps[:2], resident) == 0.0  # every step reads new experts


def test_tokens_per_cold_expert_counts_each_cold_read_once_by_its_tokens():
    from bench.bounds import tokens_per_cold_expert

    resident = np.array([False] * 5 + [True])
    # layer 1, two steps: cold reads with 1, 3 tokens, then 2, 9, 1 (the resident expert's 4 never counts);
    # layer 2, one step: 5 and 8 tokens
    one = ([np.array([1, 0, 3, 0, 0, 4]), np.array([2, 9, 0, 1, 0, 4])], resident)
    two = ([np.array([0, 5, 0, 0, 8, 0])], resident)
    got = tokens_per_cold_expert([one, two])
    assert got == pytest.approx({"1": 2 / 7, "2": 1 / 7, "3-4": 1 / 7, "5-8": 2 / 7, "9+": 1 / 7})
    assert tokens_per_cold_expert([([np.zeros(6)], resident)]) == {k: 0.0 for k in got}
