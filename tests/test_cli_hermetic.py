"""The tests never read the user's ~/.cache/hybrid (tests/conftest.py), and `hybrid cost` with a profile
calibrated without a GPU falls back with a note instead of failing."""

from __future__ import annotations

import os
from pathlib import Path

from hybrid.cli import main
from placement.hardware import HardwareProfile, default_profile_path


def test_cache_is_a_temporary_directory():
    home_cache = Path.home() / ".cache" / "hybrid"
    assert os.environ.get("HYBRID_CACHE")
    assert not default_profile_path().resolve().is_relative_to(home_cache.resolve())


def _cpu_only_profile(path: Path) -> None:
    HardwareProfile(name="cpu-box", cpu_flops={"avx2": 1e11}, dram_bw=2e10, gpu_flops=None, hbm_bw=None,
                    link_bw=None, alpha=None).save(path)


def test_cost_with_cpu_only_calibrated_profile_falls_back(capsys):
    _cpu_only_profile(default_profile_path())
    try:
        assert main(["cost", "--experts", "2", "--tokens", "1,64"]) == 0
        out, err = capsys.readouterr()
        assert "no GPU figures" in err and "ktransformers-paper" in err
        assert "T_C" in out
    finally:
        default_profile_path().unlink()


def test_cost_with_explicit_cpu_only_profile_keeps_its_cpu_figures(tmp_path, capsys):
    """An explicit --profile without GPU figures is used for what it has: its CPU figures, the GPU and link figures
    borrowed from the built-in fallback, and a note saying exactly that."""
    p = tmp_path / "cpu.json"
    _cpu_only_profile(p)
    assert main(["cost", "--profile", str(p), "--tokens", "1"]) == 0
    out, err = capsys.readouterr()
    assert "cpu-box" in err and "ktransformers-paper" in err and "T_C" in out


