"""A profile `hybrid calibrate` wrote on a machine without CUDA (CPU figures only) works in every command: its own
CPU figures price the CPU lane, only the GPU and link figures are borrowed from the built-in fallback, the log
says exactly that, and every command falls back the same way (placement.hardware.pricing_profile)."""

from __future__ import annotations

import json

import pytest

from hybrid.cli import main
from placement.hardware import BUILTIN_PROFILES, FALLBACK_PROFILE, HardwareProfile, default_profile_path, pricing_profile

FALLBACK = BUILTIN_PROFILES[FALLBACK_PROFILE]
CURVE = {"avx2": [[1.0, 5e10], [64.0, 2e11]]}


def cpu_only_profile(path):
    """As `hybrid calibrate` writes it without CUDA: CPU curves, GPU and link figures null."""
    return HardwareProfile(name="cpu-box", cpu_flops={"avx2": 2e11}, dram_bw=2e10, gpu_flops=None, hbm_bw=None,
                           link_bw=None, alpha=None, cpu_curves=CURVE, machine={"hidden": 2048, "intermediate": 768},
                           source="calibrated").save(path)


def assert_borrowed(hw):
    """This machine's CPU figures, the fallback's GPU ones."""
    assert hw.cpu_flops == {"avx2": 2e11} and hw.dram_bw == 2e10 and hw.cpu_curves == CURVE
    assert (hw.gpu_flops, hw.hbm_bw, hw.link_bw, hw.alpha) == (FALLBACK.gpu_flops, FALLBACK.hbm_bw, FALLBACK.link_bw,
                                                               FALLBACK.alpha)
    assert hw.machine["gpu_figures_from"] == FALLBACK_PROFILE and hw.machine["hidden"] == 2048


@pytest.fixture
def cpu_json(tmp_path):
    return cpu_only_profile(tmp_path / "cpu.json")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from hybrid.runtime.demo import build_tokenizer
    from loader_cases import write_tiny

    path = write_tiny(tmp_path_factory.mktemp("cpu_profile") / "m")
    build_tokenizer(path, vocab_size=300)
    return path


def test_pricing_profile_keeps_cpu_figures_and_says_what_it_borrows(cpu_json):
    notes = []
    hw = pricing_profile(str(cpu_json), note=notes.append)
    assert_borrowed(hw)
    assert len(notes) == 1 and "'cpu-box' has no GPU figures" in notes[0]
    assert f"its own CPU figures (B_D, C_C) and only the GPU and link figures (C_G, B_H, B_L, alpha) of the built-in " \
           f"{FALLBACK_PROFILE}" in notes[0]
    notes.clear()
    assert pricing_profile(FALLBACK_PROFILE, note=notes.append) is FALLBACK and notes == []  # nothing borrowed
    assert pricing_profile(hw, note=notes.append) is hw and notes == []  # resolved once, passed on as it is


def test_pricing_profile_without_any_falls_back_to_one_builtin():
    assert not default_profile_path().exists()  # the tests' cache holds no calibrated profile
    notes = []
    assert pricing_profile(None, note=notes.append) is FALLBACK and "no calibrated profile" in notes[0]
    assert pricing_profile(None, note=notes.append, say_fallback=False) is FALLBACK and len(notes) == 1


def test_calibrated_cpu_only_profile_is_the_default_everywhere(capsys):
    cpu_only_profile(default_profile_path())
    try:
        assert main(["cost", "--experts", "2", "--tokens", "1,64", "--json"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["profile"] == f"cpu-box+{FALLBACK_PROFILE}" and "no GPU figures" in err
        assert main(["plan", "--gpu-budget", "2GiB", "--cpu-budget", "4GiB", "--reserve", "0", "--json"]) == 0
        out, err = capsys.readouterr()
        basis = json.loads(out)["prediction_basis"]
        assert basis["profile"] == f"cpu-box+{FALLBACK_PROFILE}" and f"built-in {FALLBACK_PROFILE}" in basis["note"]
        assert "no GPU figures" in err
    finally:
        default_profile_path().unlink()


def test_cost_falls_back_to_the_same_builtin_as_the_runtime(capsys):
    from hybrid.offload.config import FALLBACK_PROFILE as RUNTIME_FALLBACK

    assert RUNTIME_FALLBACK == FALLBACK_PROFILE  # the runtime's own name for it, until it reads the one rule
    assert not default_profile_path().exists()
    assert main(["cost", "--tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"] == FALLBACK_PROFILE


def test_explicit_cpu_only_profile_in_cost_and_plan(cpu_json, capsys):
    assert main(["cost", "--profile", str(cpu_json), "--tokens", "1,64"]) == 0
    out, err = capsys.readouterr()
    assert f"profile cpu-box+{FALLBACK_PROFILE}" in out and err.count("\n") == 1 and "no GPU figures" in err
    assert main(["cost", "layer", "--profile", str(cpu_json), "--tokens", "1,8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"] == f"cpu-box+{FALLBACK_PROFILE}"
    # every GPU figure on the command line: none is borrowed, and nothing is said
    assert main(["cost", "--profile", str(cpu_json), "--tokens", "1", "--gpu-flops", "1e14", "--hbm-bw", "1e12",
                 "--link-bw", "2e10", "--alpha", "1e-5", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["profile"] == "cpu-box" and err == ""
    assert main(["plan", "--gpu-budget", "2GiB", "--cpu-budget", "4GiB", "--reserve", "0", "--profile",
                 str(cpu_json)]) == 0
    out = capsys.readouterr().out
    assert f"the built-in {FALLBACK_PROFILE}'s GPU figures (profile cpu-box+{FALLBACK_PROFILE}: CPU calibrated" in out


def test_generate_schedules_with_the_cpu_figures(cpu_json, tiny_ckpt, capsys):
    assert main(["generate", "--model", str(tiny_ckpt), "-n", "1", "--json", "--profile", str(cpu_json),
                 "--schedule", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["hybrid"]["profile"] == f"cpu-box+{FALLBACK_PROFILE}"
    assert "hybrid: profile 'cpu-box' has no GPU figures" in err and "only the GPU and link figures" in err


class Reached(Exception):
    """Raised by a stand-in for a bench's model builder: the profile it was handed is all the test needs."""


def test_benches_accept_a_cpu_only_profile(cpu_json, monkeypatch, tmp_path, capsys):
    from bench import crossover, hybrid_e2e, layer_sweep, plan_eval

    seen = {}

    def record(name, hw):
        seen[name] = hw
        raise Reached

    monkeypatch.setattr(hybrid_e2e, "build", lambda a, hw, d, t: record("hybrid_e2e", hw))
    monkeypatch.setattr(layer_sweep, "build_layer", lambda s, hw, *a, **k: record("layer_sweep", hw))
    monkeypatch.setattr(crossover, "run_sweep", lambda shape, hw, **k: record("crossover", hw))
    monkeypatch.setattr(plan_eval, "load_hybrid", lambda m, d, t, hcfg, **k: record("plan_eval", hcfg.profile))
    runs = {"hybrid_e2e": lambda: hybrid_e2e.main(["--preset", "demo", "--layers", "1", "--profile", str(cpu_json),
                                                   "--out", str(tmp_path)]),
            "layer_sweep": lambda: layer_sweep.main(["--shape", "qwen3-30b-a3b", "--profile", str(cpu_json)]),
            "crossover": lambda: crossover.main(["--profile", str(cpu_json), "--out", str(tmp_path)]),
            "plan_eval": lambda: plan_eval.main(["--profile", str(cpu_json), "--device", "cpu", "--out", str(tmp_path)])}
    for name, run in runs.items():
        with pytest.raises(Reached):
            run()
        assert_borrowed(seen[name])
    assert capsys.readouterr().out.count("no GPU figures") == len(runs)
