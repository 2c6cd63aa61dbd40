"""Test-wide fixtures.

Hermetic cache: every test sees HYBRID_CACHE pointing at a temporary directory made for this test session,
never the user's ~/.cache/hybrid. A profile written there by `hybrid calibrate` (say, on a machine without a
GPU) would otherwise change what `hybrid cost`, the scheduler and the planner read, and tests would pass or
fail by what the developer ran before. The directory is shared by the session's tests so the demo checkpoint
is built once; tests that need an empty cache set their own (monkeypatch.setenv wins over this one).
Subprocesses started by tests inherit it through os.environ.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid-cache")


@pytest.fixture(autouse=True)
def hermetic_cache(_session_cache, tmp_path_factory, monkeypatch):
    current = os.environ.get("HYBRID_CACHE")
    if current and Path(current).resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve()):
        yield Path(current)  # a module fixture already chose a temporary cache of its own
        return
    monkeypatch.setenv("HYBRID_CACHE", str(_session_cache))
    yield _session_cache
