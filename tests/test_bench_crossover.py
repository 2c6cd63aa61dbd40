"""The crossover bench says whether a prediction is in-sample (the profile's CPU curves were calibrated on
the swept shape) or a hold-out, and sweeps a hold-out shape beside the calibrated one."""

import dataclasses

from bench.crossover import calibration_match, main
from placement.cost_model import PRESETS
from placement.hardware import BUILTIN_PROFILES


def _profile(shape_name):
    return dataclasses.replace(BUILTIN_PROFILES["ktransformers-paper-avx512"], machine={"shape": shape_name})


def test_calibration_match():
    big, small = PRESETS["qwen3-235b-a22b"], PRESETS["qwen3-30b-a3b"]
    assert calibration_match(_profile("qwen3-235b-a22b"), big)["holdout"] is False
    assert calibration_match(_profile("qwen3-235b-a22b"), small)["holdout"] is True
    assert calibration_match(BUILTIN_PROFILES["ktransformers-paper-avx512"], small)["holdout"] is None


def test_holdout_sweep_cpu_only(tmp_path):
    path = tmp_path / "p.json"
    _profile("qwen3-235b-a22b").save(path)
    assert main(["--profile", str(path), "--shapes", "qwen3-30b-a3b", "--tokens", "1,2", "--experts", "1",
                 "--backend", "torch", "--reps", "1", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "crossover_holdout.md").read_text()
    assert "| qwen3-30b-a3b | hold-out (calibrated on qwen3-235b-a22b) |" in table
    assert (tmp_path / "crossover_qwen3-30b-a3b.json").exists()
