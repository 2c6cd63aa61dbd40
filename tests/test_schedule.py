"""The per-batch split: hand-checked histograms, exhaustive optimality on small layers, strategies."""

import itertools
from dataclasses import replace
import time

import numpy as np
import pytest

from hybrid.errors import UsageError
from placement.cost_model import PRESETS, ExpertShape, cpu_compute_time, gpu_compute_time
from placement.hardware import BUILTIN_PROFILES, HardwareProfile
from placement.layer_model import CPU, SHIP, layer_time
from placement.schedule import LayerScheduler, Strategy, parse_strategy

QWEN = PRESETS["qwen3-235b-a22b"]
AVX = BUILTIN_PROFILES["ktransformers-paper-avx512"]
AMX = BUILTIN_PROFILES["ktransformers-paper-amx"]
TAU = AVX.alpha + QWEN.weight_bytes / AVX.link_bw  # 1.51 ms per expert on the paper box


def test_parse_strategy():
    assert parse_strategy("cost") == Strategy("cost")
    assert parse_strategy("threshold:32") == Strategy("threshold", 32)
    assert str(parse_strategy("threshold:7")) == "threshold:7"
    for bad in ("fast", "threshold:", "threshold:-1", ""):
        with pytest.raises(UsageError):
            parse_strategy(bad)


def test_all_cpu_is_best_for_decode():
    # 8 experts x 1 token: each costs ~0.18 ms on the CPU, 1.5 ms to ship.
    s = LayerScheduler(QWEN, AMX).decide(np.array([1] * 8 + [0] * 8), batch_tokens=1)
    assert not s.ship.any()
    assert s.cpu_lane == pytest.approx(2 * AMX.alpha + 8 * 2 * 4096 * 2 / AMX.link_bw
                                       + 8 * QWEN.weight_bytes / AMX.dram_bw)


def test_all_ship_is_best_for_big_prefill_on_avx512():
    # 4096 tokens on each of 4 experts: 86 ms each on AVX-512, 1.5 ms to ship.
    s = LayerScheduler(QWEN, AVX).decide(np.array([4096] * 4), batch_tokens=2048)
    assert s.ship.all()


def test_mixed_split_by_hand():
    # 16 experts x 128 tokens on the AMX box: 0.227 ms each on the CPU (compute-bound), 1.51 ms to ship.
    # Shipping k: CPU lane ~ (16-k)*0.227 ms (+ rows), GPU lane ~ k*1.51 ms. k=2 balances best.
    hist = np.array([128] * 16)
    s = LayerScheduler(QWEN, AMX).decide(hist, batch_tokens=256)
    assert int(s.ship.sum()) == 2
    c = float(cpu_compute_time(QWEN, AMX, 128))
    rows = 14 * 128
    assert s.cpu_lane == pytest.approx(2 * AMX.alpha + rows * 2 * 4096 * 2 / AMX.link_bw + 14 * c)
    assert s.gpu_lane == pytest.approx(2 * TAU + float(gpu_compute_time(QWEN, AMX, 128)))
    assert s.total < min(LayerScheduler(QWEN, AMX, "cpu").decide(hist, 256).total,
                         LayerScheduler(QWEN, AMX, "ship").decide(hist, 256).total)


def test_ships_the_most_expensive_experts():
    hist = np.array([1, 300, 2, 500, 0, 3] + [64] * 10)
    s = LayerScheduler(QWEN, AMX).decide(hist, batch_tokens=512)
    assert s.ship[3] and s.ship[1] and not s.ship[4]
    shipped_m = hist[s.ship]
    kept_m = hist[~s.ship & (hist > 0)]
    assert shipped_m.min() >= kept_m.max()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("hw", [AVX, AMX], ids=["avx512", "amx"])
def test_cost_split_is_optimal_over_all_subsets(seed, hw):
    rng = np.random.default_rng(seed)
    hist = rng.choice([0, 1, 3, 40, 200, 900, 3000], size=8)
    busy = float(rng.uniform(0, 3e-3))
    s = LayerScheduler(QWEN, hw).decide(hist, batch_tokens=int(hist.sum()), gpu_busy=busy)
    best = min(
        layer_time(QWEN, hw, hist, [SHIP if b else CPU for b in bits], shared_gpu_time=busy).total
        for bits in itertools.product([False, True], repeat=hist.size))
    max_g = float(gpu_compute_time(QWEN, hw, hist).max())
    assert s.total <= best + 1e-12
    assert s.total >= best - max_g  # shipping order only moves the GPU lane by one expert's compute


def test_threshold_and_fixed_strategies():
    hist = np.array([5, 0, 7])
    assert not LayerScheduler(QWEN, AMX, "threshold:32").decide(hist, batch_tokens=31).ship.any()
    s = LayerScheduler(QWEN, AMX, "threshold:32").decide(hist, batch_tokens=32)
    assert list(s.ship) == [True, False, True]
    assert list(LayerScheduler(QWEN, AMX, "ship").decide(hist, 1).ship) == [True, False, True]
    assert not LayerScheduler(QWEN, AMX, "cpu").decide(np.array([4096] * 3), 4096).ship.any()


def test_cannot_ship_falls_back_to_cpu():
    s = LayerScheduler(QWEN, AVX, "ship", can_ship=False).decide(np.array([4096, 4096]), 4096)
    assert not s.ship.any()


def test_empty_histogram_and_growing_tables():
    sched = LayerScheduler(QWEN, AVX, max_m=16)
    s = sched.decide(np.zeros(8, dtype=int), batch_tokens=0, gpu_busy=1e-3)
    assert not s.ship.any() and s.cpu_lane == 0.0 and s.gpu_lane == 1e-3
    s = sched.decide(np.array([5000]), batch_tokens=5000)  # beyond the first table
    assert s.ship.all() and sched.max_m >= 5000
    # the fixed strategies' path and the resident GPU time grow their tables too, and price as a big table does
    big = LayerScheduler(QWEN, AVX, "cpu")
    small = LayerScheduler(QWEN, AVX, "cpu", max_m=16)
    assert small.gpu_time(np.array([40])) == pytest.approx(big.gpu_time(np.array([40]))) and small.max_m >= 40
    small = LayerScheduler(QWEN, AVX, "cpu", max_m=16)
    cpu = small.decide(np.array([3, 40]), 40)
    assert small.max_m >= 40 and cpu.cpu_lane == pytest.approx(big.decide(np.array([3, 40]), 40).cpu_lane)


def test_decision_time_reported(capsys):
    sched = LayerScheduler(QWEN, AMX)
    rng = np.random.default_rng(0)
    hists = [rng.multinomial(512 * 8, np.ones(128) / 128) for _ in range(200)]
    for h in hists:
        h[::4] = 0  # experts without tokens, which must never ship
    t0 = time.perf_counter()
    splits = [sched.decide(h, batch_tokens=512) for h in hists]
    per = (time.perf_counter() - t0) / len(hists)
    # what a layer call times as its decision (HybridExperts.stats.decide_s): resident GPU time + split,
    # a Qwen3-30B-A3B layer at batch 8 with 32 of 128 experts resident
    q30 = PRESETS["qwen3-30b-a3b"]
    hist8 = rng.multinomial(8 * 8, np.ones(128) / 128)
    res, cold = np.arange(0, 128, 4), np.setdiff1d(np.arange(128), np.arange(0, 128, 4))
    layer_us = {}
    for strategy in ("cost", "cpu"):
        sc = LayerScheduler(q30, AMX, strategy)
        t1 = time.perf_counter()
        for _ in range(500):
            sc.decide(hist8[cold], batch_tokens=8, gpu_busy=sc.gpu_time(hist8[res]), rows=8)
        layer_us[strategy] = (time.perf_counter() - t1) / 500 * 1e6
    with capsys.disabled():
        print(f"\n[scheduler] cost decision over 128 experts: {per * 1e6:.1f} us per layer (this machine); "
              f"30B layer call at batch 8: cost {layer_us['cost']:.1f} us, cpu {layer_us['cpu']:.1f} us")
    # the timed decisions are real ones: only experts with tokens ship, and each split is no worse than
    # its two fixed neighbours (ship nothing / ship every active expert; the shipping order may move the
    # GPU lane by one expert's compute)
    for h, s in zip(hists, splits):
        assert not (s.ship & (h == 0)).any()
        fixed = min(sched.predict(h, np.zeros(h.shape, bool)).total, sched.predict(h, h > 0).total)
        assert s.total <= fixed + float(sched.ship_g[h].max())
    assert all(s.ship.any() and not s.ship[h > 0].all() for h, s in zip(hists, splits))  # real mixed splits
    # and no worse than any "ship the k most CPU-expensive" split, priced by predict (its own code path)
    for h, s in zip(hists[:10], splits):
        by_cpu = np.argsort(-sched.cpu_t[h], kind="stable")[: int((h > 0).sum())]
        best = min(sched.predict(h, np.isin(np.arange(h.size), by_cpu[:k])).total for k in range(by_cpu.size + 1))
        assert s.total <= best + float(sched.ship_g[h].max())


def test_runtime_overheads_enter_the_decision():
    from dataclasses import replace

    hist = np.array([128] * 16)
    base = LayerScheduler(QWEN, AMX).decide(hist, 256)
    assert int(base.ship.sum()) == 2
    # a large per-shipped-expert cost makes shipping lose; the layer's fixed cost adds to the total
    slow = replace(AMX, ship_expert_overhead=5e-3, layer_overhead=1e-4, cpu_lane_overhead=2e-4)
    s = LayerScheduler(QWEN, slow).decide(hist, 256)
    assert not s.ship.any()
    assert s.total == pytest.approx(1e-4 + 2e-4 + base.cpu_lane + 2 * float(cpu_compute_time(QWEN, AMX, 128))
                                    + 2 * 128 * 2 * 4096 * 2 / AMX.link_bw)


@pytest.mark.parametrize("seed", range(6))
def test_compiled_search_equals_its_python_source(seed):
    """The numba-compiled split search and the same function run as plain Python (the fallback when
    numba is missing) agree exactly, on random histograms with ties, zeros and a rows override."""
    from placement.split_search import COMPILED, best_split

    if not COMPILED:
        pytest.skip("numba not installed: only the Python version exists")
    rng = np.random.default_rng(seed)
    hw = BUILTIN_PROFILES["ktransformers-paper-amx"]
    sched = LayerScheduler(PRESETS["qwen3-30b-a3b"], hw, "cost")
    for _ in range(20):
        n = int(rng.integers(1, 130))
        hist = rng.choice([0, 0, 1, 1, 2, 5, 40, 300], size=n).astype(np.int64)
        rows = int(rng.integers(-1, 3 * int(hist.sum()) + 2))
        busy = float(rng.uniform(0, 5e-3))
        head = float(rng.choice([0.0, rng.uniform(0, 2e-3)]))
        args = (hist, sched.cpu_t, sched.ship_g, sched.tau, 2 * hw.alpha + sched.cpu_fixed, sched.row_time, rows, busy,
                head)
        a, b = np.empty(n, dtype=np.bool_), np.empty(n, dtype=np.bool_)
        ra = best_split(*args, a)
        rb = best_split.py_func(*args, b)
        assert ra == rb and np.array_equal(a, b)


def test_cpu_lane_head_start_is_priced():
    """The CPU lane starts before the layer call's fixed cost is over (cpu_lane_start < layer_overhead)
    and runs through the rest of it: a split costs fixed + max(CPU lane - head, GPU lane). Checked by hand
    on a batch the AVX-512 box ships part of without a head start: with a head start longer than its whole
    CPU lane, nothing is worth shipping and the layer costs just the fixed part plus the resident work."""
    from dataclasses import replace

    base = replace(BUILTIN_PROFILES["ktransformers-paper-avx512"], layer_overhead=0.5)
    hist = np.array([300, 300, 200, 100, 50, 8, 1, 0])
    no_head = LayerScheduler(QWEN, base).decide(hist, 600, gpu_busy=1e-4)
    assert no_head.ship.any() and no_head.head == 0.0
    assert no_head.total == pytest.approx(0.5 + max(no_head.cpu_lane, no_head.gpu_lane))
    early = replace(base, cpu_lane_start=0.05)  # head start 0.45 s > the whole CPU lane (~20 ms here)
    s = LayerScheduler(QWEN, early).decide(hist, 600, gpu_busy=1e-4)
    assert not s.ship.any() and s.head == pytest.approx(0.45)
    assert s.cpu_lane == pytest.approx(LayerScheduler(QWEN, base, "cpu").decide(hist, 600).cpu_lane)
    assert s.total == pytest.approx(0.5 + 1e-4)  # the CPU lane ends inside the fixed part
    partial = replace(base, cpu_lane_start=0.5 - 0.01)  # 10 ms head start: the split moves toward the CPU
    p = LayerScheduler(QWEN, partial).decide(hist, 600, gpu_busy=1e-4)
    assert p.ship.sum() < no_head.ship.sum() and p.total < no_head.total
    assert p.total == pytest.approx(0.5 + max(p.cpu_lane - 0.01, p.gpu_lane))


def test_an_expert_without_tokens_is_never_shipped():
    """predict ignores a ship flag on an expert with no tokens: no weights cross the link for nothing."""
    sched = LayerScheduler(QWEN, AMX)
    hist = np.array([0, 40, 0, 7])
    asked = sched.predict(hist, np.array([True, True, True, False]))
    just = sched.predict(hist, np.array([False, True, False, False]))
    assert asked.ship.tolist() == [False, True, False, False]
    assert (asked.cpu_lane, asked.gpu_lane) == (just.cpu_lane, just.gpu_lane)
    assert asked.gpu_lane > sched.predict(hist, np.zeros(4, dtype=bool)).gpu_lane  # the shipped one does count


# The scheduler's decisions and lane times against hand arithmetic.
#
# The compiled-vs-Python check runs the same source, so it cannot see a logic slip in it (the CPU lane's rows
# not scaled, the ship lane's per-chunk overhead dropped). Here the expected numbers are worked out
# by hand from the cost model's formulas (placement/cost_model.py, DESIGN section 3) on a made-up machine
# whose times come out round:
#
#     expert: D = 1000, F = 500, bf16 -> P = 3 D F = 1.5e6 parameters, W = 3e6 bytes
#     CPU kernel  cpu(m) = max(2 m P / 3e12, W / 1e11)        = max(m, 30) us
#     GPU stage   gpu(m) = max(2 m P / 3e14, W / 1e12)        = 3 us for m <= 300
#     one row there and back: 2 D 2 B / 1e10 B/s             = 0.4 us
#     tau (one expert shipped) = alpha + W / 1e10 + per-expert copy overhead = 10 + 300 + 10 = 320 us
#     a shipped expert's GPU stage = gpu(m) + per-chunk overhead / chunk = 3 + 160 / 8 = 23 us
#     CPU lane fixed part = 2 alpha + cpu_lane_overhead = 20 + 40 = 60 us
#     layer call: fixed 30 us, of which the CPU lane runs through head = 30 - 10 = 20 us
#
# CPU lane = 60 + (rows moved) x 0.4 + sum cpu(m); the rows of a batch of `rows` tokens are shared by its
# experts, so a partial CPU lane moves rows x (its tokens / all tokens) in the search (all of `rows` in the
# fixed strategies, which keep every expert or none). GPU lane = flow shop: transfer j, then its 23 us
# stage when the GPU is free, behind gpu_busy. A split costs 30 + max(CPU lane - 20, GPU lane).

US = 1e-6
SHAPE = ExpertShape("guard", 1000, 500, num_experts=16, topk=4)
HW = HardwareProfile("guard", cpu_flops={"k": 3e12}, dram_bw=1e11, gpu_flops=3e14, hbm_bw=1e12, link_bw=1e10,
                     alpha=10 * US, cpu_lane_overhead=40 * US, ship_chunk_overhead=160 * US,
                     ship_expert_overhead=10 * US, layer_overhead=30 * US, cpu_lane_start=10 * US)


def _sched(strategy):
    return LayerScheduler(SHAPE, HW, strategy, max_m=512, chunk=8)


def _check(split, ship, cpu_us, gpu_us):
    assert split.ship.tolist() == ship
    assert split.cpu_lane == pytest.approx(cpu_us * US, rel=1e-9)
    assert split.gpu_lane == pytest.approx(gpu_us * US, rel=1e-9)
    assert split.total == pytest.approx(30 * US + max(cpu_us - 20 if cpu_us else 0.0, gpu_us) * US, rel=1e-9)


def test_constants_as_worked_out_above():
    s = _sched("cpu")
    assert s.tau == pytest.approx(320 * US) and s.row_time == pytest.approx(0.4 * US)
    assert s.lane_fixed == pytest.approx(60 * US) and s.head == pytest.approx(20 * US)
    assert s.cpu_t[[1, 30, 75, 100]] == pytest.approx(np.array([30, 30, 75, 100]) * US)
    assert s.ship_g[[1, 300]] == pytest.approx(np.array([23, 23]) * US)


def test_cpu_strategy_moves_the_batch_rows():
    # 25 tokens routed to 4 cold experts (100 token-expert pairs): the lane moves 25 rows, not 100
    hist = np.array([50, 20, 0, 30])
    split = _sched("cpu").decide(hist, batch_tokens=25, gpu_busy=5 * US, rows=25)
    _check(split, [False] * 4, 60 + 25 * 0.4 + (50 + 30 + 30), 5)  # 180 us
    # without the batch's row count (a lone predict): the histogram's pairs are the rows
    _check(_sched("cpu").predict(hist, np.zeros(4, bool)), [False] * 4, 60 + 100 * 0.4 + 110, 0)


def test_ship_strategy_carries_the_chunk_overhead():
    hist = np.array([50, 20, 0, 30])
    # link-bound: transfers at 320, 640, 960 us, each stage 23 us after its transfer
    _check(_sched("ship").decide(hist, batch_tokens=25, rows=25), [True, True, False, True], 0, 960 + 23)
    # GPU-bound behind 2 ms of resident work: every shipped expert's 23 us stage shows
    _check(_sched("ship").decide(hist, batch_tokens=25, gpu_busy=2000 * US, rows=25),
           [True, True, False, True], 0, 2000 + 3 * 23)
    # threshold:N switches between the two fixed lanes' prices at N tokens
    _check(_sched("threshold:25").decide(hist, batch_tokens=25, rows=25), [True, True, False, True], 0, 983)
    _check(_sched("threshold:26").decide(hist, batch_tokens=25, rows=25), [False] * 4, 180, 0)


def test_cost_keeps_all_on_cpu_when_shipping_one_costs_more():
    # 50 tokens, experts [100, 100, 75]: all on the CPU lane 60 + 50 x 0.4 + 275 = 355 -> 335 after the head
    # start; shipping expert 0 gives a GPU lane of 320 + 23 = 343 > 335. Without the row scaling the CPU
    # lane would look like 60 + 275 x 0.4 + 275 = 445 and without the chunk share shipping like 323 < 335:
    # either slip ships expert 0.
    split = _sched("cost").decide(np.array([100, 100, 75]), batch_tokens=50, rows=50)
    _check(split, [False, False, False], 355, 0)


def test_cost_partial_cpu_lane_moves_its_share_of_the_rows():
    # 100 tokens, experts [200, 40, 40] (280 pairs). All CPU: 60 + 40 + 280 = 380 -> 360. Ship expert 0:
    # CPU lane 60 + 100 x (80 / 280) x 0.4 + 80 = 151.43 -> 131.43, GPU lane 343: span 343 < 360. Ship two:
    # GPU lane 640 + 23. So expert 0 ships, and the CPU lane moves 80/280 of the batch's rows.
    split = _sched("cost").decide(np.array([200, 40, 40]), batch_tokens=100, rows=100)
    _check(split, [True, False, False], 60 + 100 * (80 / 280) * 0.4 + 80, 343)


def test_cost_split_behind_resident_work():
    # 300 us of resident GPU work ahead: shipping expert 0 ends at max(300, 320) + 23 = 343 anyway, while
    # shipping its stage behind 400 us ends at 423 > all-CPU's 360 -> keep all on the CPU
    hist = np.array([200, 40, 40])
    _check(_sched("cost").decide(hist, batch_tokens=100, gpu_busy=300 * US, rows=100),
           [True, False, False], 60 + 100 * (80 / 280) * 0.4 + 80, 343)
    _check(_sched("cost").decide(hist, batch_tokens=100, gpu_busy=400 * US, rows=100),
           [False, False, False], 380, 400)


def test_block_formats_are_priced_at_the_vector_kernels_rate():
    # A profile of an AMX machine with both curves: int8 keeps the profile's choice (the best of both per m, as the
    # executor switches at its knee), q4_k and int4 at group 32 (no AMX path) get the vector curve, and with it a
    # long prompt's experts go to the ship lane that AMX's rate would have kept on the CPU.
    from placement.hardware import priced_kernel

    hw = replace(AMX, name="amx-and-vector", cpu_flops={"amx": 21.3e12, "avx512_bf16": 1.8e12}, cpu_kernel="auto")
    assert priced_kernel(hw, "int8", None, "amx") is None
    assert priced_kernel(hw, "int4", 128, "amx") is None
    assert priced_kernel(hw, "int4", 32, "amx") == "avx512_bf16"
    for dtype in ("q4_k", "q6_k", "q8_0", "q4_0", "mxfp4", "iq4_xs"):
        assert priced_kernel(hw, dtype, None, "amx") == "avx512_bf16"
        assert priced_kernel(hw, dtype, None) == "avx512_bf16"  # the profile's best kind stands for the machine
        assert priced_kernel(hw, dtype, None, "avx512_bf16") is None  # no AMX: the executor's own ISA
    assert priced_kernel(replace(hw, cpu_kernel="amx"), "q4_k", None, "amx") is None  # a pinned profile keeps it
    counts = np.array([256] * 16)
    amx_rate = LayerScheduler(QWEN, hw).decide(counts, batch_tokens=512)
    vector_rate = LayerScheduler(QWEN, hw, cpu_kernel="avx512_bf16").decide(counts, batch_tokens=512)
    assert vector_rate.ship.sum() > amx_rate.ship.sum()


def test_a_profile_without_the_vector_curve_says_so():
    from placement.hardware import priced_kernel

    notes, amx_only = [], replace(AMX, cpu_kernel="auto")
    assert priced_kernel(amx_only, "q4_k", None, "amx", note=notes.append) is None
    assert len(notes) == 1 and "avx512_bf16" in notes[0] and "q4_k" in notes[0] and "hybrid calibrate" in notes[0]
    assert priced_kernel(amx_only, "int8", None, "amx", note=notes.append) is None and len(notes) == 1
