"""The AMX knee is derived from measurements, not a constant from an old run (issue 16)."""

import torch

import cpu_kernels
from cpu_kernels import knee
from cpu_kernels.moe import AMX_KNEE


def test_knee_from_times():
    ms = [4, 8, 16, 32]
    # the GPU box's two runs (bench/results/h200-cpu_moe, 235B bf16, ms per call): run2 knee 8, run4 16
    assert knee.knee_from_times(ms, [3.82, 4.86, 7.38, 12.45], [4.98, 4.52, 4.56, 5.03]) == 8
    assert knee.knee_from_times(ms, [4.70, 6.00, 9.26, 14.53], [6.01, 6.65, 5.78, 6.00]) == 16
    # int8 run4: AMX slower at 8 and 16, faster only at 32
    assert knee.knee_from_times(ms, [3.91, 4.28, 4.48, 6.62], [6.21, 4.42, 4.63, 4.03]) == 32
    # one noisy win below a loss does not pull the knee down; never winning puts it past the sweep
    assert knee.knee_from_times(ms, [2, 2, 3, 4], [1, 3, 2, 3]) == 16
    assert knee.knee_from_times(ms, [1, 1, 1, 1], [2, 2, 2, 2]) == 64


def test_calibrated_knee_is_the_default(monkeypatch):
    monkeypatch.setattr(knee, "_DEFAULT", {})
    w = [torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), torch.zeros(2, 16, 8)]
    assert cpu_kernels.CpuMoE(*w, dtype="bf16", isa="ref").amx_min_tokens == AMX_KNEE["bf16"]
    knee.set_default_knee({"bf16": 24, "int8": 40})
    assert cpu_kernels.CpuMoE(*w, dtype="bf16", isa="ref").amx_min_tokens == 24
    assert cpu_kernels.CpuMoE(*w, dtype="int8", isa="ref").amx_min_tokens == 40
    assert cpu_kernels.CpuMoE(*w, dtype="bf16", isa="ref", amx_min_tokens=3).amx_min_tokens == 3  # explicit wins
    knee.set_default_knee(None)  # a profile without a measured knee changes nothing
    assert cpu_kernels.CpuMoE(*w, dtype="bf16", isa="ref").amx_min_tokens == 24


def test_int4_takes_the_tiles_only_from_a_measured_knee(monkeypatch):
    """int4's AMX path has no box timing yet: unmeasured, its knee is out of reach; a calibrated one applies."""
    from cpu_kernels.moe import AMX_NEVER

    monkeypatch.setattr(knee, "_DEFAULT", {})
    w = [torch.zeros(2, 64, 64), torch.zeros(2, 64, 64), torch.zeros(2, 64, 64)]
    assert cpu_kernels.CpuMoE(*w, dtype="int4", isa="ref").amx_min_tokens == AMX_NEVER
    knee.set_default_knee({"int4": 12})
    assert cpu_kernels.CpuMoE(*w, dtype="int4", isa="ref").amx_min_tokens == 12
