"""Cost model: DESIGN section 3's worked example, thresholds, batch level, profiles."""

import json
import math

import numpy as np
import pytest

from hybrid.errors import UsageError
from placement import cost_model as cm
from placement.hardware import BUILTIN_PROFILES, HardwareProfile, load_profile
from placement.layer_model import CPU, RESIDENT, SHIP, histogram, layer_time

QWEN = cm.PRESETS["qwen3-235b-a22b"]
AVX = BUILTIN_PROFILES["ktransformers-paper-avx512"]
AMX = BUILTIN_PROFILES["ktransformers-paper-amx"]
MIB = 2**20


def test_qwen3_235b_expert_numbers():
    assert QWEN.params == 18_874_368
    assert QWEN.weight_bytes == 36 * MIB
    assert QWEN.hidden == 4096 and QWEN.act_bytes == 2


@pytest.mark.parametrize("value, expected, tol", [
    # (8 experts back to back) DESIGN section 3 table, "~" values to the stated precision
    (lambda: 8 * QWEN.weight_bytes / AVX.dram_bw, 1.37e-3, 0.005e-3),
    (lambda: 8 * float(cm.t_cpu(QWEN, AVX, 1)), 1.46e-3, 0.005e-3),
    (lambda: 8 * (AVX.alpha + QWEN.weight_bytes / AVX.link_bw), 12.1e-3, 0.05e-3),
    (lambda: 8 * float(cm.t_gpu(QWEN, AVX, 1)), 12.5e-3, 0.05e-3),
    (lambda: 8 * float(cm.t_cpu(QWEN, AVX, 128)), 22.2e-3, 0.05e-3),
    (lambda: 8 * float(cm.t_cpu(QWEN, AMX, 128)), 2.57e-3, 0.005e-3),
])
def test_worked_example_table(value, expected, tol):
    assert abs(value() - expected) <= tol


def test_amx_and_avx512_share_the_one_token_cpu_time():
    # Both are bandwidth-bound at one token: the instruction set does not matter there.
    assert float(cm.t_cpu(QWEN, AVX, 1)) == pytest.approx(float(cm.t_cpu(QWEN, AMX, 1)))


def test_crossover_avx512_exact():
    assert cm.crossover_tokens(QWEN, AVX) == 72
    assert cm.t_gpu(QWEN, AVX, 71) >= cm.t_cpu(QWEN, AVX, 71)
    assert cm.t_gpu(QWEN, AVX, 72) < cm.t_cpu(QWEN, AVX, 72)


def test_crossover_amx_exact():
    assert cm.crossover_tokens(QWEN, AMX) == 689
    assert cm.t_gpu(QWEN, AMX, 688) >= cm.t_cpu(QWEN, AMX, 688)
    assert cm.t_gpu(QWEN, AMX, 689) < cm.t_cpu(QWEN, AMX, 689)


def test_knees():
    assert cm.knee_tokens(QWEN, AVX) == pytest.approx(8.18, abs=0.01)
    assert cm.knee_tokens(QWEN, AMX) == pytest.approx(96.8, abs=0.05)
    # For 2-byte weights the knee is C_C / B_D.
    assert cm.knee_tokens(QWEN, AVX) == pytest.approx(AVX.cpu_flops["avx512"] / AVX.dram_bw)


def test_knee_is_where_cpu_turns_compute_bound():
    knee = cm.knee_tokens(QWEN, AVX)
    below, above = math.floor(knee), math.ceil(knee)
    bw_time = QWEN.weight_bytes / AVX.dram_bw
    assert float(cm.cpu_compute_time(QWEN, AVX, below)) == pytest.approx(bw_time)
    assert float(cm.cpu_compute_time(QWEN, AVX, above)) > bw_time


def test_no_crossover_returns_none():
    slow_link = HardwareProfile(name="slow", cpu_flops={"x": 1e15}, dram_bw=1e12, gpu_flops=1e9, hbm_bw=1e11,
                                link_bw=1e6, alpha=1e-3, cpu_kernel="x")
    assert cm.crossover_tokens(QWEN, slow_link, limit=10_000) is None


def test_zero_tokens_cost_nothing():
    assert float(cm.t_cpu(QWEN, AVX, 0)) == 0.0
    assert float(cm.t_gpu(QWEN, AVX, 0)) == 0.0


def test_vectorised_matches_scalar():
    ms = [1, 7, 72, 300]
    vec = cm.t_cpu(QWEN, AVX, ms)
    assert np.allclose(vec, [float(cm.t_cpu(QWEN, AVX, m)) for m in ms])


def test_expected_active_experts():
    assert cm.expected_active_experts(128, 8, 1) == pytest.approx(8.0)
    assert cm.expected_active_experts(128, 8, 0) == 0.0
    # 512 assignments (64 tokens x top-8) touch on average 128*(1-(120/128)^64) experts.
    assert cm.expected_active_experts(128, 8, 64) == pytest.approx(128 * (1 - (120 / 128) ** 64))
    assert cm.expected_weight_bytes(128, 8, 1, 36 * MIB) == pytest.approx(8 * 36 * MIB)
    with pytest.raises(UsageError):
        cm.expected_active_experts(8, 9, 1)


def test_curve_interpolation_and_auto_kernel():
    hw = HardwareProfile(name="c", cpu_flops={"a": 4e12, "b": 1e12}, dram_bw=1e11, gpu_flops=1e14, hbm_bw=1e12,
                         link_bw=5e10, alpha=1e-5, cpu_curves={"a": [[1, 1e11], [100, 4e12]]})
    # log-linear between the points, clamped outside
    assert float(hw.cpu_flops_at(10, "a")) == pytest.approx((1e11 + 4e12) / 2)
    assert float(hw.cpu_flops_at(1000, "a")) == pytest.approx(4e12)
    # 'auto' takes the fastest kind at each m: b's flat 1e12 beats a's curve at m=1
    assert float(hw.cpu_flops_at(1)) == pytest.approx(1e12)
    assert float(hw.cpu_flops_at(100)) == pytest.approx(4e12)


# -- batch level ------------------------------------------------------------------------------------
def test_layer_time_all_cpu_equals_gather_plus_kernels():
    m = np.array([3, 0, 1, 5])
    lt = layer_time(QWEN, AVX, m, [CPU] * 4)
    expected = (2 * AVX.alpha + 2 * 9 * QWEN.hidden * 2 / AVX.link_bw
                + sum(float(cm.cpu_compute_time(QWEN, AVX, k)) for k in m))
    assert lt.total == pytest.approx(expected) and lt.gpu_lane == 0.0 and lt.cpu_tokens == 9


def test_layer_time_ship_pipeline_by_hand():
    # Two shipped experts with 1 token each: transfers back to back; the GPU computes each after arrival.
    lt = layer_time(QWEN, AVX, [1, 1], [SHIP, SHIP])
    tr = AVX.alpha + QWEN.weight_bytes / AVX.link_bw
    comp = float(cm.gpu_compute_time(QWEN, AVX, 1))
    assert lt.link_busy == pytest.approx(2 * tr)
    assert lt.gpu_lane == pytest.approx(2 * tr + comp)  # second compute waits for the second transfer
    assert lt.weight_bytes_shipped == 2 * QWEN.weight_bytes


def test_layer_time_lanes_overlap():
    lt = layer_time(QWEN, AVX, [4, 200, 2], [CPU, SHIP, RESIDENT])
    assert lt.total == pytest.approx(max(lt.cpu_lane, lt.gpu_lane))
    assert lt.cpu_lane > 0 and lt.gpu_lane > 0
    # by hand: the resident expert (2 tokens) runs while the shipped one's weights cross the link; the
    # CPU lane moves 4 rows each way and runs its expert
    tr = AVX.alpha + QWEN.weight_bytes / AVX.link_bw
    gpu = lambda m: float(cm.gpu_compute_time(QWEN, AVX, m))  # noqa: E731
    assert lt.gpu_lane == pytest.approx(max(gpu(2), tr) + gpu(200))
    rows = 2 * AVX.alpha + 2 * 4 * QWEN.hidden * QWEN.act_bytes / AVX.link_bw
    assert lt.cpu_lane == pytest.approx(rows + float(cm.cpu_compute_time(QWEN, AVX, 4)))


def test_layer_time_rejects_bad_lanes():
    with pytest.raises(ValueError):
        layer_time(QWEN, AVX, [1, 2], [CPU])
    with pytest.raises(ValueError):
        layer_time(QWEN, AVX, [1], ["disk"])


def test_histogram():
    assert list(histogram([[0, 2], [2, 3]], 5)) == [1, 0, 2, 1, 0]


# -- profiles ---------------------------------------------------------------------------------------
def test_profile_json_round_trip(tmp_path):
    hw = HardwareProfile(name="rt", cpu_flops={"amx": 1.2e13, "torch": 3e12}, dram_bw=9.9e10, gpu_flops=7.9e14,
                         hbm_bw=4.3e12, link_bw=5.5e10, alpha=1.2e-5, cpu_curves={"amx": [[1, 1e11], [512, 1.2e13]]},
                         machine={"cpu": "test"}, source="calibrated", layer_overhead=1e-3, cpu_lane_start=3e-4)
    path = hw.save(tmp_path / "p.json")
    assert load_profile(path) == hw
    assert hw.cpu_lane_head == pytest.approx(7e-4)  # what the CPU lane overlaps of the call's fixed cost


def test_cpu_only_profile_round_trip_and_gpu_refusal(tmp_path):
    hw = HardwareProfile(name="cpu", cpu_flops={"torch": 1e11}, dram_bw=1e10, gpu_flops=None, hbm_bw=None,
                         link_bw=None, alpha=None)
    assert load_profile(hw.save(tmp_path / "c.json")) == hw
    with pytest.raises(UsageError, match="no GPU"):
        cm.t_gpu(QWEN, hw, 1)


@pytest.mark.parametrize("field, value", [("dram_bw", 0), ("link_bw", -1), ("gpu_flops", float("nan")),
                                          ("alpha", -1e-6), ("hbm_bw", "fast"), ("cpu_lane_start", -1e-6)])
def test_profile_rejects_bad_values(field, value):
    fields = dict(name="x", cpu_flops={"k": 1e12}, dram_bw=1e11, gpu_flops=1e14, hbm_bw=1e12, link_bw=5e10,
                  alpha=1e-5)
    fields[field] = value
    with pytest.raises(UsageError, match=field):
        HardwareProfile(**fields)


def test_profile_curves_are_checked_and_sorted():
    """A measured curve's points are sorted by m (interpolation needs it) and a bad one is refused."""
    fields = dict(name="x", cpu_flops={"k": 1e13}, dram_bw=1e11, gpu_flops=1e14, hbm_bw=1e12, link_bw=5e10,
                  alpha=1e-5)
    hw = HardwareProfile(**fields, cpu_curves={"k": [[64, 1e13], [1, 1e11]]})
    assert hw.cpu_curves == {"k": [[1.0, 1e11], [64.0, 1e13]]}
    assert HardwareProfile(**fields, cpu_curves=None).cpu_curves == {}
    with pytest.raises(UsageError, match="cpu_curves"):
        HardwareProfile(**fields, cpu_curves={"k": [[1, -5.0]]})


def test_profile_load_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_profile(bad)
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"name": "x", "cpu_flops": {"k": 1}}))
    with pytest.raises(UsageError, match="missing field"):
        load_profile(missing)
    with pytest.raises(UsageError, match="not found"):
        load_profile(tmp_path / "nope.json")


def test_crossover_is_the_first_m_where_the_gpu_is_strictly_faster(monkeypatch):
    """A tie keeps the expert on the CPU (no weight traffic for nothing): T_C(m) = m, T_G = 5 -> 6, not 5."""
    monkeypatch.setattr(cm, "t_cpu", lambda shape, hw, m, kernel=None: np.asarray(m, dtype=np.float64))
    monkeypatch.setattr(cm, "t_gpu", lambda shape, hw, m: np.full_like(np.asarray(m, dtype=np.float64), 5.0))
    assert cm.crossover_tokens(None, None, limit=100) == 6
    assert cm.crossover_tokens(None, None, limit=5) is None
