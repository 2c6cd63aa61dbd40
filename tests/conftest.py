"""Test-wide fixtures.

Hermetic cache: every test sees HYBRID_CACHE pointing at a temporary directory made for this test session,
never the user's ~/.cache/hybrid. A profile written there by `hybrid calibrate` (say, on a machine without a
GPU) would otherwise change what `hybrid cost`, the scheduler and the planner read, and tests would pass or
fail by what the developer ran before. The directory is shared by the session's tests so caches written there
(packed experts) are built once; tests that need an empty cache set their own (monkeypatch.setenv wins over this one).
Subprocesses started by tests inherit it through os.environ.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_SESSION_CACHE: Path | None = None


def pytest_configure(config):
    # Before collection and before any fixture: module-scoped fixtures and subprocess environments built at
    # import time see the temporary cache too.
    global _SESSION_CACHE
    import tempfile

    _SESSION_CACHE = Path(tempfile.mkdtemp(prefix="hybrid-test-cache-"))
    os.environ["HYBRID_CACHE"] = str(_SESSION_CACHE)
    _interpret_triton_without_cuda()


def _interpret_triton_without_cuda():
    """Without CUDA the fused decode kernels (hybrid.gpu_kernels) are checked by Triton's interpreter, which
    must be chosen before Triton is first imported (its own library functions are decorated at import)."""
    import sys

    import torch

    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        return
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before tests/conftest.py could select its interpreter")
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_unconfigure(config):
    import shutil

    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def _session_cache():
    return _SESSION_CACHE


@pytest.fixture(autouse=True)
def hermetic_cache(_session_cache, tmp_path_factory, monkeypatch):
    from cpu_kernels import knobs

    current = os.environ.get("HYBRID_CACHE")
    if current and current != str(_session_cache) and \
            Path(current).resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve()):
        knobs.reset()
        yield Path(current)  # a module fixture already chose a temporary cache of its own
        knobs.reset()
        return
    monkeypatch.setenv("HYBRID_CACHE", str(_session_cache))
    knobs.reset()  # each test parses the HYBRID_* variables afresh (cpu_kernels.knobs caches them)
    yield _session_cache
    knobs.reset()


@pytest.fixture
def set_knob(monkeypatch):
    """set_knob(NAME, value): a HYBRID_* variable for this test, parsed afresh (cpu_kernels.knobs caches them)."""
    from cpu_kernels import knobs

    def set_to(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        knobs.reset()
    yield set_to
    knobs.reset()


@pytest.fixture(scope="session")
def demo_model_1layer():
    """The demo preset cut to one layer, random fp32 weights on the CPU (seed 0, std 0.1): a real model for tests of
    the engine and server around it, built once per session. Tests must not change its weights."""
    import torch

    from hybrid.models import build_empty, init_random_
    from hybrid.models.families import family_for
    from hybrid.models.presets import hf_config

    raw = hf_config("demo", layers=1)
    return init_random_(build_empty(family_for(raw).parse_config(raw), "cpu", torch.float32), seed=0, std=0.1)
