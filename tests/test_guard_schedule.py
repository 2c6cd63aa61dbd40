"""The scheduler's decisions and lane times against hand arithmetic (issue 16).

The compiled-vs-Python check runs the same source, so a logic slip in it (the CPU lane's rows not scaled,
the ship lane's per-chunk overhead dropped) passed every test. Here the expected numbers are worked out
by hand from the cost model's formulas (placement/cost_model.py, DESIGN section 3) on a made-up machine
whose times come out round:

    expert: D = 1000, F = 500, bf16 -> P = 3 D F = 1.5e6 parameters, W = 3e6 bytes
    CPU kernel  cpu(m) = max(2 m P / 3e12, W / 1e11)        = max(m, 30) us
    GPU stage   gpu(m) = max(2 m P / 3e14, W / 1e12)        = 3 us for m <= 300
    one row there and back: 2 D 2 B / 1e10 B/s             = 0.4 us
    tau (one expert shipped) = alpha + W / 1e10 + per-expert copy overhead = 10 + 300 + 10 = 320 us
    a shipped expert's GPU stage = gpu(m) + per-chunk overhead / chunk = 3 + 160 / 8 = 23 us
    CPU lane fixed part = 2 alpha + cpu_lane_overhead = 20 + 40 = 60 us
    layer call: fixed 30 us, of which the CPU lane runs through head = 30 - 10 = 20 us

CPU lane = 60 + (rows moved) x 0.4 + sum cpu(m); the rows of a batch of `rows` tokens are shared by its
experts, so a partial CPU lane moves rows x (its tokens / all tokens) in the search (all of `rows` in the
fixed strategies, which keep every expert or none). GPU lane = flow shop: transfer j, then its 23 us
stage when the GPU is free, behind gpu_busy. A split costs 30 + max(CPU lane - 20, GPU lane).
"""

import numpy as np
import pytest

from placement.cost_model import ExpertShape
from placement.hardware import HardwareProfile
from placement.schedule import LayerScheduler

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
